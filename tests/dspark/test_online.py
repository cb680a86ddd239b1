"""Online training (data.mode=online) without vLLM: the bounded buffer's back-pressure, the
rolling window and its prompt cursor, and the trainer on a fake source that streams the tiny
target's shard rows (the live engine: tests/data_tools/test_online_vllm.py)."""

import threading
import time

import pytest
import torch

from dspark.config import ConfigError
from dspark.data.batching import DataPosition
from dspark.data.online import PROMPT_LOG, OnlineBatches, read_prompt_log, stream_meta
from dspark.data.shards import ShardDataset
from dspark.formats.shard_rows import encode_hidden_states
from dspark.formats.stream import BlockProducer, BoundedBuffer, StreamClosed, StreamMeta, producer_blocks
from dspark.formats.stream_remote import RemoteSource, stream_to_trainer
from dspark.recipe import build_trainer
from dspark.target import load_target_heads
from tests.toy import REPO, make_trainer, overrides, torchrun

LAYERS, HIDDEN = 3, 8


def fake_row(i: int, n_tokens: int = 10) -> dict:
    g = torch.Generator().manual_seed(i)
    return {
        "seq_id": f"p{i:03d}",
        "num_tokens": n_tokens,
        "input_ids": torch.randint(0, 100, (n_tokens,), generator=g).tolist(),
        "loss_mask": [0] * 4 + [1] * (n_tokens - 4),
        "hidden_states": encode_hidden_states(torch.randn(n_tokens - 1, LAYERS, HIDDEN, generator=g), "float32"),
    }


class FakeSource(BlockProducer):
    """A SequenceSource over a list of rows (prompt i -> rows[i % n]) on the producer loop every
    engine shares (blocks of ``block`` prompts into a BoundedBuffer); ``skip`` prompts yield
    nothing (too long for the window); ``delay`` seconds per block (a slow engine); ``fail_at``:
    the engine dies on the block that reaches this index."""

    def __init__(
        self,
        rows,
        *,
        layer_ids,
        hidden_size,
        capacity=4,
        skip=(),
        val=(),
        block=1,
        rank=0,
        producers=1,
        delay=0.0,
        fail_at=None,
    ):
        super().__init__(block=block, buffer_size=capacity, rank=rank, producers=producers, poll_s=0.01)
        self.rows, self.skip, self._val, self.delay = rows, set(skip), list(val), delay
        # max_seq_len: the toy rows' 32 tokens fit; it bounds the frames the trainer accepts
        self.meta = StreamMeta(list(layer_ids), hidden_size, "float32", num_prompts=len(rows), max_seq_len=64)
        self.num_prompts = len(rows)
        self.produced = 0
        self.fail_at = fail_at

    def val_rows(self):
        return self._val

    def capture(self, indexes):
        time.sleep(self.delay)
        if self.fail_at is not None and indexes[-1] >= self.fail_at:
            raise RuntimeError(f"engine core died at prompt {indexes[0]}")
        got = [(i, self.rows[i % self.num_prompts]) for i in indexes if i % self.num_prompts not in self.skip]
        self.produced += len(got)
        return got

    def close(self):
        self.stop_thread()


def batches(source, tmp_path, position=None, **kw) -> OnlineBatches:
    args = dict(micro_batch=4, new_per_batch=2, window_size=6, seed=0, context_index=[0, 1], final_index=2)
    args.update(kw)
    meta = stream_meta(source, 0, 1)
    return OnlineBatches(
        source, meta=meta, max_len=64, dtype=torch.float32, position=position, log_dir=tmp_path, **args
    )


