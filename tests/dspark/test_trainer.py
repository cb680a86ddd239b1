"""The DeepSpeed trainer on a tiny target whose shards are written from transformers in the
declared schema (the real path reads what data_tools.extract writes)."""

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from dspark.core.files import file_sha256
from dspark.core.shard_format import Manifest
from dspark.core.target import load_target_heads
from dspark.recipe import build_trainer
from dspark.trainer import Preempted, Trainer
from tests.toy import TINY_LAYERS as LAYERS  # + final state 4
from tests.toy import build_target_and_shards, overrides, torchrun

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny(tiny_target_and_shards):
    """The session's tiny target and its shards (tests/conftest.py; test_online.py imports this)."""
    return tiny_target_and_shards


def make_trainer(compose_config, tiny, out, *extra) -> Trainer:
    target, data = tiny
    cfg = compose_config(*overrides(target, data, out, *extra))
    return build_trainer(cfg, load_target_heads(target))


def test_frozen_pieces_stay_frozen(compose_config, tiny, tmp_path):
    tr = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=2")
    heads = load_target_heads(tiny[0])
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    for n, p in tr.model.named_parameters():
        if n in ("embed_tokens.weight", "lm_head.weight", "target_norm.weight"):
            assert not p.requires_grad and p.grad is None and torch.equal(p, before[n])
        else:
            assert p.requires_grad
    assert torch.equal(tr.model.lm_head.weight, heads.lm_head) and torch.equal(
        tr.model.embed_tokens.weight, heads.embed_tokens
    )
    changed = [n for n, p in tr.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert (
        "fc.weight" in changed
        and "layers.0.self_attn.q_proj.weight" in changed
        and "markov_head.markov_w2.weight" in changed
    )


@pytest.mark.slow
def test_tiny_run_overfits_to_near_full_acceptance(compose_config, tiny, tmp_path):
    tr = make_trainer(
        compose_config,
        tiny,
        tmp_path,
        "train.max_steps=150",
        "train.log_every=50",
        "logging.wandb=true",
        "logging.mode=offline",
        "train.eval_every=150",
        "train.lr=5e-3",
        "train.min_lr_ratio=0.3",
        "train.anchors_per_seq=16",
    )
    tr.train()
    res = tr.evaluate(tr.batches.ds)  # acceptance on the sequences it was fitted to
    assert res["accept_pos_1"] > 0.9 and res["accept_prob_pos_1"] > 0.85 and res["tau"] > 4.3, (
        res
    )  # tau <= 1 + gamma = 5
    assert res["loss"] < tr.state.history[0]["loss"] / 2
    # W&B (offline, no key) recorded the stable metric names in its run file
    record = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    for k in (
        "train/loss",
        "train/ce",
        "train/tv",
        "train/confidence_bce",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/peak_mem_gb",
        "train/accept_pos_1",
        "train/accept_cond_pos_1",
        "val/tau",
        "val/confidence_ece",
        "val/accept_pos_1",
        "drafter",
    ):
        assert k.encode() in record, k


def test_resume_continues_the_same_loss_curve(compose_config, tiny, tmp_path):
    full = make_trainer(compose_config, tiny, tmp_path / "a", "train.max_steps=6", "train.save_every=3").train()
    make_trainer(compose_config, tiny, tmp_path / "b", "train.max_steps=6", "train.save_every=3").train(until=3)
    resumed = make_trainer(compose_config, tiny, tmp_path / "b", "train.max_steps=6", "train.save_every=3")
    assert resumed.state.step == 3
    state = resumed.train()
    hist = state.history
    assert [h["seq_ids"] for h in hist] == [h["seq_ids"] for h in full.history]
    assert state.data_digest == full.data_digest != ""
    for a, b in zip(hist, full.history):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_a_tag_holds_no_frozen_tensor_and_a_resume_loads_the_rest_strictly(compose_config, tiny, tmp_path):
    """The target's embedding, norm and LM head are frozen and rebuilt from the target, so a tag
    does not hold them (DeepSpeed's exclude_frozen_parameters: at K3's vocabulary they would be GBs
    a tag); a resume gets them from the target and every other tensor from the tag, strictly: a tag
    short of a trainable tensor is refused, naming it."""
    from dspark.checkpoint_tags import CheckpointError

    run = ("train.max_steps=2", "train.save_every=2")
    tr = make_trainer(compose_config, tiny, tmp_path, *run)
    tr.train()
    states_file = tmp_path / "ckpt" / "step00000002" / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    frozen = {n for n, p in tr.engine.module.named_parameters() if not p.requires_grad}
    assert {"drafter.embed_tokens.weight", "drafter.lm_head.weight", "drafter.target_norm.weight"} <= frozen
    assert set(states["module"]) == set(tr.engine.module.state_dict()) - frozen
    resumed = make_trainer(compose_config, tiny, tmp_path, *run)
    assert resumed.state.step == 2
    heads = load_target_heads(tiny[0])
    assert torch.equal(resumed.model.embed_tokens.weight, heads.embed_tokens)
    assert torch.equal(resumed.model.lm_head.weight, heads.lm_head)
    for name, p in tr.model.named_parameters():
        assert torch.equal(dict(resumed.model.named_parameters())[name], p), name
    resumed.close()  # releases the checkpoint directory
    del states["module"]["drafter.fc.weight"]
    torch.save(states, states_file)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) missing from the tag, e\.g\. drafter\.fc\.weight"):
        make_trainer(compose_config, tiny, tmp_path, *run)


