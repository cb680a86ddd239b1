"""Extraction in real vLLM (CPU) on the embedded target: capture accuracy, resume after kill -9,
rebuild of a damaged shard, refusal to mix datasets. Slow: each run starts vLLM (~40 s)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspark.data.shards import ShardDataset
from dspark.formats.shard_format import Manifest
from tests.toy import SHORT_QUESTIONS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

PROMPTS = [
    *SHORT_QUESTIONS,
    "word " * 300,  # longer than the 192-token window: skipped and counted
    "What is the capital of France?",  # duplicate: dropped
]


def _cmd(prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "data_tools.extract",
        "+experiment=smollm2_cpu_demo",
        f"data.source={prompts}",
        f"data.shards_dir={out}",
        "data.rows_per_shard=2",
        "data.max_new_tokens=12",
        "data.max_seq_len=192",
        "data.val_fraction=0.3",
        "data.vllm.cpu_kvcache_gib=1",
        f"hydra.run.dir={out}_hydra",
        *extra,
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _verify(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "data_tools.verify", str(directory), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(directory: Path) -> dict:
    rows = {}
    for split in ("train", "val"):
        ds = ShardDataset(directory, split)
        for i in range(len(ds)):
            s = ds[i]
            assert s.seq_id not in rows, f"{s.seq_id} twice"
            rows[s.seq_id] = (split, s.input_ids.tolist(), s.loss_mask.tolist(), s.hidden_states.clone())
    return rows


def _assert_same_rows(out: Path, reference: Path) -> None:
    """``out`` holds the uninterrupted run's sequences: same splits, ids, masks and states."""
    expected, got = _rows(reference), _rows(out)
    assert got.keys() == expected.keys()
    for seq_id, (split, ids, mask, hs) in expected.items():
        assert got[seq_id][:3] == (split, ids, mask)
        torch.testing.assert_close(got[seq_id][3], hs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts, smollm2_dir) -> Path:
    """One uninterrupted run."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    _run(_cmd(prompts, out))
    return out


def test_uninterrupted_run(reference):
    m = Manifest.load(reference)
    assert m.complete and m.layer_ids == [1, 8, 15, 22, 29, 30] and m.hidden_size == 576
    assert sum(s.rows for s in m.shards) == 6  # 8 prompts - 1 duplicate - 1 overlong
    assert sum(sum(s.skipped.values()) for s in m.shards) == 1
    assert {s.split for s in m.shards} == {"train", "val"}
    rows = _rows(reference)
    for split, ids, mask, hs in rows.values():
        n_answer = sum(mask)
        assert 1 <= n_answer <= 12 and mask[-n_answer:] == [1] * n_answer  # the target's own answer
        assert hs.shape == (len(ids) - 1, 6, 576)
    # per-request safetensors files are gone once packed
    assert not list(reference.rglob("*.safetensors")) and not (reference / "_work").exists()


def test_verify_recomputes_within_1e_4(reference):
    out = _verify(reference, "--recompute", "3", "--json", str(reference.parent / "verify.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((reference.parent / "verify.json").read_text())
    assert not report["problems"] and report["rows"] == 6
    assert len(report["max_rel_err"]) == 6 and max(report["max_rel_err"].values()) < 1e-4


def test_kill_resume_and_rebuild_match_uninterrupted_run(tmp_path, prompts, reference):
    out = tmp_path / "ds"
    proc = subprocess.Popen(
        _cmd(prompts, out), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while not (out / "train" / "shard-00000.json").exists():
        assert proc.poll() is None and time.time() < deadline, "extraction ended before the first shard"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: driver, engine core and worker
    proc.wait()
    assert not Manifest.load(out).complete

    _run(_cmd(prompts, out))
    _assert_same_rows(out, reference)

    # a truncated shard: verify names it, resume rebuilds it
    shard = out / "train" / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:1000])
    bad = _verify(out, "--recompute", "0")
    assert bad.returncode == 1 and f"{shard}: " in bad.stdout and "truncated or altered on disk" in bad.stdout
    _run(_cmd(prompts, out))
    assert _verify(out, "--recompute", "0").returncode == 0
    _assert_same_rows(out, reference)


def test_a_dead_engine_core_ends_the_driver_and_the_rerun_resumes(tmp_path, prompts, reference):
    """Issue #17: vLLM's engine core killed mid-extraction (as the OOM killer would) ends the driver
    within a bound, with a message that says what to do; the rerun completes the same dataset."""
    import psutil

    out, log = tmp_path / "ds", tmp_path / "driver.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            _cmd(prompts, out), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.time() + 300
        while not (out / "train" / "shard-00000.json").exists():
            assert proc.poll() is None and time.time() < deadline, "extraction ended before the first shard"
            time.sleep(0.1)
        engines = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "EngineCor" in " ".join(p.cmdline()) + p.name()
        ]
        assert engines, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        for p in engines:
            p.kill()
        rc = proc.wait(timeout=180)  # bounded: vLLM's monitor notices the dead process
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    deadline = time.time() + 120  # and nothing of it is left running (vLLM's worker too; slow to go when loaded)
    while [p for p in psutil.process_iter() if _session(p) == proc.pid] and time.time() < deadline:
        time.sleep(0.5)
    assert not [p.cmdline() for p in psutil.process_iter() if _session(p) == proc.pid]
    assert "vLLM's engine core process died" in text and "rerun the same command to resume" in text, text[-3000:]
    assert not Manifest.load(out).complete

    _run(_cmd(prompts, out))
    _assert_same_rows(out, reference)


def _session(p) -> int:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return -1


def test_resume_into_a_different_dataset_is_refused(tmp_path, prompts, reference):
    out = subprocess.run(
        _cmd(prompts, reference, "target.layer_ids=[2,9]"), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode != 0
    assert (
        "refusing to resume into a dataset made differently: layer_ids: directory has [1, 8, 15, 22, 29, 30], this "
        "run has [2, 9, 30]" in out.stderr
    )


def test_transformers_answers_match_vllms_and_colocated_states_equal_its_capture(tmp_path, prompts, reference):
    """data.engine=transformers writes token-id shards of the same planned requests: how many of
    its greedy answers equal vLLM's token for token (printed; docs/benchmarks.md records it), and
    data.mode=colocated's states of vLLM's sequences within the tolerance data_tools.verify uses."""
    from data_tools.verify import default_limit
    from dspark.data.colocated import ColocatedTarget

    tokens = tmp_path / "tokens"
    _run(_cmd(prompts, tokens, "data.engine=transformers", "data.mode=colocated", "train.target_topk=0"))
    m = Manifest.load(tokens)
    assert m.complete and m.layer_ids == [] and m.hidden_size == 576
    assert _verify(tokens, "--recompute", "2").returncode == 0  # integrity; no states to recompute
    vllm_rows, ours = _rows(reference), _rows(tokens)
    assert ours.keys() == vllm_rows.keys()
    same = 0
    for seq_id, (split, ids, mask, hs) in ours.items():
        v_split, v_ids, v_mask, _ = vllm_rows[seq_id]
        n_prompt = mask.index(1)
        assert split == v_split and ids[:n_prompt] == v_ids[:n_prompt] and hs.shape == (len(ids) - 1, 0, 576)
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt) and 1 <= len(ids) - n_prompt <= 12
        same += ids == v_ids
    print(f"transformers vs vLLM greedy answers: {same} of {len(ours)} equal token for token")
    assert same >= len(ours) - 1  # fp32 greedy on both sides: a near-tie may flip one

    manifest = Manifest.load(reference)
    target = ColocatedTarget(Path(manifest.target_path), manifest.layer_ids)
    seq_ids = sorted(vllm_rows)
    states = target.states([torch.tensor(vllm_rows[s][1]) for s in seq_ids])
    for seq_id, got in zip(seq_ids, states):
        stored = vllm_rows[seq_id][3]
        for j in range(len(manifest.layer_ids)):
            err = ((got[:, j] - stored[:, j]).norm() / stored[:, j].norm()).item()
            assert err < default_limit(manifest), (seq_id, manifest.layer_ids[j], err)


def test_ctrl_c_mid_extraction_is_one_line_from_the_driver_and_the_rerun_completes(tmp_path, prompts, reference):
    """Issue #58 item 13: Ctrl-C during extraction printed three tracebacks. A terminal's Ctrl-C
    reaches the whole foreground process group (the driver and vLLM's engine core and worker); the
    driver now ends with one line and exit 130 (vLLM's engine core, whose busy loop the same signal
    cancels, may still print its own). The rerun completes the same dataset."""
    out, log = tmp_path / "ds", tmp_path / "driver.log"
    # a foreground job's SIGINT disposition (a script's background job would ignore it)
    launch = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", launch, *_cmd(prompts, out)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 300
        while "extract: " not in log.read_text():  # the engine is up and capturing
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130, text[-3000:]
    assert "error: interrupted (Ctrl-C). Kept: every complete shard" in text
    driver = [
        line for line in text.splitlines() if "data_tools/extract.py" in line or "dspark/serving/vllm_engine" in line
    ]
    assert not driver, driver  # no traceback through the driver's own code
    _run(_cmd(prompts, out))
    assert _verify(out, "--recompute", "0").returncode == 0
    _assert_same_rows(out, reference)
