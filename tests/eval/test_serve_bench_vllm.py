"""The serving benchmark against real vLLM OpenAI servers on this CPU (issue #15): the smoke
experiment's drafter (in the fill-in layout, so vLLM's CPU build can serve it as ``dflash``),
ngram and no speculation, at concurrency 1 and 2 on the smoke eval set (2 short prompts, 8
tokens each), as a stage of the main job. Slow: an extraction engine, 2 training steps, 3 servers."""

import json
import math
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from eval.serve_bench.client import METRICS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

FILL_IN = ["drafter.sample_from_anchor=false", "drafter.markov_rank=0", "drafter.enable_confidence_head=false"]


def _train_py(tmp_path: Path, name: str, *extra: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "+experiment=smollm2_cpu_smoke",
            *FILL_IN,
            f"paths.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / name}",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


def test_serving_bench_against_real_servers(tmp_path, smollm2_dir, compose_config):
    cfg = compose_config("+experiment=smollm2_cpu_smoke", *FILL_IN, f"paths.output_dir={tmp_path}")
    out_dir = Path(cfg.serve_bench.out_dir)
    _train_py(tmp_path, "run1", "stages=[extract,train]", "logging.wandb=false")
    log = _train_py(
        tmp_path, "run2", "stages=[serve_bench]", "serve_bench.concurrency=[1,2]", "serve_bench.output_len=8"
    )
    data = json.loads((out_dir / "serve_bench.json").read_text())
    c = data["conditions"]
    assert c["gamma"] == 4 and c["output_len"] == 8 and c["num_requests"] == 2 and c["concurrency"] == [1, 2]
    assert [(x["name"], x["method"]) for x in data["configs"]] == [
        ("none", None),
        ("ngram", "ngram"),
        ("ours", "dflash"),
    ]
    for cf in data["configs"]:
        assert [lv["concurrency"] for lv in cf["levels"]] == [1, 2]
        for lv in cf["levels"]:
            m = lv["metrics"]
            assert set(m) == set(METRICS) and all(math.isfinite(v) for v in m.values()), (cf["name"], m)
            assert m["completed"] == 2 and m["failed"] == 0 and m["output_tokens_per_s"] > 0
            assert m["total_output_tokens"] == 2 * 8  # EOS ignored: every configuration does the same work
            assert 0.1 < lv["memory"]["peak_rss_gib"] < 64
            s = lv["spec"]
            if cf["method"] is None:
                assert s is None
                continue
            gamma, tokens = 4, m["total_output_tokens"]
            assert s["tau"] == pytest.approx(1 + s["num_accepted"] / s["num_drafts"])
            assert s["num_accepted"] <= s["num_draft_tokens"] <= s["num_drafts"] * gamma
            assert sum(s["accepted_per_pos"]) == pytest.approx(s["num_accepted"], abs=gamma)
            # each verification step emits its accepted tokens and one more; the first token is prefill's
            assert s["num_drafts"] + s["num_accepted"] <= tokens - m["completed"] + m["completed"] * gamma
            if cf["method"] == "dflash":  # it drafts at every step
                assert s["num_drafts"] + s["num_accepted"] >= tokens - m["completed"]
        # the server and every process it started are gone
        assert cf["server_pids"]
        for pid in cf["server_pids"]:
            assert not psutil.pid_exists(pid) or "vllm" not in " ".join(psutil.Process(pid).cmdline()), pid
    assert set(data["speedup_over_none"]) == {"ngram", "ours"}
    for png in ("tokens_per_s.png", "itl_p95.png", "speedup.png"):
        assert (out_dir / png).stat().st_size > 1000
    assert "| ours (dflash) | 2 |" in (out_dir / "serve_bench.md").read_text()
    assert "serve    tokens/s at concurrency 1/2: none " in log and f"serving  {out_dir / 'serve_bench.md'}" in log
    assert list((out_dir / "wandb").glob("offline-run-*"))  # W&B (offline in tests)