def test_a_finished_run_with_changed_settings_or_dataset_is_refused_not_skipped(compose_config, tiny, tmp_path):
    """Issue #37: another lr, another dataset (even a bad path) printed "train up to date, skipped".
    A run is skipped only if nothing that shapes it changed; run-control keys may change."""
    from dspark.checkpoint_run import finished_checkpoint
    from dspark.checkpoint_tags import CheckpointError

    target, data = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=2", "train.save_every=2").train()
    same = compose_config(*overrides(target, data, tmp_path, "train.max_steps=2", "train.log_every=5"))
    assert finished_checkpoint(same) == tmp_path / "ckpt" / "step00000002"  # run control: still skipped
    tag = tmp_path / "ckpt" / "step00000002"
    with pytest.raises(CheckpointError, match=r"train.lr: checkpoint 0.003, now 0.001.*train.resume=" + str(tag)):
        finished_checkpoint(compose_config(*overrides(target, data, tmp_path, "train.max_steps=2", "train.lr=1e-3")))
    other = tmp_path / "other_data"  # the same shards, one of them re-listed: another manifest
    shutil.copytree(data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:-1]
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the dataset \(.*other_data/manifest.json\): checkpoint's manifest"):
        finished_checkpoint(compose_config(*overrides(target, other, tmp_path, "train.max_steps=2")))
    with pytest.raises(CheckpointError, match=r"manifest sha256 [0-9a-f]{12}, now None"):
        finished_checkpoint(compose_config(*overrides(target, tmp_path / "nowhere", tmp_path, "train.max_steps=2")))
    with pytest.raises(CheckpointError, match=r"train.lr: checkpoint 0.003, now 0.001"):  # nor resumed by auto
        make_trainer(compose_config, tiny, tmp_path, "train.max_steps=3", "train.lr=1e-3")
    tr = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=3", "train.lr=1e-3", f"train.resume={tag}")
    assert tr.train().step == 3  # named explicitly: continued with the new settings


def test_resume_paths_and_tags_are_checked_before_deepspeed_reads_them(compose_config, tiny, tmp_path):
    """Issue #37: a missing resume path gave DeepSpeed's AssertionError, a tag without run.json and
    another drafter its load_state_dict traceback."""
    from dspark.checkpoint_tags import CheckpointError

    with pytest.raises(CheckpointError, match=r"train.resume=/nonexistent/step00000001: no such checkpoint tag"):
        make_trainer(
            compose_config, tiny, tmp_path / "a", "train.max_steps=2", "train.resume=/nonexistent/step00000001"
        )
    empty = tmp_path / "empty" / "step00000001"
    empty.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"not a DeepSpeed checkpoint tag \(no \*mp_rank_00_model_states.pt\)"):
        make_trainer(compose_config, tiny, tmp_path / "a", "train.max_steps=2", f"train.resume={empty}")
    make_trainer(compose_config, tiny, tmp_path / "b", "train.max_steps=2", "train.save_every=2").train()
    tag = tmp_path / "b" / "ckpt" / "step00000002"
    (tag / "run.json").unlink()
    for how in (f"train.resume={tag}", "train.resume=auto"):
        with pytest.raises(CheckpointError, match=r"step00000002: no run.json, so its save did not finish"):
            make_trainer(compose_config, tiny, tmp_path / "b", "train.max_steps=3", "drafter.num_layers=2", how)


def test_finished_run_is_skipped_and_another_drafter_is_not_resumed(compose_config, tiny, tmp_path):
    from dspark.checkpoint_run import finished_checkpoint

    target, data = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=2", "train.save_every=2").train()
    cfg = compose_config(*overrides(target, data, tmp_path, "train.max_steps=2"))
    assert finished_checkpoint(cfg) == tmp_path / "ckpt" / "step00000002"
    assert finished_checkpoint(compose_config(*overrides(target, data, tmp_path, "train.max_steps=3"))) is None
    assert (
        finished_checkpoint(
            compose_config(*overrides(target, data, tmp_path, "train.max_steps=2", "drafter.markov_rank=0"))
        )
        is None
    )
    with pytest.raises(ValueError, match=r"another drafter \(drafter.markov_rank: checkpoint 16, now 0\)"):
        make_trainer(compose_config, tiny, tmp_path, "train.max_steps=3", "drafter.markov_rank=0")


def test_fp8_shards_train_bit_for_bit_like_their_host_dequantized_copy(compose_config, tiny, tmp_path):
    """The trainer keeps fp8 shards as stored and each batch is dequantized on its device: the
    run (losses, validation, the target's top-k cache) equals, bit for bit, a run on the same
    shards dequantized to fp32 on the host by ``data_tools.convert``."""
    from data_tools.convert import convert

    target, data = tiny
    q8, f32 = tmp_path / "fp8", tmp_path / "fp32"
    convert(data, q8, store_dtype="float8_e4m3")
    convert(q8, f32, store_dtype="float32")
    runs = {}
    for name, shards in (("fp8", q8), ("fp32", f32)):
        extra = ("train.max_steps=3", "train.target_topk=8", "train.eval_every=3")
        tr = build_trainer(
            compose_config(*overrides(target, shards, tmp_path / name, *extra)), load_target_heads(target)
        )
        kept = tr.batches.ds[0].scales is not None  # fp8 reaches the batch as stored
        assert (tr.batches.ds.manifest.dtype, kept) == {"fp8": ("float8_e4m3", True), "fp32": ("float32", False)}[name]
        runs[name] = (tr.train(), tr.evaluate())
    (a, va), (b, vb) = runs["fp8"], runs["fp32"]
    assert [h["seq_ids"] for h in a.history] == [h["seq_ids"] for h in b.history]
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert va == vb and va["tau"] >= 1.0


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_match_zero_0(compose_config, tiny, tmp_path, stage):
    ref = make_trainer(compose_config, tiny, tmp_path / "z0", "train.max_steps=4", "deepspeed=zero0").train()
    got = make_trainer(
        compose_config, tiny, tmp_path / f"z{stage}", "train.max_steps=4", f"deepspeed=zero{stage}"
    ).train()
    assert [h["loss"] for h in got.history] == pytest.approx([h["loss"] for h in ref.history], rel=1e-5)


@pytest.mark.slow
def test_two_process_gloo_run(tiny, tmp_path):
    target, data = tiny

    cmd = torchrun(
        "train.py",
        *overrides(target, data, tmp_path, "train.max_steps=3", "train.micro_batch_size=2"),
        f"hydra.run.dir={tmp_path}/run",
    )
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "2 rank(s)" in log and "step 3/3" in log
    assert (tmp_path / "ckpt" / "step00000003").is_dir()


