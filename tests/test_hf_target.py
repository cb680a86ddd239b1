"""The generic target (``target=hf``, a path and nothing else) on a second architecture: a tiny
random-weight Qwen3 goes through the main job on CPU, extract in vLLM -> train -> export ->
validation in vLLM -> eval, and its captured states are recomputed with transformers."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.formats.shard_format import Manifest

REPO = Path(__file__).resolve().parents[1]
RUN = "markov16-L1-i256"  # the smoke experiment's tiny drafter


def _run(cmd: list[str], timeout: int) -> str:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


@pytest.mark.slow
def test_tiny_qwen3_through_the_main_job_and_its_capture_matches_transformers(tmp_path, tiny_qwen3_dir):
    t0 = time.perf_counter()
    log = _run(
        [
            sys.executable,
            "train.py",
            "+experiment=smollm2_cpu_smoke",  # its sizes; the target is the generic one
            "target=hf",
            f"target.path={tiny_qwen3_dir}",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"paths.output_dir={tmp_path}",
            "logging.wandb=false",
        ],
        timeout=1500,
    )
    name = tiny_qwen3_dir.name
    assert "layer_ids [1, 3, 4, 6, 7] + final state 8 (spread_layer_ids(8)" in log  # chosen and said why
    assert f"target {name} (named after its directory) at {tiny_qwen3_dir}: Qwen3ForCausalLM, 8 layers" in log

    m = Manifest.load(tmp_path / "data" / name)  # extracted in vLLM, under the target's own name
    assert m.complete and m.target == name and m.architecture == "Qwen3ForCausalLM"
    assert m.layer_ids == [1, 3, 4, 6, 7, 8] and (m.hidden_size, m.num_hidden_layers) == (64, 8)
    assert sum(s.rows for s in m.shards) == 4

    run_json = tmp_path / "checkpoints" / name / RUN / "step00000002" / "run.json"
    assert json.loads(run_json.read_text())["config"]["target"]["layer_ids"] == [1, 3, 4, 6, 7]  # resolved, saved

    export = json.loads((tmp_path / "exports" / name / RUN / "dspark-dspark" / "config.json").read_text())
    assert export["target_layer_ids"] == [0, 2, 3, 5, 6] and export["target_hidden_size"] == 64
    assert "vLLM captures target layers [1, 3, 4, 6, 7]" in log  # the export validated against the Qwen3 target

    results = json.loads((tmp_path / "eval" / name / RUN / "results.json").read_text())
    ours = {d["name"]: d for d in results["drafters"]}["dspark"]
    assert ours["overall"]["tau"] >= 1 and ours["overall"]["num_drafts"] > 0
    assert not (tmp_path / "data" / "smollm2-135m").exists()  # nothing went to the default target's place

    report = tmp_path / "verify.json"
    out = subprocess.run(
        [sys.executable, "-m", "data_tools.verify", str(tmp_path / "data" / name), "--recompute", "4"]
        + ["--json", str(report)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    verified = json.loads(report.read_text())
    assert not verified["problems"] and verified["rows"] == 4
    assert set(verified["max_rel_err"]) == {"1", "3", "4", "6", "7", "8"}
    assert max(verified["max_rel_err"].values()) < 1e-4, verified["max_rel_err"]
    print(f"tiny Qwen3 main job + verify: {time.perf_counter() - t0:.0f} s")
