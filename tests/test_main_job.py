"""The main job (README's first command) on the embedded target."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.formats.shard_format import Manifest
from train import run

REPO = Path(__file__).resolve().parents[1]


def test_target_stage_alone(smollm2_dir, compose_config, caplog):
    cfg = compose_config("+experiment=smollm2_cpu_demo", "stages=[]")
    with caplog.at_level(logging.INFO):
        result = run(cfg)
    assert result.target.path == smollm2_dir
    assert result.target.hidden_size == 576 and result.drafter.block_size == 7
    assert result.stages_run == ["target"]
    assert "capture layers (transformers hidden_states ids): [1, 8, 15, 22, 29, 30]" in caplog.text


def _main_job(tmp_path: Path, *extra: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "+experiment=smollm2_cpu_smoke",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"paths.output_dir={tmp_path}",
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = out.stdout + out.stderr  # Hydra logs to stdout, tqdm to stderr
    assert out.returncode == 0, log[-3000:]
    return log


@pytest.mark.slow
def test_main_job_with_its_ablation_then_a_rerun_that_skips_everything(tmp_path, smollm2_dir):
    """The smoke experiment: the Markov-off ablation (one override), then the main command, which
    puts both side by side with ngram, then the main command again: every stage up to date."""
    log = _main_job(tmp_path, "drafter.markov_rank=0", "stages=[extract,train]", "logging.wandb=false")
    assert "extract: 4 rows" in log and "step 2/2" in log
    assert (tmp_path / "checkpoints" / "smollm2-135m" / "markov0-L1-i256" / "step00000002" / "run.json").is_file()

    log = _main_job(tmp_path)  # W&B on (offline)
    assert "extract  up to date (1 complete shards), skipped" in log and "step 2/2" in log
    m = Manifest.load(tmp_path / "data" / "smollm2-135m")
    assert m.complete and sum(s.rows for s in m.shards) == 4
    assert (tmp_path / "checkpoints" / "smollm2-135m" / "markov16-L1-i256" / "step00000002" / "run.json").is_file()
    for name in ("dspark-dspark", "ablation-dspark"):  # both exported and validated in vLLM
        cfg = json.loads(
            (tmp_path / "exports" / "smollm2-135m" / "markov16-L1-i256" / name / "config.json").read_text()
        )
        assert cfg["sample_from_anchor"] is True and cfg["target_layer_ids"] == [0, 7, 14, 21, 28]
    assert log.count("vLLM captures target layers [1, 8, 15, 22, 29]") == 2
    report_dir = tmp_path / "eval" / "smollm2-135m" / "markov16-L1-i256"
    results = json.loads((report_dir / "results.json").read_text())
    names = {d["name"]: d for d in results["drafters"]}
    # llama.cpp (built by scripts/setup.sh) serves ours with its Markov head, the chain, its ngram, none,
    # and the Markov-off ablation (its confidence head exported with a zero Markov column)
    served = {f"llama.cpp-{m}" for m in ("none", "ngram", "dspark", "ngram-then-dspark", "markov-off")}
    assert set(names) == {"dspark", "markov-off", "ngram-then-dspark", "ngram"} | served
    for d in names.values():  # every bin measured, by the reference loop, vLLM's and llama.cpp's counters
        assert set(d["per_bin"]) == {"256", "512"}
        assert d["overall"]["num_drafts"] > 0 or d["name"] in ("llama.cpp-none", "llama.cpp-ngram")
        o = d["overall"]  # every target step counted, drafted or not
        assert o["num_steps"] >= o["num_drafts"] and o["tokens_per_step"] == 1 + o["num_accepted"] / o["num_steps"]
        assert sum(p["num_steps"] for p in d["per_prompt"]) == o["num_steps"]
        assert len(d["per_prompt"]) == sum(b["num_prompts"] for b in d["per_bin"].values()) == 2
        lo, hi = d["intervals"]["overall"]["tokens_per_step"]
        assert lo <= d["tokens_per_step"] <= hi
    # ours and the chain draft on every step but, beside llama.cpp's rows, a last one with a single token
    # left (llama.cpp's block budget, which the reference loop then follows so that the twins count alike)
    for name in ("dspark", "ngram-then-dspark"):
        assert all(p["num_drafts"] >= p["num_steps"] - 1 for p in names[name]["per_prompt"])
    for name in ("dspark", "ngram-then-dspark"):  # plain decoding timed over each answer's first eval.plain_tokens
        assert re.search(r"plain decoding \d+\.\d ms/token \(each answer's first 6 tokens\)$", names[name]["notes"])
    equal = results["conditions"]["extra"]["greedy_outputs_equal"]  # each row's greedy text against vLLM ngram's
    assert set(equal) == set(names) and all(e["prompts"] == 2 and 0 <= e["equal"] <= 2 for e in equal.values())
    assert equal["ngram"]["equal"] == 2 and all(len(p["output_ids"]) > 0 for p in names["dspark"]["per_prompt"])
    none = names["llama.cpp-none"]  # no speculation: one token per step; the wall clock every row is compared with
    assert none["overall"]["num_drafts"] == 0 and none["overall"]["tokens_per_step"] == 1.0
    for name in served:  # llama.cpp drafts each step but a last one with a single token left
        o, d = names[name]["overall"], names[name]
        assert (
            d["runner"] == "llama.cpp" and d["tokens_per_s"] > 0 and d["baseline_tokens_per_s"] == none["tokens_per_s"]
        )
        if name not in ("llama.cpp-none", "llama.cpp-ngram"):
            assert o["num_steps"] - 2 <= o["num_drafts"] <= o["num_steps"] and d["draft_cost_ratio"] > 0
    parity = results["conditions"]["extra"]["llama_cpp_parity"]  # llama.cpp's rows beside their reference twins
    assert set(parity) == {"llama.cpp-dspark", "llama.cpp-ngram-then-dspark", "llama.cpp-markov-off"}
    assert all(p["prompts"] == 2 and len(p["per_prompt"]) == 2 for p in parity.values())
    assert {c["name"] for c in results["checks"]} >= {
        "DSpark over its Markov-off ablation",
        "DSpark over vLLM ngram",
        "no long-context collapse",
    }
    for png in ("tokens_per_step_per_bin.png", "acceptance_per_position.png"):
        assert (report_dir / png).stat().st_size > 1000
    report = (report_dir / "report.md").read_text()
    assert "markov-off" in report and "ngram" in report and "| gamma | 4 |" in report
    assert "## llama.cpp against the reference loop" in report
    assert f"report   {report_dir / 'report.md'}: open it first, its Summary says what was found" in log
    assert report.startswith("# DSpark acceptance report\n\n## Summary\n\n- **Ours** (`dspark`, reference): **")
    assert all("{" not in line for line in report.splitlines() if line.startswith("|"))  # no dict in a cell
    for name in ("DSpark over its Markov-off ablation", "DSpark over vLLM ngram", "no long-context collapse"):
        assert re.search(rf"check    {name}: (PASS|MISS|inside the noise) \(", log), name  # in the closing summary
    assert re.search(
        r"eval     ngram +tokens/step \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]  \(tau \d\.\d{3} over drafted steps", log
    )
    # the speedup with its interval (10x and more where `none` ran on busy cores)
    clock = r"\d+\.\d tok/s = \d+\.\d\dx \[\d+\.\d\d, \d+\.\d\d\] none"
    assert re.search(r"eval     llama.cpp-dspark +tokens/step .*; llama.cpp, " + clock + r"\)", log)
    assert re.search(r"check    wall-clock speedup over plain decoding \(bs=1, llama.cpp-dspark\): ", log)
    assert list((tmp_path / "wandb").glob("offline-run-*")) or list(report_dir.glob("wandb/offline-run-*"))
    # where the wall clock went (issue #49): each stage's line ends with its minutes, the last line totals them,
    # and the eval lists its parts: the eval set, the reference loop, each vLLM method and each llama.cpp row
    assert re.search(r"train    step 2/2 -> \S+  \[\d+\.\d min\]", log)
    # the export stage between train and eval (issue #59): both checkpoints, each layout checked with vLLM's classes
    exported = r"export   2 exports \(ours dspark, ablation dspark\), 2 checked with vLLM's classes -> \S+exports\.json"
    assert re.search(exported + r"  \[\d+\.\d min\]", log)
    total = re.search(
        r"time     (\d+\.\d) min of wall clock \(target [\d.]+ \+ extract [\d.]+ \+ train [\d.]+ "
        r"\+ export [\d.]+ \+ eval ([\d.]+)\)",
        log,
    )
    assert total and float(total.group(1)) >= float(total.group(2))
    parts = re.search(
        r"eval     time: eval set [\d.]+ min, reference [\d.]+ min, vllm_ngram [\d.]+ min, .*"
        r"llama.cpp-none [\d.]+ min",
        log,
    )
    assert parts, log[-3000:]

    log = _main_job(tmp_path, "logging.wandb=false")
    assert "extract  up to date" in log and "train    up to date" in log and "eval: " in log and "is up to date" in log
    assert re.search(r"export: \S+exports\.json is up to date \(same checkpoint files and settings\), skipped", log)
    assert "step 1/2" not in log and "--method ngram" not in log  # no vLLM run either
    assert "check    DSpark over vLLM ngram: " in log  # read back from results.json


def _train_without_data(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            "+experiment=smollm2_cpu_smoke",
            "stages=[train]",
            f"data.shards_dir={tmp_path / 'nodata'}",
            f"paths.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DSPARK_DEBUG")} | env,
    )


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_a_user_error_in_a_stage_is_one_line_and_exit_status_2(tmp_path, smollm2_dir):
    out = _train_without_data(tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (
        f"error: data.shards_dir={tmp_path / 'nodata'}: no dataset there (no manifest.json), expected the shards "
        "the extract stage writes; run stages=[extract] first (the same command with stages=[extract,train]), or "
        "set data.shards_dir to an extracted dataset"
    )
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_a_user_error_shows_its_traceback_with_hydra_full_error(tmp_path, smollm2_dir):
    out = _train_without_data(tmp_path, HYDRA_FULL_ERROR="1")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "DatasetError: data.shards_dir=" in out.stderr