def test_shards_for_another_target_are_refused(compose_config, tiny, tmp_path):
    target, data = tiny
    bad = tmp_path / "shards"
    shutil.copytree(data, bad)
    m = Manifest.load(bad)
    m.tokenizer_sha256 = "0" * 64
    m.save(bad)
    with pytest.raises(
        ValueError, match=r"made for another target: field 'tokenizer_sha256' is 000000000000\.\.\., the target has "
    ):
        build_trainer(compose_config(*overrides(target, bad, tmp_path)), load_target_heads(target))
    with pytest.raises(ValueError, match=r"field 'layer_ids' is \[1, 2, 4\], the config expects \[1, 3, 4\]"):
        build_trainer(
            compose_config(*overrides(target, data, tmp_path), "target.layer_ids=[1,3]"), load_target_heads(target)
        )


def test_training_without_a_dataset_says_to_extract_first_and_writes_nothing(compose_config, tiny, tmp_path):
    from dspark.core.shard_format import DatasetError

    target, _ = tiny
    with pytest.raises(
        DatasetError, match=r"data.shards_dir=.*/empty: no dataset there \(no manifest.json\), .*; run "
    ):
        build_trainer(compose_config(*overrides(target, tmp_path / "empty", tmp_path)), load_target_heads(target))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "empty").exists()


def test_a_dataset_of_another_target_is_refused_unless_allowed(compose_config, tiny, tmp_path, caplog):
    """Issue #37: a manifest naming another model, 36 layers and another chat template trained."""
    from dspark.core.shard_format import DatasetError

    target, data = tiny
    other = tmp_path / "other"
    shutil.copytree(data, other)
    m = json.loads((other / "manifest.json").read_text())
    m.update(target="qwen3-8b", num_hidden_layers=36, chat_template_sha256="0" * 64)
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError) as err:
        build_trainer(compose_config(*overrides(target, other, tmp_path / "a")), load_target_heads(target))
    msg = str(err.value)
    assert msg.startswith(f"{other / 'manifest.json'}: made for another target: field 'target' is 'qwen3-8b', the ")
    assert "field 'num_hidden_layers' is 36, the target has 4" in msg
    assert "field 'chat_template_sha256' is 000000" in msg
    assert "data.allow_other_target=true" in msg and "architecture" not in msg
    allowed = overrides(target, other, tmp_path / "b", "data.allow_other_target=true", "train.max_steps=1")
    with caplog.at_level(logging.WARNING, logger="dspark.recipe"):
        tr = build_trainer(compose_config(*allowed), load_target_heads(target))
    assert "made for another target" in caplog.text and "trained anyway" in caplog.text
    assert tr.train().step == 1


def test_a_non_finite_state_stops_training_naming_shard_row_and_sequence(compose_config, tmp_path, smollm2_dir):
    """Issue #37: it was a FloatingPointError from the step naming sequence ids, not the shard."""
    from dspark.core.shard_format import DatasetError

    target, data = build_target_and_shards(tmp_path, smollm2_dir, n_train=4, n_val=0, nan_in=("train", 2))
    tr = build_trainer(
        compose_config(*overrides(target, data, tmp_path, "train.max_steps=3")), load_target_heads(target)
    )
    with pytest.raises(DatasetError, match=r"train/shard-\d+.parquet: row \d+ \(sequence train-02\): 1 non-finite"):
        tr.train()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["offline", "colocated"])
def test_kill_9_then_resume_neither_skips_nor_repeats(tiny, tmp_path, compose_config, mode):
    """Either mode (colocated: the target computes the states in the trainer) resumes at its cursor;
    both train on the uninterrupted offline run's sequences in its order."""
    target, data = tiny
    base = [
        sys.executable,
        "train.py",
        *overrides(target, data, tmp_path, "train.max_steps=10", "train.save_every=2", f"data.mode={mode}"),
        f"hydra.run.dir={tmp_path}/run",
    ]
    # A build lock left by an earlier killed start-up (issue #17): torch would wait on it forever;
    # a one-process run must not even look at it.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    stale = tmp_path / "ext" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    proc = subprocess.Popen(
        base, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while not (tmp_path / "ckpt" / "step00000004").is_dir():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=600).returncode == 0
    client = torch.load(tmp_path / "ckpt" / "step00000010" / "mp_rank_00_model_states.pt", weights_only=False)
    resumed = client["history"]
    full_state = make_trainer(compose_config, tiny, tmp_path / "full", "train.max_steps=10").train()
    full = full_state.history
    assert [h["seq_ids"] for h in resumed] == [h["seq_ids"] for h in full]
    assert client["data_digest"] == full_state.data_digest
    seen = Counter(s for h in resumed for s in h["seq_ids"])
    assert max(seen.values()) - min(seen.values()) <= 1  # 40 draws over 12 sequences: balanced epochs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_saves_stops_and_the_rerun_continues_the_same_run(compose_config, tiny, tmp_path, sig):
    """Issue #17: Slurm's SIGTERM (preemption, requeue) and USR1 (time limit near) save a checkpoint
    at the step boundary and stop with 128 + signum; the rerun matches an uninterrupted run."""
    before = signal.getsignal(sig)
    tr = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=6")
    step, calls = tr.train_step, []

    def step_then_signal():
        out = step()
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)  # arrives mid-loop, before the step is logged or counted
        return out

    tr.train_step = step_then_signal
    with pytest.raises(Preempted) as stop:
        tr.train()
    assert (stop.value.code, stop.value.step) == (128 + sig, 3)
    assert stop.value.checkpoint == tmp_path / "ckpt" / "step00000003"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step00000003"
    assert f"{signal.Signals(sig).name} at step 3: checkpoint" in stop.value.message
    assert signal.getsignal(sig) == before
    resumed = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=6").train()
    full = make_trainer(compose_config, tiny, tmp_path / "full", "train.max_steps=6").train()
    assert [h["seq_ids"] for h in resumed.history] == [h["seq_ids"] for h in full.history]
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in full.history], rel=1e-5)


