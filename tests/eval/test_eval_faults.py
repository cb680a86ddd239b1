"""Issue #17 for the eval stage: killed at any moment, the rerun finishes with the numbers of an
uninterrupted eval, and no half-written file (a part, results.json) is ever taken as complete.

The eval runs a tiny drafter (conftest.py tiny_trained_drafter: 2 steps on the tiny target) in
the reference loop, and one vLLM method (``ngram``) through the real child-process path of
``eval.vllm_rows.run_in_subprocess``; the child is a stub that writes counters computed from the
prompts (vLLM itself on this tiny target would take minutes per engine; serving is tested in
test_vllm_parity.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from eval.acceptance import AcceptanceCounts
from eval.results import DrafterResult
from eval.run import Parts
from tests.toy import overrides

REPO = Path(__file__).resolve().parents[2]

STUB_SERVE = r"""
import json, os, sys, time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, os.getcwd())  # this checkout's code (the child runs in the repository, as eval.vllm_rows's does)
argv = sys.argv[3:] if sys.argv[1:3] == ["-m", "eval.serve"] else sys.exit(f"not eval.serve: {sys.argv}")
args = dict(zip(argv[0::2], argv[1::2]))
out, gamma = Path(args["--out"]), int(args["--gamma"])
if os.environ.get("STUB_HANG"):  # the engine "starts" and never finishes: waits to be killed
    Path(os.environ["STUB_HANG"]).write_text(str(os.getpid()))
    while True:
        time.sleep(1)
from dspark.core.atomic_files import atomic_write_json
from eval.eval_set import load_eval_set

from eval.acceptance import AcceptanceCounts

per_bin, outputs, per_prompt = {}, {}, []
for p in load_eval_set(Path(args["--prompts"])):  # counters that depend on every prompt token
    b = per_bin.setdefault(str(p.bin), AcceptanceCounts(gamma))
    c = AcceptanceCounts(gamma)
    drafts = 3 + sum(p.prompt_token_ids) % 5
    for k in range(drafts):
        c.add_step(gamma, (p.prompt_token_ids[k % len(p.prompt_token_ids)] + k) % (gamma + 1))
        if k % 2:
            c.add_step(0, 0)  # a step without a match, as ngram has
    b.merge(c)
    per_prompt.append({"prompt_id": p.prompt_id, "bin": p.bin, **asdict(c)})
    outputs[p.prompt_id] = p.prompt_token_ids[:4]
counts = {k: asdict(v) for k, v in per_bin.items()}
for k, v in counts.items():
    v.pop("gamma")
    v["num_prompts"] = sum(p["bin"] == int(k) for p in per_prompt)
atomic_write_json(out, {"method": args["--method"], "draft": None, "gamma": gamma, "per_bin": counts,
                        "outputs": outputs, "engine_start_s": 1.0, "generate_s": 1.0, "per_prompt": per_prompt})
"""

DRIVER = r"""
import json, logging, os, signal, sys
from pathlib import Path

