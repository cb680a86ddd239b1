"""The trainer's checkpoints on the tiny target (tests/conftest.py's ``tiny``): a resume continues
the same run, a finished run is skipped only if nothing that shapes it changed, bad tags and a
second run on the directory are refused, preemption and kill -9 lose nothing, and faults while
saving (a full disk, a kill mid-save, one rank's disk full) leave ``latest`` on a complete tag."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from dspark.target import load_target_heads
from dspark.trainer import Preempted
from tests.toy import REPO, make_trainer, overrides, torchrun


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


def test_a_run_recorded_before_a_shaping_key_existed_is_judged_by_what_it_trained_with(tmp_path):
    """A run.json from before ``train.kl_weight`` and ``train.markov_init`` trained with KL 0 and the
    zeros init: it differs from today's KL default, and equals a run that sets the old loss."""
    from dspark.checkpoint_run import run_differences
    from dspark.checkpoint_tags import RUN_FILE
    from dspark.config import RunConfig, TrainConfig

    def recorded_without_the_new_keys(cfg: RunConfig) -> None:
        saved = cfg.to_dict()
        del saved["train"]["kl_weight"], saved["train"]["markov_init"]
        (tmp_path / RUN_FILE).write_text(json.dumps({"config": saved}))

    old_loss = RunConfig(train=TrainConfig(kl_weight=0.0, tv_weight=0.9, ce_weight=0.1))
    recorded_without_the_new_keys(old_loss)
    assert run_differences(tmp_path, old_loss) == []
    now = RunConfig(train=TrainConfig(tv_weight=0.9, ce_weight=0.1))  # the KL default added to it
    assert run_differences(tmp_path, now) == ["train.kl_weight: checkpoint 0.0, now 1.0"]


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


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
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


# --- faults while saving (issue #17) -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_full_disk_stops_the_save_keeps_latest_and_the_rerun_completes_the_run(
    compose_config, tiny, tmp_path, small_disk, monkeypatch, when
):
    """Room for two tags, not three. ``before``: the size check refuses the third save before it
    writes; ``during``: with that check blinded, torch.save runs out of space mid-tag."""
    from dspark.core.disk_space import DiskFullError

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
from dspark.config import load_config
from dspark.target import load_target_heads
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
    from dspark.core.ports import free_port

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