@pytest.mark.slow
def test_sigterm_to_train_py_saves_and_exits_143(tiny, tmp_path):
    target, data = tiny
    cmd = [
        sys.executable,
        "train.py",
        *overrides(target, data, tmp_path, "train.max_steps=500"),
        f"hydra.run.dir={tmp_path}/run",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # Hydra logs to stdout
        lines.append(line)
        if "step 2/500" in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=120) == 143, "".join(lines[-30:])
    text = "".join(lines)
    assert "SIGTERM at step" in text and "rerun the same command to resume" in text
    assert "Traceback" not in text
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert int(tag.removeprefix("step")) >= 2


def test_a_terminal_gets_a_progress_bar_and_a_log_none(compose_config, tiny, tmp_path, monkeypatch, capsys):
    """Issue #14: steps, loss and predictions/s as a tqdm bar on an interactive terminal only."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=3").train()
    assert re.search(r"train: 100%.*\| 3/3 .*loss=\d+\.\d{3}, pred_s=\d+", term.getvalue()), term.getvalue()[-500:]
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    make_trainer(compose_config, tiny, tmp_path / "b", "train.max_steps=2").train()
    assert "train:" not in sys.stderr.getvalue()


def test_bad_override_gets_hydras_error_not_a_traceback():
    out = subprocess.run(
        [sys.executable, "train.py", "drafter.markov_rank=abc"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "markov_rank" in out.stderr


# --- checkpoints -> vLLM export (dspark.export) -------------------------------------------------


def test_export_from_zero0_and_zero3_checkpoints_gives_the_trained_weights(compose_config, tiny, tmp_path):
    from dspark.export import export
    from dspark.export.validate import validate
    from dspark.export.vllm_format import read_export

    target, _ = tiny
    z0 = make_trainer(
        compose_config, tiny, tmp_path / "z0", "train.max_steps=3", "train.save_every=3", "deepspeed=zero0"
    )
    z0.train()
    z3 = make_trainer(
        compose_config, tiny, tmp_path / "z3", "train.max_steps=3", "train.save_every=3", "deepspeed=zero3"
    )
    z3.train()
    s0 = export(tmp_path / "z0" / "ckpt", tmp_path / "e0")
    s3 = export(tmp_path / "z3" / "ckpt", tmp_path / "e3")
    assert (s0.zero_stage, s3.zero_stage, s3.step) == (0, 3, 3)
    assert s3.vllm_target_layer_ids == [i - 1 for i in LAYERS] and s3.sample_from_anchor is True
    e0, e3 = read_export(tmp_path / "e0"), read_export(tmp_path / "e3")
    trained = {k: v for k, v in z0.model.state_dict().items() if k in e0.weights}
    assert set(trained) == set(e0.weights) and len(trained) > 10
    for k, v in trained.items():
        assert torch.equal(e0.weights[k], v.float()), k
        torch.testing.assert_close(
            e3.weights[k], e0.weights[k], rtol=1e-3, atol=1e-4
        )  # merged ZeRO-3 shards; weights ~0.02
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is True and cfg["markov_rank"] == 16
    )
    rep = validate(tmp_path / "e3", target_dir=target, num_speculative_tokens=4)
    assert rep.vllm_aux_layer_ids == LAYERS and rep.params_checked > 10


def test_export_refuses_bad_checkpoints_and_exports(compose_config, tiny, tmp_path):
    from dspark.checkpoint_tags import CheckpointError
    from dspark.export import export
    from dspark.export.vllm_format import ExportError, read_export

    target, _ = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ExportError, match="sample_from_anchor=true"):
        export(ckpt, tmp_path / "x", layout="dflash")
    export(ckpt, tmp_path / "ok")
    cfg_file = tmp_path / "ok" / "config.json"
    good = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({k: v for k, v in good.items() if k != "sample_from_anchor"}))
    with pytest.raises(ExportError, match="sample_from_anchor' missing"):
        read_export(tmp_path / "ok")
    cfg_file.write_text(json.dumps({**good, "target_layer_ids": LAYERS}))  # the classic off-by-one
    with pytest.raises(ExportError, match=r"name layers \[2, 3\].*trained on \[1, 2\]"):
        read_export(tmp_path / "ok")
    tag = ckpt / "step00000001"
    states_file = tag / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    states["module"]["drafter.fc.weight"] = states["module"]["drafter.fc.weight"][:, :-1]
    torch.save(states, states_file)
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[64, 127\], expected \[64, 128\]"):
        export(ckpt, tmp_path / "y")
    states_file.write_bytes(states_file.read_bytes()[:1000])  # a torn write
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: cannot be read"):
        export(ckpt, tmp_path / "y")
    (tag / "run.json").unlink()
    shutil.rmtree(tag / "mp_rank_00_model_states.pt", ignore_errors=True)
    with pytest.raises(CheckpointError, match="no DeepSpeed checkpoint|not a DeepSpeed checkpoint|cannot be read"):
        export(ckpt, tmp_path / "y")
    assert not (tmp_path / "y").exists()  # nothing half-written is left behind


def test_validate_refuses_an_export_for_another_target(compose_config, tiny, tmp_path, smollm2_dir):
    from dspark.export import export
    from dspark.export.validate import check_target, validate
    from dspark.export.vllm_format import ExportError, read_export

    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    export(tmp_path / "ckpt", tmp_path / "e")
    check_target(read_export(tmp_path / "e"), tiny[0])  # its own target passes
    with pytest.raises(ExportError, match="target states of width 64.*hidden_size is 576"):
        validate(tmp_path / "e", target_dir=smollm2_dir)


def test_logged_loss_is_the_mean_over_the_steps_micro_batches(compose_config, tiny, tmp_path, monkeypatch):
    from dspark.loss import LossOutput

    tr = make_trainer(
        compose_config, tiny, tmp_path, "train.grad_accum_steps=2", "train.micro_batch_size=2", "train.max_steps=2"
    )
    seen, scalars = [], LossOutput.scalars
    monkeypatch.setattr(LossOutput, "scalars", lambda out: seen.append(scalars(out)) or seen[-1])
    m, seq_ids = tr.train_step()
    tr.close()
    assert len(seen) == 2 and seen[0]["loss"] != seen[1]["loss"] and len(seq_ids) == 4
    for key in ("loss", "ce", "tv", "accept_pos_1"):
        assert m[key] == pytest.approx((seen[0][key] + seen[1][key]) / 2)


def test_checkpoint_history_is_bounded_and_the_digest_covers_all_steps():
    from dspark.checkpoint import HISTORY_WINDOW, TrainState

    a, b = TrainState(), TrainState()
    for step in range(HISTORY_WINDOW + 5):
        a.step = b.step = step + 1
        a.record(1.0, [f"s{step}", "x"])
        b.record(1.0, [f"s{step}", "x"] if step != 2 else ["x", "s2"])  # one early step in another order
    assert (
        len(a.history) == HISTORY_WINDOW and a.history[0]["step"] == 6 and a.history[-1]["step"] == HISTORY_WINDOW + 5
    )
    assert [h["seq_ids"] for h in a.history] == [h["seq_ids"] for h in b.history]  # the window cannot tell them apart
    assert a.data_digest != b.data_digest  # the digest can


def test_a_second_run_on_the_same_checkpoint_dir_is_refused(compose_config, tiny, tmp_path):
    import socket

    from dspark.checkpoint_tags import CheckpointInUseError

    first = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1")
    with pytest.raises(
        CheckpointInUseError,
        match=rf"ckpt: in use by another training run \(host {socket.gethostname()}, pid {os.getpid()}",
    ):
        make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1")
    first.train()  # releases the directory
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1").close()


def test_latest_moves_only_after_the_tag_has_its_run_json(compose_config, tiny, tmp_path):
    tr = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=2", "train.save_every=1")
    tr.train(until=1)
    tr = make_trainer(compose_config, tiny, tmp_path, "train.max_steps=2", "train.save_every=1")
    latest = tmp_path / "ckpt" / "latest"
    seen, save = [], tr.engine.save_checkpoint

    def spy(*args, **kwargs):  # DeepSpeed writes the tag's shards; latest must not move yet
        out = save(*args, **kwargs)
        seen.append((latest.read_text(), (tmp_path / "ckpt" / "step00000002" / "run.json").exists()))
        return out

    tr.engine.save_checkpoint = spy
    tr.train()
    assert seen == [("step00000001", False)]
    assert latest.read_text() == "step00000002" and (tmp_path / "ckpt" / "step00000002" / "run.json").is_file()


def test_cached_target_topk_is_computed_once_and_trains(compose_config, tiny, tmp_path):
    target, data = tiny
    shards = tmp_path / "shards"  # the cache is written beside the shards: keep the shared fixture clean
    shutil.copytree(data, shards, ignore=shutil.ignore_patterns(".arrow_cache", ".target_topk"))
    levers = (
        "train.target_topk=8",
        "train.supervise=all",
        "train.copy_anchor_boost=4",
        "train.ce_weight_start=1.0",
        "train.recompute_vocab_chunks=false",
        "train.max_steps=3",
    )
    tr = build_trainer(compose_config(*overrides(target, shards, tmp_path / "a", *levers)), load_target_heads(target))
    files = sorted((shards / ".target_topk" / "train").glob("*-k8-all-*.safetensors"))
    assert len(files) == 1 and not (shards / ".target_topk" / "val").exists()  # validation uses the full distribution
    seq = tr.batches.ds[0]
    tk = seq.target_topk
    assert tk.positions.tolist() == list(range(len(seq.input_ids) - 1))  # supervise=all: every state row
    with torch.no_grad():
        logits = tr.model.target_logits(seq.hidden_states[tk.positions, tr.parts.final_index].float())
    assert torch.equal(tk.ids[:, 0], logits.argmax(-1))
    torch.testing.assert_close(tk.probs, torch.softmax(logits, -1).topk(8, -1).values)
    state = tr.train()
    assert state.step == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in state.history)
    stamp = files[0].stat().st_mtime_ns
    build_trainer(
        compose_config(*overrides(target, shards, tmp_path / "b", *levers)), load_target_heads(target)
    ).close()
    assert files[0].stat().st_mtime_ns == stamp  # read, not recomputed


def test_drafter_layers_start_from_the_targets(compose_config, tiny, tmp_path):
    from dspark.core.config import ConfigError
    from dspark.core.target import load_target_layer

    with pytest.raises(ConfigError, match=r"drafter.rope_theta=1000000.0: expected the target's 10000.0"):
        make_trainer(compose_config, tiny, tmp_path / "a", "train.init_from_target_layers=[3]")
    tr = make_trainer(
        compose_config, tiny, tmp_path / "b", "train.init_from_target_layers=[3]", "drafter.rope_theta=10000"
    )
    want = load_target_layer(tiny[0], 3)
    layer = dict(tr.model.layers[0].named_parameters())
    for name in (
        "self_attn.q_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
    ):
        assert torch.equal(layer[name], want[name]), name
    assert torch.equal(layer["self_attn.q_norm.weight"], torch.ones(16))  # Llama has no q norm: identity
    tr.close()


def test_final_norm_and_markov_inits_and_train_sequences_reads_only_the_first_n(compose_config, tiny, tmp_path):
    heads = load_target_heads(tiny[0])
    plain = make_trainer(compose_config, tiny, tmp_path / "a")
    assert torch.equal(plain.model.norm.weight, heads.final_norm) and not torch.equal(
        heads.final_norm, torch.ones_like(heads.final_norm)
    )
    mk = plain.model.markov_head
    assert not mk.markov_w2.weight.any() and 0.015 < float(mk.markov_w1.weight.std()) < 0.025  # W2 = 0, W1 ~ N(0, .02)
    n_all = len(plain.batches.ds)
    plain.close()
    tr = make_trainer(
        compose_config,
        tiny,
        tmp_path / "b",
        "train.final_norm_init=ones",
        "data.train_sequences=4",
        "train.markov_init=speculators",
    )
    assert torch.equal(tr.model.norm.weight, torch.ones_like(heads.final_norm)) and tr.model.norm.weight.requires_grad
    mk, rank = tr.model.markov_head, tr.cfg.drafter.markov_rank
    assert 0.0075 < float(mk.markov_w1.weight.std()) < 0.0125  # speculators': W1 ~ N(0, 0.01)
    w2 = mk.markov_w2.weight  # and W2 nn.Linear's U(-1/sqrt(rank), 1/sqrt(rank))
    assert w2.abs().max() <= rank**-0.5 and float(w2.abs().mean()) > 0.4 * rank**-0.5
    first = {tr.batches.ds[i].seq_id for i in range(4)}
    read = Counter(s for _ in range(3) for s in tr.batches.next().seq_ids)  # 3 epochs of one micro batch of 4
    assert len(tr.batches.ds) == 4 < n_all and set(read) == first and set(read.values()) == {3}
    tr.close()


def test_validations_are_kept_in_the_checkpoint_and_a_plain_jsonl(compose_config, tiny, tmp_path):
    tr = make_trainer(
        compose_config, tiny, tmp_path, "train.max_steps=4", "train.eval_at_steps=[1,3]", "train.save_every=2"
    )
    state = tr.train()
    lines = [json.loads(x) for x in (tmp_path / "ckpt" / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in lines] == [1, 3, 4] and lines == state.validations
    assert 0 < lines[0]["predictions"] < lines[1]["predictions"] < lines[2]["predictions"] == state.predictions
    assert 0 < lines[0]["train_seconds"] < lines[2]["train_seconds"] and "tau" in lines[2]
    # a resumed run carries the counters on from its checkpoint
    resumed = make_trainer(
        compose_config, tiny, tmp_path, "train.max_steps=6", "train.eval_every=2", "train.save_every=2"
    )
    assert resumed.state.predictions == state.predictions and resumed.state.validations == lines
    resumed.close()


def test_progress_shows_elapsed_and_an_eta_from_this_processes_pace():
    from dspark.trainer import progress

    assert progress(10, 100, start_step=0, elapsed=20.0) == "step 10/100 | elapsed 0:00:20 | eta 0:03:00"
    # resumed at step 500: the pace counts the 100 steps this process ran, not the 600
    assert progress(600, 1000, start_step=500, elapsed=3600.0) == "step 600/1000 | elapsed 1:00:00 | eta 4:00:00"
    assert progress(1000, 1000, start_step=0, elapsed=61.4) == "step 1000/1000 | elapsed 0:01:01 | eta 0:00:00"
    assert progress(3, 10, start_step=3, elapsed=0.0) == "step 3/10 | elapsed 0:00:00 | eta ?"


def test_each_training_log_line_has_step_elapsed_eta_and_tokens_per_s(caplog):
    from types import SimpleNamespace

    class Logger:
        def log(self, data, step):
            self.data = data

    tr = Trainer.__new__(Trainer)  # only what _log_train reads
    tr.state, tr.t = SimpleNamespace(step=20, predictions=0), SimpleNamespace(max_steps=200)
    tr.world, tr.logger, tr._start_step, tr.batches, tr.peak_flops = 1, Logger(), 0, None, None
    m = dict(loss=1.0, ce=1.0, tv=0.5, kl=0.7, confidence_bce=0.1, tau=1.5, lr=1e-3, grad_norm=0.2)
    m.update(tokens=1000.0, step_s=2.0, predictions=100.0, data_s=0.1)
    with caplog.at_level("INFO", logger="dspark.trainer"):
        tr._log_train(m, elapsed=40.0)
    assert caplog.messages[-1].startswith("step 20/200 | elapsed 0:00:40 | eta 0:06:00 | loss 1.0000")
    assert "| 500 tok/s 50 pred/s | data" in caplog.messages[-1]  # no drafter: no FLOPs
    assert "loss 1.0000 (ce 1.000 tv 0.500 kl 0.700 conf 0.100)" in caplog.messages[-1]
    assert tr.logger.data["train/predictions_per_s"] == 50 and "train/tflops_per_s" not in tr.logger.data
    # the step's model FLOPs (dspark.flops): FLOP/s always, MFU only over a known peak (not on a CPU)
    with caplog.at_level("INFO", logger="dspark.trainer"):
        tr._log_train(m | {"flops": 4e12}, elapsed=40.0)
    assert "| 500 tok/s 50 pred/s | 2 TFLOP/s | data" in caplog.messages[-1]
    assert tr.logger.data["train/tflops_per_s"] == 2 and "train/mfu" not in tr.logger.data
    assert tr.logger.data["train/flops_per_prediction"] == 4e10 and "train/flops" not in tr.logger.data
    tr.peak_flops = 989e12  # an H200 in bf16
    with caplog.at_level("INFO", logger="dspark.trainer"):
        tr._log_train(m | {"flops": 4e14}, elapsed=40.0)
    assert " 50 pred/s | 200 TFLOP/s MFU 20.2% | data" in caplog.messages[-1]
    assert tr.logger.data["train/mfu"] == pytest.approx(200 / 989)


# --- faults while saving (issue #17) -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_full_disk_stops_the_save_keeps_latest_and_the_rerun_completes_the_run(
    compose_config, tiny, tmp_path, small_disk, monkeypatch, when
):
    """Room for two tags, not three. ``before``: the size check refuses the third save before it
    writes; ``during``: with that check blinded, torch.save runs out of space mid-tag."""
    from dspark.core.files import DiskFullError

    run = ("train.max_steps=6", "train.save_every=2")
    full = make_trainer(compose_config, tiny, tmp_path / "full", *run).train()
    tag_size = sum(f.stat().st_size for f in (tmp_path / "full" / "ckpt" / "step00000002").iterdir())
    disk = small_disk.mount(2 * tag_size + tag_size // 2)
    tr = make_trainer(compose_config, tiny, disk, *run)
    if when == "during":
        monkeypatch.setattr("dspark.checkpoint.free_bytes", lambda _: 1 << 50)
    with pytest.raises(DiskFullError) as err:
        tr.train()
    ckpt = disk / "ckpt"
    assert re.fullmatch(
        rf"{ckpt}: no space for checkpoint step00000006 \(([\d,]+) bytes needed, ([\d,]+) bytes free\); free space "
        r"there \(tags older than the one 'latest' names can go\) or set train\.checkpoint_dir elsewhere, then rerun "
        r"the same command to resume from step00000004, the last complete tag",
        str(err.value),
    ), err.value
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes", str(err.value)))
    assert needed >= tag_size > free
    assert (err.value.__cause__ is None) == (when == "before")  # "during": torch's own error, chained
    assert (ckpt / "latest").read_text() == "step00000004"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "latest",
        "step00000002",
        "step00000004",
        "validation.jsonl",
    ]  # no half tag, no temporary file
    monkeypatch.undo()
    small_disk.resize(disk, 4 * tag_size)  # room freed
    resumed = make_trainer(compose_config, tiny, disk, *run)
    assert resumed.state.step == 4
    state = resumed.train()
    assert [h["seq_ids"] for h in state.history] == [h["seq_ids"] for h in full.history]
    assert state.data_digest == full.data_digest
    assert [h["loss"] for h in state.history] == pytest.approx([h["loss"] for h in full.history], rel=1e-6)
    assert (ckpt / "latest").read_text() == "step00000006" and (ckpt / "step00000006" / "run.json").is_file()


KILL_MID_SAVE = r"""
import io, json, os, signal, sys
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from hydra import compose, initialize_config_dir
from dspark.core.config import load_config
from dspark.core.target import load_target_heads
from dspark.recipe import build_trainer

