"""Online training (data.mode=online) from a live vLLM engine on the embedded SmolLM2-135M target:
a few steps through ``python train.py``, nothing written but checkpoints, and a kill -9 after a
checkpoint whose rerun enters exactly the uninterrupted run's prompts. Slow: each run starts
vLLM (about a minute on 2 shared cores)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data_tools.online import default_work_dir
from data_tools.prompts import dedupe_and_split, load_source
from dspark.data.online import PROMPT_LOG, read_prompt_log
from tests.toy import SHORT_QUESTIONS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

PROMPTS = [
    *SHORT_QUESTIONS,
    "word " * 300,  # longer than the 192-token window: skipped, the only gap in the prompt indexes
    "Name a prime number larger than ten.",
    "What is a unit test?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "What is 7 times 8?",
    "Name two sorting algorithms.",
    "What is a closure in programming?",
    "Suggest a name for a pet fish.",
    "How many legs does a spider have?",
]
STEPS = 8


def _cmd(prompts: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "+experiment=smollm2_cpu_smoke",
        "data.mode=online",
        "stages=[train]",
        f"data.source={prompts}",
        f"data.num_prompts={len(PROMPTS)}",
        "data.max_new_tokens=8",
        "data.max_seq_len=192",
        "data.on_overlong=skip",
        "data.val_fraction=0.3",  # val: generated once at the start, kept in memory
        "train.eval_every=4",
        "data.batch_size=2",  # prompts per engine call
        "data.online.buffer_size=2",  # back-pressure: the engine stays at most 2 sequences ahead
        "data.online.window_size=4",
        "data.online.new_per_micro_batch=1",
        "train.micro_batch_size=2",
        "train.max_seq_len=192",
        f"train.max_steps={STEPS}",
        "train.save_every=2",
        "train.log_every=1",
        f"paths.output_dir={out}",
        "logging.wandb=false",
        f"hydra.run.dir={out}/run",
    ]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS) + "\n")
    return path


def _ckpt(out: Path) -> Path:
    return out / "checkpoints" / "smollm2-135m" / "markov16-L1-i256"


def _history(out: Path) -> list[list[str]]:
    client = torch.load(_ckpt(out) / f"step{STEPS:08d}" / "mp_rank_00_model_states.pt", weights_only=False)
    return [h["seq_ids"] for h in client["history"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prompts, smollm2_dir) -> Path:
    out = tmp_path_factory.mktemp("full")
    run = subprocess.run(_cmd(prompts, out), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def test_online_run_trains_from_the_engine_and_writes_only_checkpoints(uninterrupted, prompts):
    out = uninterrupted
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "run"]  # no data/ (shards), no cache
    assert (_ckpt(out) / "latest").read_text().strip() == f"step{STEPS:08d}"
    entered = read_prompt_log(_ckpt(out) / PROMPT_LOG)
    splits = dedupe_and_split(load_source(str(prompts)), val_fraction=0.3)
    assert splits["val"] and len(splits["train"]) >= STEPS + 1
    order = [c.seq_id for c in splits["train"]]
    fits = [i for i, c in enumerate(splits["train"]) if "word word" not in c.messages[-1][1]]
    # one new prompt per step, in order; the prompt too long for the window gives no sequence
    assert [e["index"] for e in entered] == fits[:STEPS]
    assert [e["seq_id"] for e in entered] == [order[i] for i in fits[:STEPS]]
    client = torch.load(_ckpt(out) / f"step{STEPS:08d}" / "mp_rank_00_model_states.pt", weights_only=False)
    assert [v["step"] for v in client["validations"]] == [4, 8]
    history = _history(out)
    assert [h[0] for h in history] == [e["seq_id"] for e in entered]  # each trains in the step it enters
    log = (out / "run" / "train.log").read_text()
    assert "online: from prompt 0 (pass 0), 1 new + 1 from a window of 4 per micro batch" in log
    assert "sequences from the engine" in log and "| data " in log  # extraction rate and data wait
    cfg = SimpleNamespace(data=SimpleNamespace(online=SimpleNamespace(work_dir=None)))
    cfg.train = SimpleNamespace(checkpoint_dir=str(_ckpt(out)))
    assert not default_work_dir(cfg).exists()  # the connector's request files are gone


def test_kill_9_then_resume_neither_repeats_nor_skips_a_prompt(uninterrupted, prompts, tmp_path):
    out = tmp_path
    proc = subprocess.Popen(
        _cmd(prompts, out), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    latest, deadline = _ckpt(out) / "latest", time.time() + 600
    while not (latest.is_file() and latest.read_text().strip() == "step00000004"):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and vLLM's engine core
    proc.wait()
    killed_at = int(latest.read_text().strip()[4:])
    assert killed_at < STEPS
    rerun = subprocess.run(_cmd(prompts, out), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    full_log = read_prompt_log(_ckpt(uninterrupted) / PROMPT_LOG)
    cursor = full_log[killed_at - 1]["index"] + 1  # one prompt entered per step
    log = (out / "run" / "train.log").read_text()
    assert "resumed from" in log and f"online: from prompt {cursor} (pass 0)" in log
    assert read_prompt_log(_ckpt(out) / PROMPT_LOG) == read_prompt_log(_ckpt(uninterrupted) / PROMPT_LOG)
    resumed, full = _history(out), _history(uninterrupted)
    assert [h[0] for h in resumed] == [h[0] for h in full]  # the new sequence of every step


def test_producer_on_its_own_streams_to_the_trainer_over_the_link(uninterrupted, prompts, tmp_path):
    """The multi-node layout on one machine: ``python -m data_tools.online`` (the engine) and
    ``python train.py`` (the trainer) as two processes joined by data.online.trainer_addr; the
    trainer enters the same prompts as the one-process run."""
    from dspark.core.ports import free_port

    out, port = tmp_path, free_port()
    link = ["data.online.trainer_addr=127.0.0.1", f"data.online.port={port}", "data.online.connect_timeout_s=600"]
    cmd = [a for a in _cmd(prompts, out) if not a.startswith("hydra.run.dir=")]
    producer = subprocess.Popen(
        [sys.executable, "-m", "data_tools.online", *cmd[2:], *link, f"hydra.run.dir={out}/producer"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    trainer = subprocess.run(
        [*cmd, *link, f"hydra.run.dir={out}/run"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    said = producer.communicate(timeout=300)[1]
    assert trainer.returncode == 0, trainer.stderr[-4000:] + said[-2000:]
    assert producer.returncode == 0, said[-4000:]
    assert read_prompt_log(_ckpt(out) / PROMPT_LOG) == read_prompt_log(_ckpt(uninterrupted) / PROMPT_LOG)
    assert "online: producer connected" in (out / "run" / "train.log").read_text()
    assert not (out / "data").exists()