def test_a_full_buffer_blocks_the_producer_and_an_empty_one_the_consumer():
    buf = BoundedBuffer(2, poll_s=0.01)
    buf.put(1), buf.put(2)
    waited = []
    t = threading.Thread(target=lambda: waited.append(buf.put(3)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and buf.qsize() == 2  # bounded: the third waits
    assert buf.get() == 1
    t.join(2)
    assert waited and waited[0] >= 0.15
    assert [buf.get(), buf.get()] == [2, 3]
    got = []
    t = threading.Thread(target=lambda: got.append(buf.get()))
    t.start()
    time.sleep(0.1)
    assert t.is_alive()  # the consumer waits for the producer
    buf.put(4)
    t.join(2)
    assert got == [4]
    buf.fail(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        buf.get()
    with pytest.raises(StreamClosed):
        buf.put(5)


def test_window_batches_take_new_sequences_in_order_and_draw_old_ones(tmp_path):
    src = FakeSource([fake_row(i) for i in range(10)], layer_ids=[1, 2, 3], hidden_size=HIDDEN)
    ob = batches(src, tmp_path)
    seen = [ob.next().seq_ids for _ in range(5)]
    src.close()
    assert seen[0] == ["p000", "p001"]  # the window is empty: only the new ones
    assert seen[1][:2] == ["p002", "p003"] and sorted(seen[1][2:]) == ["p000", "p001"]
    for k, ids in enumerate(seen[2:], start=2):
        assert ids[:2] == [f"p{2 * k:03d}", f"p{2 * k + 1:03d}"] and len(set(ids)) == 4
        assert all(int(s[1:]) < 2 * k for s in ids[2:])
    assert ob.pos == DataPosition(1, 0) and ob.cursor == 10
    assert len(ob.window) == 6  # the 6 most recent
    assert src.buffer.qsize() <= 4  # the producer never ran ahead of the buffer


def test_resume_from_the_cursor_enters_the_same_prompts_and_cuts_the_log(tmp_path):
    rows = [fake_row(i) for i in range(7)]

    def run(out, position=None, steps=6, checkpoint_at=None):
        """``steps`` micro batches; the prompt log is appended at ``checkpoint_at`` (whose position
        is returned) and at the end (a save killed before its tag was published, for the killed run)."""
        src = FakeSource(rows, layer_ids=[1, 2, 3], hidden_size=HIDDEN, skip={3})
        ob = batches(src, out, position)
        got, saved = [], None
        for s in range(1, steps + 1):
            got.append(ob.next().seq_ids[:2])
            if s == checkpoint_at:
                ob.flush_log()
                saved = ob.pos
        ob.flush_log()
        src.close()
        return got, src, saved

    full, _, _ = run(tmp_path / "full")
    killed, _, pos = run(tmp_path / "r", steps=5, checkpoint_at=3)
    assert pos == DataPosition(1, 0)  # 6 entered (prompt 3 skipped): the next is prompt 7 = pass 1, index 0
    resumed, src, _ = run(tmp_path / "r", position=pos, steps=3)
    assert src.started_at == [7]
    assert killed[:3] + resumed == full
    log_full = read_prompt_log(tmp_path / "full" / PROMPT_LOG)
    assert read_prompt_log(tmp_path / "r" / PROMPT_LOG) == log_full
    assert [e["index"] for e in log_full] == [0, 1, 2, 4, 5, 6, 7, 8, 9, 11, 12, 13]


@pytest.mark.parametrize("store_dtype", ["float8_e4m3", "float32"])
def test_streamed_fp8_rows_stay_fp8_until_the_batch_is_on_the_device(store_dtype):
    """fp8 is also the wire format: a streamed row keeps a byte per value in the window and the
    batch dequantizes where it lands, to the same numbers as dequantizing on arrival."""
    from dspark.data.batching import collate
    from dspark.data.online import row_to_sequence
    from dspark.data.shards import ShardSequence
    from dspark.formats.shard_rows import decode_hidden_states

    g = torch.Generator().manual_seed(3)
    rows = [
        {
            **fake_row(i, n),
            "hidden_states": encode_hidden_states(torch.randn(n - 1, LAYERS, HIDDEN, generator=g), store_dtype),
        }
        for i, n in ((0, 10), (1, 7))
    ]
    meta = StreamMeta([1, 2, 3][:LAYERS], HIDDEN, store_dtype, num_prompts=2, max_seq_len=16)
    seqs = [row_to_sequence(r, meta, torch.float32) for r in rows]
    assert (seqs[0].scales is not None) == (store_dtype != "float32")
    if seqs[0].scales is not None:
        assert seqs[0].hidden_states.dtype == torch.float8_e4m3fn and seqs[0].scales.shape == (9, LAYERS)
    host = [
        ShardSequence(
            s.seq_id,
            s.input_ids,
            s.loss_mask,
            decode_hidden_states(r["hidden_states"], dtype=store_dtype, n_layers=LAYERS, hidden=HIDDEN),
        )
        for s, r in zip(seqs, rows)
    ]
    ckw = dict(context_index=[0, 1], final_index=2, max_len=64)
    a, b = collate(host, **ckw).to("cpu", torch.float32), collate(seqs, **ckw).to("cpu", torch.float32)
    assert torch.equal(a.context_states, b.context_states) and torch.equal(a.final_states, b.final_states)


def test_online_config_is_checked(compose_config):
    with pytest.raises(ConfigError, match="data.mode='batch': expected one of"):
        compose_config("data.mode=batch")
    with pytest.raises(ConfigError, match="data.online.new_per_micro_batch=5: expected at most"):
        compose_config("data.mode=online", "train.micro_batch_size=4", "data.online.new_per_micro_batch=5")
    with pytest.raises(ConfigError, match="data.online.window_size=2: expected at least"):
        compose_config("data.mode=online", "train.micro_batch_size=4", "data.online.window_size=2")
    with pytest.raises(ConfigError, match="data.online.buffer_size=0"):
        compose_config("data.mode=online", "data.online.buffer_size=0")
    with pytest.raises(ConfigError, match="data.online.producers=2: expected 1 without data.online.trainer_addr"):
        compose_config("data.mode=online", "data.online.producers=2")
    with pytest.raises(ConfigError, match="data.online.producer_rank=2: expected 0 <= producer_rank < data.online.pro"):
        compose_config("data.online.trainer_addr=h", "data.online.producers=2", "data.online.producer_rank=2")
    cfg = compose_config("data.mode=online", "train.micro_batch_size=5")
    assert cfg.new_per_micro_batch() == 3 and compose_config().data.mode == "offline"


def test_producer_blocks_split_the_prompts_from_the_cursor_each_index_once():
    got = {k: [i for _, b in zip(range(4), producer_blocks(5, 3, k, 3)) for i in b] for k in range(3)}
    assert got[0][:6] == [5, 6, 7, 14, 15, 16] and got[2][:3] == [11, 12, 13]
    assert sorted(i for k in got for i in got[k]) == list(range(5, 5 + 36))  # disjoint, no gap


def run_producers(rows, port, *, ranks, producers, timeout_s=30, delays=None, fail_at=None, **kw):
    """Producer threads on the real link (gloo on localhost): (threads, return codes, error messages)."""
    results, errors = [], []

    def produce(k):
        kw_k = {**kw, "fail_at": (fail_at or {}).get(k)}
        src = FakeSource(rows, rank=k, producers=producers, delay=(delays or {}).get(k, 0.0), **kw_k)
        try:
            results.append(stream_to_trainer(src, "127.0.0.1", port, timeout_s=timeout_s))
        except Exception as e:  # noqa: BLE001 - reported to the test (as text: the traceback would keep the link open)
            errors.append(str(e))
        finally:
            src.close()

    threads = [threading.Thread(target=produce, args=(k,), daemon=True) for k in ranks]
    for t in threads:
        t.start()
    return threads, results, errors


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_two_producers_enter_the_prompts_in_the_order_one_producer_gives(slow_rank):
    """Two engines over their links, one of them slow: the trainer reads their blocks back in
    prompt order (skipped prompts leave the same gaps), from a cursor inside a block, with the
    validation set from producer 0 only, and both stop when the trainer closes."""
    from dspark.core.ports import free_port

    rows, port = [fake_row(i) for i in range(10)], free_port(span=2)
    kw = dict(layer_ids=[1, 2, 3], hidden_size=HIDDEN, skip={3, 8}, block=3, capacity=2, val=[fake_row(99)])
    threads, results, errors = run_producers(rows, port, ranks=[0, 1], producers=2, delays={slow_rank: 0.05}, **kw)
    trainer = RemoteSource("127.0.0.1", port, buffer_size=2, timeout_s=30, producers=2)
    assert [r["seq_id"] for r in trainer.val_rows()] == ["p099"]
    trainer.start(4)
    got = [trainer.get().index for _ in range(14)]
    assert got == [i for i in range(4, 40) if i % 10 not in (3, 8)][:14]
    stats = trainer.stats()
    trainer.close()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and errors == [] and results == [0, 0]
    assert 14 <= stats.sequences <= 14 + 2 * (2 + 3)  # what was sent: no more than the buffers and a block ahead


def test_producers_that_disagree_with_the_trainer_are_refused():
    from dspark.config import ConfigError
    from dspark.core.ports import free_port

    rows, port = [fake_row(i) for i in range(4)], free_port(span=2)
    kw = dict(layer_ids=[1, 2, 3], hidden_size=HIDDEN)
    threads, _, _ = run_producers(rows, port, ranks=[0, 1], producers=3, timeout_s=5, **kw)
    with pytest.raises(
        ConfigError, match=r"is producer [01] of 3, the trainer expects producer [01] of data.online.producers=2"
    ):
        RemoteSource("127.0.0.1", port, buffer_size=2, timeout_s=30, producers=2)
    for t in threads:
        t.join(30)


def test_one_of_two_producers_dying_stops_the_trainer_with_its_error():
    """Producer 1's engine dies on its second block: the trainer takes every sequence before that
    block in prompt order, then raises the producer's own error (from the link's store)."""
    from dspark.core.ports import free_port

    rows, port = [fake_row(i) for i in range(20)], free_port(span=2)
    kw = dict(layer_ids=[1, 2, 3], hidden_size=HIDDEN, block=2)
    threads, results, errors = run_producers(rows, port, ranks=[0, 1], producers=2, fail_at={1: 6}, **kw)
    trainer = RemoteSource("127.0.0.1", port, buffer_size=2, timeout_s=30, producers=2)
    trainer.val_rows()
    trainer.start(0)
    got = [trainer.get().index for _ in range(6)]  # blocks 0, 1 (producer 1's first), 2
    with pytest.raises(RuntimeError, match=r"producer 1 failed: RuntimeError: engine core died at prompt 6"):
        trainer.get()  # block 3 is producer 1's second
    trainer.close(wait_s=5)
    for t in threads:
        t.join(30)
    assert got == list(range(6)) and errors == ["engine core died at prompt 6"]


def test_no_prompt_fitting_in_a_whole_pass_is_an_error_with_several_producers():
    from dspark.core.ports import free_port

    rows, port = [fake_row(i) for i in range(6)], free_port(span=2)
    kw = dict(layer_ids=[1, 2, 3], hidden_size=HIDDEN, skip=set(range(6)), block=2)
    threads, _, _ = run_producers(rows, port, ranks=[0, 1], producers=2, timeout_s=10, **kw)
    trainer = RemoteSource("127.0.0.1", port, buffer_size=2, timeout_s=30, producers=2)
    trainer.val_rows()
    trainer.start(0)
    with pytest.raises(ValueError, match="none of the 6 train prompts gave a sequence in a whole pass"):
        trainer.get()
    trainer.close()
    for t in threads:
        t.join(30)


def shard_source(data, layer_ids, hidden, **kw) -> FakeSource:
    """The tiny target's train shard rows as a stream, its val rows as the val set."""
    rows = {}
    for split in ("train", "val"):
        ds = ShardDataset(data, split)
        rows[split] = [
            {
                "seq_id": s.seq_id,
                "num_tokens": len(s.input_ids),
                "input_ids": s.input_ids.tolist(),
                "loss_mask": s.loss_mask.int().tolist(),
                "hidden_states": s.hidden_states.numpy().tobytes(),
            }
            for s in (ds[i] for i in range(len(ds)))
        ]
    return FakeSource(rows["train"], layer_ids=layer_ids, hidden_size=hidden, val=rows["val"], **kw)


@pytest.mark.slow
def test_online_trainer_trains_validates_resumes_at_the_cursor_and_writes_only_checkpoints(
    compose_config,
    tiny,  # noqa: F811
    tmp_path,
):
    target, data = tiny
    run = ("data.mode=online", "train.max_steps=4", "train.save_every=2", "train.eval_every=2")

    def trainer(out, *extra):
        src = shard_source(data, [1, 2, 4], 64)
        cfg = compose_config(*overrides(target, data, out, *run, *extra))
        return build_trainer(cfg, load_target_heads(target), src), src

    tr, _ = trainer(tmp_path / "full")
    full = tr.train()
    assert full.step == 4 and [v["step"] for v in full.validations] == [2, 4]
    entered = read_prompt_log(tmp_path / "full" / "ckpt" / PROMPT_LOG)
    assert [e["index"] for e in entered] == list(range(8))  # 4 steps x 2 new
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["ckpt"]  # no shards, no cache
    tr, _ = trainer(tmp_path / "r")
    tr.train(until=2)
    tr, src = trainer(tmp_path / "r")
    assert tr.state.step == 2 and src.started_at == [4]
    resumed = tr.train()
    assert read_prompt_log(tmp_path / "r" / "ckpt" / PROMPT_LOG) == entered
    assert [h["seq_ids"][:2] for h in resumed.history] == [h["seq_ids"][:2] for h in full.history]
    with pytest.raises(ConfigError, match="no sequence source"):
        make_trainer(compose_config, tiny, tmp_path / "x", *run)


PRODUCER = r"""
import logging
import sys
from dspark.formats.stream import BlockProducer, StreamMeta
from dspark.formats.stream_remote import stream_to_trainer
from dspark.data.shards import ShardDataset

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
data, port, rank, producers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = {}
for split in ("train", "val"):
    ds = ShardDataset(data, split)
    rows[split] = [
        {"seq_id": s.seq_id, "num_tokens": len(s.input_ids), "input_ids": s.input_ids.tolist(),
         "loss_mask": s.loss_mask.int().tolist(), "hidden_states": s.hidden_states.numpy().tobytes()}
        for s in (ds[i] for i in range(len(ds)))
    ]


class Rows(BlockProducer):
    meta = StreamMeta([1, 2, 4], 64, "float32", num_prompts=len(rows["train"]), max_seq_len=64)

    def capture(self, indexes):
        return [(i, rows["train"][i % self.meta.num_prompts]) for i in indexes]

    def val_rows(self):
        return rows["val"]


src = Rows(block=3, buffer_size=2, rank=rank, producers=producers)
print("exit", stream_to_trainer(src, "127.0.0.1", port, timeout_s=120), flush=True)
src.stop_thread()
"""


@pytest.mark.slow
def test_two_ranks_train_from_two_producers_on_other_nodes_and_resume_at_their_cursor(
    tiny,  # noqa: F811
    tmp_path,
):
    """The multi-node layout on one machine: two producer processes (data-parallel engines)
    stream the tiny target's rows in blocks over their torch.distributed links
    (data.online.trainer_addr, data.online.producers=2) to rank 0 of a two-rank torchrun, which
    merges them in prompt order and hands rank 1 its share; a second run resumes from the
    checkpoint's cursor, inside a block."""
    import subprocess
    import sys

    from dspark.core.ports import free_port

    target, data = tiny

    def run(steps: int) -> tuple[str, str]:
        port = free_port(span=2)
        producers = [
            subprocess.Popen(
                [sys.executable, "-c", PRODUCER, str(data), str(port), str(k), "2"],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in range(2)
        ]
        extra = (
            "data.mode=online",
            "data.online.trainer_addr=127.0.0.1",
            f"data.online.port={port}",
            "data.online.producers=2",
            "data.online.connect_timeout_s=120",
            "data.online.new_per_micro_batch=1",
            "train.micro_batch_size=2",
            f"train.max_steps={steps}",
            "train.save_every=2",
            "train.eval_every=2",
        )
        cmd = torchrun("train.py", *overrides(target, data, tmp_path, *extra), f"hydra.run.dir={tmp_path}/run")
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        said = "".join(p.communicate(timeout=120)[0] for p in producers)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:] + said
        assert [p.returncode for p in producers] == [0, 0], said
        return out.stdout + out.stderr, said

    log, said = run(4)
    assert "2 rank(s)" in log and said.count("the trainer starts at prompt 0") == 2 and said.count("exit 0") == 2
    entered = read_prompt_log(tmp_path / "ckpt" / PROMPT_LOG)
    assert [e["index"] for e in entered] == list(range(8))  # 4 steps x 1 new x 2 ranks
    client = torch.load(tmp_path / "ckpt" / "step00000004" / "mp_rank_00_model_states.pt", weights_only=False)
    assert [v["step"] for v in client["validations"]] == [2, 4]
    assert [h["seq_ids"][0] for h in client["history"]] == [f"train-{2 * i:02d}" for i in range(4)]  # rank 0's
    log, said = run(6)
    assert said.count("the trainer starts at prompt 8") == 2  # the checkpoint's cursor, inside a block
    assert [e["index"] for e in read_prompt_log(tmp_path / "ckpt" / PROMPT_LOG)] == list(range(12))