repo, target, kill_tag, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
real_save, files = TorchCheckpointEngine.save, []

def save(self, state_dict, path):  # kill_tag's first file whole, half of its second, then SIGKILL
    if kill_tag in path:
        files.append(path)
        if len(files) == 2:
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    return real_save(self, state_dict, path)

TorchCheckpointEngine.save = save
with initialize_config_dir(config_dir=f"{repo}/conf", version_base="1.3"):
    cfg = load_config(compose(config_name="config", overrides=overrides))
build_trainer(cfg, load_target_heads(target)).train()
"""


@pytest.mark.slow
def test_kill_9_mid_save_leaves_latest_on_the_last_complete_tag_and_the_rerun_matches(
    compose_config, tiny, tmp_path, caplog
):
    """Killed while DeepSpeed writes step 4 (ZeRO-1: model states written, optimizer states half):
    the half tag is neither resumed nor exported; the rerun rewrites it and ends as an
    uninterrupted run does."""
    from dspark.checkpoint_tags import CheckpointError
    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.export import export

    target, data = tiny
    run = ("train.max_steps=6", "train.save_every=2", "deepspeed=zero1")
    args = [str(REPO), str(target), "step00000004", json.dumps(overrides(target, data, tmp_path, *run))]
    child = subprocess.run(
        [sys.executable, "-c", KILL_MID_SAVE, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    ckpt, half = tmp_path / "ckpt", tmp_path / "ckpt" / "step00000004"
    assert (ckpt / "latest").read_text() == "step00000002"
    assert sorted(p.name for p in half.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",  # the half-written one
    ]
    with pytest.raises(CheckpointError, match="step00000004"):
        export(half, tmp_path / "export")
    resumed = make_trainer(compose_config, tiny, tmp_path, *run)
    assert resumed.state.step == 2
    state = resumed.train()
    assert f"removed {half}:" in caplog.text  # before step 4 is saved again
    full = make_trainer(compose_config, tiny, tmp_path / "full", *run).train()
    assert [h["seq_ids"] for h in state.history] == [h["seq_ids"] for h in full.history]
    assert state.data_digest == full.data_digest
    assert [h["loss"] for h in state.history] == pytest.approx([h["loss"] for h in full.history], rel=1e-6)
    for tag in ("step00000004", "step00000006"):
        got, want = ckpt / tag, tmp_path / "full" / "ckpt" / tag
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
        a, b = load_training_checkpoint(got).weights, load_training_checkpoint(want).weights
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=f"{tag} {k}")


KILL_MID_EXPORT = r"""
import os, signal, sys
import safetensors.torch
import dspark.export