repo, target, point, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")  # as Hydra's main does
sys.executable = os.environ["STUB_PYTHON"]  # the vLLM child eval.vllm_rows starts: the stub
import eval.reference, eval.report, eval.run
from dspark.core.atomic_files import atomic_path

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "reference":  # mid reference loop: 3rd prompt
    real_generate, calls = eval.reference.speculative_generate, []
    def speculative_generate(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            die()
        return real_generate(*a, **k)
    eval.reference.speculative_generate = speculative_generate
elif point == "after_reference":  # the reference part written, vLLM not started
    eval.run.vllm_results = lambda *a, **k: die()
elif point == "report":  # results.json half written (report.md and the plots are written)
    real_write = eval.report.atomic_write_text
    def atomic_write_text(path, text):
        if Path(path).name == "results.json":
            with atomic_path(path) as tmp:
                tmp.write_text(text[: len(text) // 2])
                die()
        return real_write(path, text)
    eval.report.atomic_write_text = atomic_write_text

from hydra import compose, initialize_config_dir
from dspark.config import load_config
from dspark.target import load_target_heads

with initialize_config_dir(config_dir=f"{repo}/conf", version_base="1.3"):
    cfg = load_config(compose(config_name="config", overrides=overrides))
from dspark.export.stage import run_export
run_export(cfg, Path(target))  # as train.py and eval.run's command do: the export stage first
eval.run.run_eval(cfg, load_target_heads(Path(target)), Path(target))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_trained_drafter):
    """The tiny target and the session's drafter trained on it for 2 steps (a checkpoint to
    evaluate; the eval only reads it), and the stub that eval.vllm_rows's child is started as."""
    target, data, ckpt = tiny_trained_drafter
    root = tmp_path_factory.mktemp("evalfaults")
    stub = root / "stub_serve.py"
    stub.write_text(STUB_SERVE)
    python = root / "python"  # what eval.vllm_rows's child is started with: the stub, in this venv
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {stub} "$@"\n')
    python.chmod(0o755)
    return target, data, ckpt, python


def eval_overrides(trained, out: Path) -> list[str]:
    target, data, ckpt, _ = trained
    return [
        *overrides(target, data, out),
        f"export.checkpoint={ckpt}",
        "eval.ablation_checkpoint=null",
        "eval.context_bins=[256,512]",
        "eval.prompts_per_bin=2",
        "eval.max_new_tokens=12",
        "eval.measure_plain=false",
        "eval.baselines=[ngram]",
        "eval.serve_export=never",
        "eval.reference_proposers=[dspark]",  # the chain is the main job test's; here one row is enough
        "eval.llama_cpp=never",  # the vLLM child's faults; llama.cpp's rows are tests/eval/test_llama_cpp.py's
    ]


def driver(trained, out: Path, point: str, **env: str) -> subprocess.Popen:
    target, _, _, python = trained
    args = [str(REPO), str(target), point, json.dumps(eval_overrides(trained, out))]
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args],
        cwd=REPO,
        env={**os.environ, "STUB_PYTHON": str(python), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def measured(out: Path) -> dict:
    """What an eval measured: every drafter's counts, rates and calibration, the conditions and
    the checks (wall-clock figures and paths left out)."""
    res = json.loads((out_dir_of(out) / "results.json").read_text())
    drafters = [
        {k: v for k, v in d.items() if k not in ("tokens_per_s", "draft_cost_ratio", "notes", "measured_speedup")}
        for d in res["drafters"]
    ]
    cond = {k: v for k, v in res["conditions"].items() if k not in ("checkpoint", "export_dir", "extra")}
    extra = {
        k: v for k, v in res["conditions"]["extra"].items() if k not in ("eval_seconds", "part_seconds", "fingerprint")
    }
    return {"drafters": drafters, "conditions": cond, "extra": extra, "checks": res.get("checks")}


@pytest.fixture(scope="module")
def uninterrupted(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    rc, log = finish(driver(trained, out, "none"))
    assert rc == 0, log[-4000:]
    got = measured(out)
    assert [d["name"] for d in got["drafters"]] == ["dspark", "ngram"]
    assert got["drafters"][0]["overall"]["num_drafts"] > 0 and got["drafters"][1]["overall"]["num_drafts"] > 0
    ngram = got["drafters"][1]["overall"]  # the stub's steps without a match are steps, not drafts
    assert ngram["num_steps"] > ngram["num_drafts"] and ngram["tokens_per_step"] < ngram["tau"]
    return got


def out_dir_of(out: Path) -> Path:
    """eval.out_dir: <paths.output_dir>/eval/<target>/<run name>."""
    (found,) = (out / "eval" / "tiny").iterdir()
    return found


@pytest.mark.slow
@pytest.mark.parametrize("point", ["reference", "after_reference", "serving", "report"])
def test_an_eval_killed_at_any_point_reruns_to_the_uninterrupted_numbers(trained, uninterrupted, tmp_path, point):
    out, pidfile = tmp_path, tmp_path / "serve.pid"
    if point == "serving":  # kill -9 of the driver alone while its vLLM child runs
        proc = driver(trained, out, point, STUB_HANG=str(pidfile))
        deadline = time.monotonic() + 300
        while not pidfile.is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.2)
        child = int(pidfile.read_text())
        proc.kill()
        finish(proc)
        for _ in range(50):  # the child dies with its driver: no engine left running for nobody
            if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the vLLM child {child} outlived its killed driver")
    else:
        rc, log = finish(driver(trained, out, point))
        assert rc == -signal.SIGKILL, log[-4000:]
    res = out_dir_of(out)
    assert not (res / "results.json").exists()  # nothing taken for a complete report
    parts = sorted(p.name for p in (res / "parts").iterdir()) if (res / "parts").is_dir() else []
    want_parts = {"reference": [], "after_reference": ["reference.json"], "serving": ["reference.json"]}
    if point == "report":
        assert parts == ["reference.json", "vllm_ngram.json"]
        assert [p.name for p in res.glob(".results.json.tmp-*")] != []  # the half file, under its temporary name
    else:
        assert [p for p in parts if not p.startswith(".")] == want_parts[point]
    t0 = time.monotonic()
    rc, log = finish(driver(trained, out, "none"))
    assert rc == 0, log[-4000:]
    assert time.monotonic() - t0 < 300
    assert measured(out) == uninterrupted
    kept = {name for name in ("reference", "vllm_ngram") if f"parts/{name}.json kept from an earlier run" in log}
    assert kept == {"reference": set(), "after_reference": {"reference"}, "serving": {"reference"}}.get(
        point, {"reference", "vllm_ngram"}
    ), log[-4000:]


def _drafter(tau_accepted: int) -> DrafterResult:
    c = AcceptanceCounts(2, 4, 8, tau_accepted, [min(tau_accepted, 4), max(tau_accepted - 4, 0)], num_steps=4)
    return DrafterResult("dspark", "reference", "dspark", c.summary(), {"64": {**c.summary(), "num_prompts": 1}})


def test_a_part_is_reused_only_whole_and_with_this_runs_key(tmp_path, caplog):
    parts = Parts(tmp_path / "parts", "key-a")
    calls = []

    def run() -> list[DrafterResult]:
        calls.append(1)
        return [_drafter(5)]

    first = parts.get_or_run("reference", run)
    assert parts.get_or_run("reference", run) == first and len(calls) == 1  # kept
    assert Parts(tmp_path / "parts", "key-b").get("reference") is None  # other checkpoint, settings or prompts
    assert Parts(tmp_path / "parts", "key-a", reuse=False).get("reference") is None  # eval.force
    path = tmp_path / "parts" / "reference.json"
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])  # as a copy that was cut short (ours are renamed whole)
    assert parts.get("reference") is None and f"{path} is unreadable" in caplog.text
    assert parts.get_or_run("reference", run) == first and len(calls) == 2
    assert path.read_text() == whole
    assert [p.name for p in path.parent.iterdir()] == ["reference.json"]  # no temporary file left


