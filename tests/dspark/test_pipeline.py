"""The main job (README's first command) on the embedded target."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from data_tools.schema import Manifest
from dspark.pipeline import run

REPO = Path(__file__).resolve().parents[2]


def test_target_stage_alone(smollm2_dir, compose_config, caplog):
    cfg = compose_config("+experiment=smollm2_cpu_demo", "stages=[]")
    with caplog.at_level(logging.INFO):
        result = run(cfg)
    assert result.target.path == smollm2_dir
    assert result.target.hidden_size == 576 and result.drafter.block_size == 7
    assert result.stages_run == ["target"]
    assert "capture layers (transformers hidden_states ids): [1, 8, 15, 22, 29, 30]" in caplog.text


@pytest.mark.slow
def test_main_job_extracts_trains_exports_and_evaluates(tmp_path, smollm2_dir):
    out = subprocess.run(
        [sys.executable, "train.py", "+experiment=smollm2_cpu_smoke", f"data.shards_dir={tmp_path / 'ds'}",
         f"hydra.run.dir={tmp_path / 'run'}", f"paths.output_dir={tmp_path}", "logging.wandb=false"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    log = out.stdout + out.stderr  # Hydra logs to stdout, tqdm to stderr
    assert out.returncode == 0, log[-3000:]
    m = Manifest.load(tmp_path / "ds")
    assert m.complete and sum(s.rows for s in m.shards) == 4
    assert "extract: 4 rows" in log and "step 2/2" in log
    assert (tmp_path / "checkpoints" / "smollm2-135m" / "step00000002" / "run.json").is_file()
    export = tmp_path / "exports" / "smollm2-135m" / "dspark-dspark"
    assert json.loads((export / "config.json").read_text())["sample_from_anchor"] is True
    assert "validated" in log and "vLLM captures target layers [1, 8, 15, 22, 29]" in log
    results = json.loads((tmp_path / "eval" / "smollm2-135m" / "results.json").read_text())
    names = {d["name"]: d for d in results["drafters"]}
    assert set(names) == {"dspark", "ngram"}
    for d in names.values():  # every bin measured, by the reference loop and by vLLM's counters
        assert set(d["per_bin"]) == {"256", "512"} and d["overall"]["num_drafts"] > 0
    assert (tmp_path / "eval" / "smollm2-135m" / "tau_per_bin.png").stat().st_size > 1000