def save_file(tensors, filename, metadata=None):  # half of model.safetensors written, then SIGKILL
    data = safetensors.torch.save(tensors, metadata=metadata)
    with open(filename, "wb") as f:
        f.write(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)

dspark.export.save_file = save_file
sys.exit(dspark.export.main(sys.argv[1:]))
"""


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_kill_9_mid_export_leaves_no_half_export_and_the_rerun_writes_the_same_bytes(
    compose_config, tiny, tmp_path, caplog
):
    import socket

    from dspark.export import export

    target, _ = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"

    def killed_export() -> None:
        cmd = [sys.executable, "-c", KILL_MID_EXPORT, "export", str(ckpt), "--out", str(out), "--no-validate"]
        child = subprocess.run(
            [*cmd, "--target-dir", str(target)], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]

    def digests(d: Path) -> dict[str, str]:
        return {p.name: file_sha256(p) for p in sorted(d.iterdir())}

    killed_export()
    assert not out.exists()  # the half model.safetensors is in a temporary directory, never under --out
    (half,) = tmp_path.glob(".export.tmp-*")
    assert (half / "model.safetensors").is_file()
    live = tmp_path / f".export.tmp-{socket.gethostname()}-{os.getpid()}-000000"  # an export still running
    elsewhere = tmp_path / ".export.tmp-another-host-1-000000"  # another node's: its process cannot be asked
    live.mkdir(), elsewhere.mkdir()
    export(ckpt, out, target_dir=target)  # the rerun: the killed export's directory goes, with a warning
    assert f"removed {half}: a temporary export left by process" in caplog.text
    assert sorted(tmp_path.glob(".export.tmp-*")) == sorted([live, elsewhere])
    export(ckpt, tmp_path / "uninterrupted", target_dir=target)
    want = digests(tmp_path / "uninterrupted")
    assert digests(out) == want and set(want) == {"config.json", "export.json", "model.safetensors"}
    killed_export()  # a re-export over a complete one, killed: the complete one stays as it was
    assert digests(out) == want


def test_a_full_disk_during_export_is_named_and_leaves_nothing(compose_config, tiny, tmp_path, small_disk, capsys):
    from dspark.export import main

    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    disk = small_disk.mount(256 * 1024)  # the tiny drafter's model.safetensors is about 3 MB
    args = ["export", str(tmp_path / "ckpt"), "--out", str(disk / "drafter"), "--no-validate"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--target-dir", str(tiny[0])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"error: {disk}: no space for export drafter \([\d,]+ bytes needed, [\d,]+ bytes free\); free space there "
        r"or pass another --out, then export again\n",
        err,
    ), err
    assert list(disk.iterdir()) == []  # no half export, no temporary directory


def test_deepspeed_starts_in_a_process_where_vllm_left_a_one_process_group():
    """A multirun's jobs share the process: an earlier job's eval validates the export in vLLM,
    which leaves a one-process torch.distributed group behind (and no LOCAL_RANK); the next
    job's trainer must still start DeepSpeed (it failed with DeepSpeed's LOCAL_RANK assertion)."""
    code = """