def test_which_eval_fields_feed_which_fingerprint_is_pinned():
    """The fingerprints' partition of the eval fields (their ``part`` metadata on EvalConfig): a field
    moved to another part, or a new field, changes which results a rerun keeps; decide it here."""
    from dspark.config import EVAL_PARTS, EvalConfig, eval_fields
    from eval.run import LLAMA_CPP_SETTINGS, NOT_LLAMA_CPP_SETTINGS, NOT_SETTINGS

    # llama_cpp_share_prefill: the same outputs and counts either way (test_llama_cpp.py), so not a setting
    assert set(NOT_SETTINGS) == {"force", "vllm_timeout_s", "llama_cpp_timeout_s", "llama_cpp_share_prefill", "out_dir"}
    assert set(LLAMA_CPP_SETTINGS) == {
        "llama_cpp",
        "llama_cpp_methods",
        "llama_cpp_target",
        "llama_cpp_draft_type",
        "llama_cpp_threads",
    }
    assert set(NOT_LLAMA_CPP_SETTINGS) == {
        "reference",
        "reference_proposers",
        "reference_outputs",
        "measure_plain",
        "plain_tokens",
        "baselines",
        "serve_export",
        "vllm_max_model_len",
        "vllm_cpu_kvcache_gib",
        "vllm_engine_kwargs",
        "target_tau",
        "target_pos1",
    }
    every = {  # no part: every fingerprint reads them
        "source",
        "aa_lcr_csv",
        "aa_lcr_texts",
        "context_bins",
        "prompts_per_bin",
        "prompts_file",
        "max_new_tokens",
        "temperature",
        "seed",
        "gamma",
        "confidence_threshold",
        "ablation_checkpoint",
    }
    assert set(eval_fields(None)) == every
    parts = [eval_fields(p) for p in EVAL_PARTS] + [eval_fields(None)]
    names = [f.name for f in fields(EvalConfig)]
    assert sorted(n for p in parts for n in p) == sorted(names)  # each field in exactly one
    with pytest.raises(ValueError, match="expected one of"):
        eval_fields("llama.cpp")


