"""The batch scripts submitted to a real Slurm (tests/slurm/conftest.py starts one on this machine):
static checks (shellcheck, sbatch --test-only), the early environment checks and afterok
semantics with jobs that fail in seconds, then the smoke pipeline through slurm/pipeline.sh on
CPU with every artifact checked, a resubmitted extraction that resumes, and a requeued training
job that picks up where it was."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dspark.data.online import PROMPT_LOG, read_prompt_log
from dspark.formats.shard_format import Manifest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
SHELL = [
    *SCRIPTS,
    SLURM / "pipeline.sh",
    SLURM / "common.sh",
    *sorted((REPO / "scripts").glob("*.sh")),
    REPO / ".ci" / "run",
]
CPU = ["--nodes=1", "--gpus-per-node=0"]  # what every script's header is overridden with here
SMOKE = "smollm2_cpu_smoke"


def job_env(out: Path, **extra: str) -> dict[str, str]:
    """The submitting shell: outputs in a tmp dir, the scripts' own defaults for the rest."""
    return {
        "DSPARK_OUTPUT_DIR": str(out),
        "PYTHON": "",
        "DSPARK_ALLOW_CPU": "",
        "EXPERIMENT": SMOKE,
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


def submit_env(slurm, out: Path, **extra: str) -> dict[str, str]:
    env = {**slurm.env, **job_env(out, **extra)}
    return {k: v for k, v in env.items() if v != ""}  # "" = unset


def pipeline(slurm, out: Path, *args: str, **extra: str) -> dict[str, str]:
    r = subprocess.run(
        [str(SLURM / "pipeline.sh"), *args],
        capture_output=True,
        text=True,
        cwd="/",
        env=submit_env(slurm, out, **extra),
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    ids = dict(line.split()[:2] for line in r.stdout.splitlines() if line.split()[0] in ("extract", "train", "eval"))
    assert list(ids) == ["extract", "train", "eval"] and all(i.isdigit() for i in ids.values()), r.stdout
    assert f"logs {out}/slurm/" in r.stdout
    return ids


def sbatch(slurm, out: Path, *args: str, **extra: str) -> str:
    r = subprocess.run(
        ["sbatch", "--parsable", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=submit_env(slurm, out, **extra),
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().split(";")[0]


def batch_log(out: Path, job_id: str) -> str:
    """The batch output of a job (every task of an array): dspark-STAGE-ID.out, ...-ID_TASK.out."""
    logs = sorted(f for f in (out / "slurm").glob("*.out") if re.search(rf"-{job_id}(_\d+)?\.out$", f.name))
    return "\n".join(f.read_text(errors="replace") for f in logs)


# -- static ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("path", SHELL, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck_clean(path):
    r = subprocess.run(
        ["shellcheck", "-x", "-S", "style", str(path.relative_to(REPO))], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", [p.name for p in SCRIPTS])
def test_sbatch_test_only_accepts_every_script(slurm, tmp_path, script):
    """sbatch parses each header; with the node count and GPUs this one-node cluster has, the
    controller would schedule it. As written (4 x 4 GPUs) it is refused here, not misread."""
    extra = ["--array=0-1"] if "array" in script else []
    r = slurm.run(
        "sbatch", "--test-only", *CPU, *extra, f"--output={tmp_path}/%x-%j.out", f"slurm/{script}", check=False
    )
    # a heterogeneous job (online.sbatch) is reported by the processors its components take
    said = r"on nodes \S+ in partition debug|using \d+ processors on \S+"
    assert r.returncode == 0 and re.search(rf"Job \d+ to start at .* ({said})", r.stderr), r.stderr
    r = slurm.run("sbatch", "--test-only", f"slurm/{script}", check=False)
    assert r.returncode != 0 and "gres" in r.stderr.lower(), r.stderr  # GPUs asked for; this node has none


# -- early environment checks and afterok, with jobs that fail in seconds ----------------------


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_failing_first_stage_means_dependents_never_run(slurm, tmp_path):
    # pipeline.sh composes the config with the real interpreter; only the jobs get the bad one
    ids = pipeline(slurm, tmp_path, "--cpu", "-s", "--export=ALL,PYTHON=/nonexistent/python")
    jobs = slurm.wait(*ids.values(), timeout=300)
    ext, train, ev = (jobs[ids[s]] for s in ("extract", "train", "eval"))
    assert ext["JobState"] == "FAILED" and ext["ExitCode"] == "2:0", ext
    for j, dep in ((train, ids["extract"]), (ev, ids["train"])):
        assert j["JobState"] == "CANCELLED" and j["Reason"] == "DependencyNeverSatisfied", j
        assert j["Dependency"] == f"afterok:{dep}(failed)", j
    log = batch_log(tmp_path, ids["extract"])
    assert ("error: PYTHON=/nonexistent/python is not an executable in " + str(REPO)) in log, log
    for stage in ("train", "eval"):  # their scripts never ran: no batch log, no run dir
        assert not batch_log(tmp_path, ids[stage]) and not (tmp_path / "slurm" / ids[stage]).exists()


def test_no_gpus_without_allow_cpu_fails_clearly(slurm, tmp_path):
    (tmp_path / "slurm").mkdir()
    job = sbatch(slurm, tmp_path, *CPU, f"--output={tmp_path}/slurm/%x-%j.out", "slurm/train.sbatch")
    info = slurm.wait(job, timeout=300)[job]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    log = batch_log(tmp_path, job)
    assert "error: no GPUs allocated on" in log and "expected --gpus-per-node=N" in log, log
    assert "DSPARK_ALLOW_CPU=1" in log


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_a_misspelt_override_fails_the_job_before_srun(slurm, tmp_path):
    (tmp_path / "slurm").mkdir()
    job = sbatch(
        slurm,
        tmp_path,
        *CPU,
        f"--output={tmp_path}/slurm/%x-%j.out",
        "slurm/eval.sbatch",
        "eval.gama=4",
        DSPARK_ALLOW_CPU="1",
    )
    info = slurm.wait(job, timeout=300)[job]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    log = batch_log(tmp_path, job)
    assert "error: unknown config key eval.gama (did you mean eval.gamma?)" in log, log
    assert "node exit codes" not in log  # srun never ran


# -- the smoke pipeline, for real ---------------------------------------------------------------


@pytest.mark.slow
def test_smoke_pipeline_through_slurm_then_resume_and_requeue(slurm, tmp_path, smollm2_dir):
    out = tmp_path
    ids = pipeline(slurm, out, "--cpu")
    jobs = slurm.wait(*ids.values(), timeout=3600)
    for stage, job in ids.items():
        info = jobs[job]
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (stage, info, batch_log(out, job)[-4000:])
    # afterok: each stage started after the one before ended
    assert jobs[ids["train"]]["StartTime"] >= jobs[ids["extract"]]["EndTime"]
    assert jobs[ids["eval"]]["StartTime"] >= jobs[ids["train"]]["EndTime"]

    data = out / "data" / "smollm2-135m"
    m = Manifest.load(data)
    assert m.complete and sum(s.rows for s in m.shards) == 4
    assert all((data / s.split / f"{s.name}.parquet").is_file() for s in m.shards)
    ckpt = out / "checkpoints" / "smollm2-135m" / "markov16-L1-i256"
    assert (ckpt / "step00000002" / "run.json").is_file()
    export = out / "exports" / "smollm2-135m" / "markov16-L1-i256" / "dspark-dspark"
    assert json.loads((export / "config.json").read_text())["target_layer_ids"] == [0, 7, 14, 21, 28]
    assert (export / "model.safetensors").stat().st_size > 1000
    results = json.loads((out / "eval" / "smollm2-135m" / "markov16-L1-i256" / "results.json").read_text())
    assert {d["name"] for d in results["drafters"]} >= {"dspark", "ngram"}

    logs = {s: batch_log(out, j) for s, j in ids.items()}
    assert "extract: 4 rows" in logs["extract"] and "node exit codes: node0.rc:0" in logs["extract"]
    assert "DeepSpeed: 1 node(s) x 1 rank(s) = 1 ranks" in logs["train"] and "step 2/2" in logs["train"]
    assert "DSPARK_ALLOW_CPU=1" in logs["eval"] and "node0.rc:0" in logs["eval"]
    for s, j in ids.items():  # Hydra's run dir per stage and node, under the predictable log dir
        assert (out / "slurm" / j / s / "node0" / ".hydra" / "config.yaml").is_file(), s

    # Resubmitted as a 2-task array: both tasks find their shards complete and start no engine.
    manifest_before = (data / "manifest.json").read_text()
    arr = sbatch(
        slurm,
        out,
        *CPU,
        "--array=0-1",
        f"--output={out}/slurm/%x-%A_%a.out",
        "slurm/extract_array.sbatch",
        DSPARK_ALLOW_CPU="1",
    )
    assert set(slurm.states(arr)) <= {"PENDING", "RUNNING", "COMPLETED", "CONFIGURING", "COMPLETING"}
    slurm.wait(arr, timeout=900)
    assert slurm.states(arr) == ["COMPLETED", "COMPLETED"], slurm.run("scontrol", "show", "job", arr).stdout
    log = batch_log(out, arr)
    assert "extract rank 0/2: 1 shards, 1 already complete, 0 to do" in log, log[-3000:]
    assert "extract rank 1/2: 0 shards" in log
    assert "shards written 0, already complete 1" in log and "shards written 0, already complete 0" in log
    assert (data / "manifest.json").read_text() == manifest_before  # complete, same shards

    # Near the time limit Slurm sends the batch shell USR1 (--signal=B:USR1@900); the trap requeues
    # the job: same id, restart 1, log appended, and the rerun resumes (training is finished, so
    # it says so and skips).
    again = sbatch(slurm, out, *CPU, f"--output={out}/slurm/%x-%j.out", "slurm/train.sbatch", DSPARK_ALLOW_CPU="1")
    deadline = time.time() + 600
    while "DeepSpeed: 1 node(s)" not in batch_log(out, again):  # srun is starting torchrun
        assert time.time() < deadline and slurm.job(again)["JobState"] in ("PENDING", "RUNNING"), slurm.job(again)
        time.sleep(1)
    slurm.run("scancel", "--signal=USR1", "--batch", again)
    deadline = time.time() + 900
    while not ((info := slurm.job(again))["Restarts"] == "1" and info["JobState"] in slurm.TERMINAL):
        assert time.time() < deadline, info  # one query per look: state and restarts read together
        time.sleep(2)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    log = batch_log(out, again)
    assert f"time limit near: requeueing {again} (restart 0)" in log, log[-3000:]
    first, second = log.split("restart 1", 1)
    assert "restart 0" in first and "is at train.max_steps=2 for this drafter, skipped" in second, log[-3000:]


def test_pipeline_rejects_bad_options_without_submitting(slurm, tmp_path):
    for args, msg in (
        (["--array", "x"], "--array expects a number"),
        (["--stages", "extract,tune"], "unknown stage 'tune'"),
        (["--bogus"], "unknown option --bogus"),
    ):
        r = subprocess.run(
            [str(SLURM / "pipeline.sh"), *args],
            capture_output=True,
            text=True,
            env=submit_env(slurm, tmp_path),
            timeout=60,
        )
        assert r.returncode == 2 and msg in r.stderr, r.stderr
    dry = subprocess.run(
        [
            str(SLURM / "pipeline.sh"),
            "--dry-run",
            "--array",
            "2",
            "--gpus",
            "1",
            "-s",
            "--partition=gb300",
            "data.num_prompts=8",
        ],
        capture_output=True,
        text=True,
        env=submit_env(slurm, tmp_path),
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stderr.strip().splitlines()
    assert len(lines) == 3 and "extract_array.sbatch data.num_prompts=8" in lines[0] and "--array=0-1" in lines[0]
    assert all(
        "--gpus-per-node=1" in x and "--partition=gb300" in x and x.split()[-1] == "data.num_prompts=8" for x in lines
    )
    assert not (tmp_path / "slurm").exists()  # a dry run creates nothing
    assert "--dependency=afterok:\\<extract\\>" in lines[1] and "--dependency=afterok:\\<train\\>" in lines[2]


@pytest.mark.slow
def test_online_hetjob_trains_on_cpu_from_the_engine_component(slurm, tmp_path, smollm2_dir):
    """slurm/online.sbatch for real: the producer (vLLM on CPU) streams to the trainer over the
    torch.distributed link; only checkpoints are written. Slurm puts the two components on two
    nodes (on one they pend on Resources, even a two-component `srun hostname`): partition
    ``het``, this host's node and a second slurmd on it (tests/slurm/conftest.py)."""
    if slurm.het_partition is None:
        pytest.skip("no second node: this host is named localhost, the name the second node takes")
    out = tmp_path
    (out / "slurm").mkdir()  # the batch output's directory (slurm/common.sh makes it for a run's files)
    job = sbatch(
        slurm,
        out,
        *CPU,
        f"--partition={slurm.het_partition}",  # header lines override per component; this applies to both
        "--mem=2G",
        f"--output={out}/slurm/%x-%j.out",
        "slurm/online.sbatch",
        "data.batch_size=2",
        "data.online.buffer_size=2",
        "data.online.connect_timeout_s=1200",  # the engine starts first; a busy machine slows it
        DSPARK_ALLOW_CPU="1",
    )
    deadline = time.time() + 300
    while "PENDING" in slurm.states(job):  # both components must fit on the node
        assert time.time() < deadline, slurm.run("scontrol", "show", "job", job).stdout
        time.sleep(2)
    info = slurm.wait(job, timeout=1800)[job]
    log = batch_log(out, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-4000:])
    assert "online: 1 engine(s) of 1 node(s)" in log and "trainer exit status 0" in log
    ckpt = out / "checkpoints" / "smollm2-135m" / "markov16-L1-i256"
    assert (ckpt / "latest").read_text().strip() == "step00000002"
    assert [e["index"] for e in read_prompt_log(ckpt / PROMPT_LOG)] == [0, 1]
    assert not (out / "data").exists()  # no shards
    train_log = (out / "slurm" / job / "online" / "train-node0" / "train.log").read_text()
    assert "online: producer connected" in train_log and "step 2/2" in train_log