import datetime, torch, torch.distributed as dist, deepspeed
from dspark.core.files import free_port
from dspark.distributed import init_distributed
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)  # as vLLM does
print("group", init_distributed(60))
model = torch.nn.Linear(4, 2)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={"train_micro_batch_size_per_gpu": 1})
print("engine", type(engine).__name__)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "group (0, 1)" in out.stdout and "engine DeepSpeedEngine" in out.stdout


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_a_rendezvous_nobody_joins_ends_within_train_dist_timeout_s_naming_it():
    """Rank 1 of 2 whose master never comes up: torch would retry; the bound ends it, naming the
    address, the world size and the setting."""
    from dspark.core.files import free_port

    port = free_port()
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    code = "from dspark.core.errors import exit_on_user_error\nfrom dspark.distributed import init_distributed\n"
    code += "with exit_on_user_error():\n    init_distributed(3)\n"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "MASTER_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # torch alone would wait out its 30-minute default; 100 s leaves room for a loaded machine's
    # imports (67 s seen with a training beside the suite on 2 cores; 12 s alone)
    assert time.monotonic() - t0 < 100
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (
        f"error: rank 1: the 2 ranks did not all meet at 127.0.0.1:{port} within train.dist_timeout_s=3 s: check "
        "that every rank was started (all nodes of the job), that MASTER_ADDR is reachable from this node and "
        "MASTER_PORT free and open there, then rerun the same command"
    )