def test_llama_cpp_settings_leave_the_reference_and_vllm_parts_kept(tmp_path, compose_config):
    """Another llama.cpp target or method list measures llama.cpp's rows again and keeps the
    reference loop's and vLLM's parts (their key leaves llama.cpp's settings out); the report's
    fingerprint still changes, and a setting they read (gamma) changes theirs."""
    from dspark.export.stage import ExportRecord
    from eval.run import LLAMA_CPP_SETTINGS, NOT_LLAMA_CPP_SETTINGS, fingerprint

    record = ExportRecord(tmp_path / "exports.json", "0123456789abcdef", {"ours": tmp_path / "step00000001"}, {}, {})
    base = compose_config()
    for other in ("eval.llama_cpp_target=f32", "eval.llama_cpp_methods=[none,dspark]", "eval.llama_cpp_timeout_s=9"):
        changed = compose_config(other)
        assert fingerprint(changed, record, without=LLAMA_CPP_SETTINGS) == fingerprint(
            base, record, without=LLAMA_CPP_SETTINGS
        ), other
        if "timeout" not in other:  # how long to wait is not what is measured
            assert fingerprint(changed, record) != fingerprint(base, record), other
    gamma = compose_config("eval.gamma=3")
    assert fingerprint(gamma, record, without=LLAMA_CPP_SETTINGS) != fingerprint(
        base, record, without=LLAMA_CPP_SETTINGS
    )
    # and the other way: the reference loop turned on (for a parity table), other vLLM baselines or
    # another report directory keep llama.cpp's rows; gamma, which llama.cpp's rows read, does not
    for other in ("eval.reference=false", "eval.baselines=[]", "eval.out_dir=elsewhere", "eval.target_tau=9"):
        changed = compose_config(other)
        assert fingerprint(changed, record, without=NOT_LLAMA_CPP_SETTINGS) == fingerprint(
            base, record, without=NOT_LLAMA_CPP_SETTINGS
        ), other
    assert fingerprint(gamma, record, without=NOT_LLAMA_CPP_SETTINGS) != fingerprint(
        base, record, without=NOT_LLAMA_CPP_SETTINGS
    )
    assert fingerprint(compose_config("eval.out_dir=elsewhere"), record) == fingerprint(base, record)
    # the exports it serves are in every fingerprint: another checkpoint file or export dtype measures again
    other = ExportRecord(record.path, "fedcba9876543210", record.sources, {}, {})
    for without in ((), LLAMA_CPP_SETTINGS, NOT_LLAMA_CPP_SETTINGS):
        assert fingerprint(base, other, without=without) != fingerprint(base, record, without=without)