RANK_0_DISK_FULL = r"""
import errno, os, runpy, sys
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

real_save = TorchCheckpointEngine.save

def save(self, state_dict, path):  # rank 0's disk is full from step 4's save on; rank 1's is not
    if os.environ["RANK"] == "0" and "step00000004" in path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return real_save(self, state_dict, path)

TorchCheckpointEngine.save = save
sys.path.insert(0, os.getcwd())  # this checkout's code, as `python train.py` there imports it
train_py = os.path.join(os.getcwd(), "train.py")
sys.argv = [train_py, *sys.argv[1:]]
runpy.run_path(train_py, run_name="__main__")
"""


@pytest.mark.slow
def test_two_ranks_one_disk_full_mid_save_all_end_soon_with_rank_0s_error(tiny, tmp_path):
    """Rank 0's save fails (disk full) while rank 1 has written its part and waits in DeepSpeed's
    barrier: torchrun, seeing rank 0 end, ends rank 1 too, long before the collective timeout;
    the run ends non-zero with rank 0's error naming the tag, and latest stays on step 2."""
    from dspark.core.files import free_port

    target, data = tiny
    script = tmp_path / "rank0_disk_full.py"
    script.write_text(RANK_0_DISK_FULL)
    cmd = torchrun(
        str(script),
        *overrides(target, data, tmp_path, "train.max_steps=6", "train.save_every=2", "train.micro_batch_size=2"),
        "train.dist_timeout_s=600",
        f"hydra.run.dir={tmp_path}/run",
    )
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    took, log = time.monotonic() - t0, out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    ckpt = tmp_path / "ckpt"
    assert f"error: {ckpt}: no space for checkpoint step00000004 (" in log, log[-3000:]
    # gloo: rank 1's barrier fails at once ("Connection closed by peer"); torchrun then ends it
    assert re.search(r"rank\s*: 1 .*\n\s*exitcode\s*: (1|-15|-9) ", log), log[-3000:]
    assert took < 300, took  # start-up and 4 steps included; the collective timeout is 600 s
    assert (ckpt / "latest").read_text() == "step00000002" and not (ckpt / "step00000006").exists()
    cmd[cmd.index(str(script))] = "train.py"  # room freed: the rerun resumes from step 2 and completes
    cmd[cmd.index(next(a for a in cmd if a.startswith("--master_port")))] = f"--master_port={free_port()}"
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (ckpt / "latest").read_text() == "step00000006"
    assert "at step 2 (epoch" in out.stdout + out.stderr  # "resumed from ... at step 2 (epoch 0, ..."


def test_a_run_recorded_before_a_shaping_key_existed_is_judged_by_what_it_trained_with(tmp_path):
    """A run.json from before ``train.kl_weight`` and ``train.markov_init`` trained with KL 0 and the
    zeros init: it differs from today's KL default, and equals a run that sets the old loss."""
    from dspark.checkpoint_run import run_differences
    from dspark.checkpoint_tags import RUN_FILE
    from dspark.core.config import RunConfig, TrainConfig

    def recorded_without_the_new_keys(cfg: RunConfig) -> None:
        saved = cfg.to_dict()
        del saved["train"]["kl_weight"], saved["train"]["markov_init"]
        (tmp_path / RUN_FILE).write_text(json.dumps({"config": saved}))

    old_loss = RunConfig(train=TrainConfig(kl_weight=0.0, tv_weight=0.9, ce_weight=0.1))
    recorded_without_the_new_keys(old_loss)
    assert run_differences(tmp_path, old_loss) == []
    now = RunConfig(train=TrainConfig(tv_weight=0.9, ce_weight=0.1))  # the KL default added to it
    assert run_differences(tmp_path, now) == ["train.kl_weight: checkpoint 0.0, now 1.0"]
