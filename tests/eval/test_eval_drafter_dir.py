"""``export.checkpoint`` names a trained drafter's directory (issue #38, item 1: "the eval evaluates
one"): a speculators DSpark checkpoint is measured as it is, and measures exactly what the DeepSpeed
checkpoint it was converted from measures (same weights, same answers, same counts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspark.export import export
from dspark.export.speculators_format import write_speculators
from tests.toy import overrides


def eval_config(compose_config, target: Path, data: Path, out: Path, checkpoint: Path, *extra: str):
    return compose_config(
        *overrides(target, data, out),
        f"export.checkpoint={checkpoint}",
        "eval.ablation_checkpoint=null",
        "eval.context_bins=[256,512]",
        "eval.prompts_per_bin=2",
        "eval.max_new_tokens=12",
        "eval.measure_plain=false",
        "eval.baselines=[]",
        "eval.serve_export=never",
        "eval.reference_proposers=[dspark]",
        "eval.llama_cpp=never",
        *extra,
    )


def run_eval(cfg, heads, target: Path):
    """As ``python train.py stages=[eval]`` runs it: the export stage first (a no-op when its
    record is up to date), then the eval, which reads the record."""
    from dspark.export.stage import run_export
    from eval.run import run_eval as eval_only

    run_export(cfg, target)
    return eval_only(cfg, heads, target)


@pytest.mark.slow
def test_a_speculators_checkpoint_is_measured_as_the_checkpoint_it_came_from(
    tiny_trained_drafter, tmp_path, compose_config
):
    from dspark.target import load_target_heads

    target, data, ckpt = tiny_trained_drafter
    export(ckpt, tmp_path / "ours", target_dir=target)
    theirs = write_speculators(tmp_path / "ours", tmp_path / "theirs")
    heads = load_target_heads(target)

    ours = run_eval(eval_config(compose_config, target, data, tmp_path / "a", ckpt), heads, target)
    cfg = eval_config(compose_config, target, data, tmp_path / "b", theirs)
    got = run_eval(cfg, heads, target)

    assert got.results.conditions.checkpoint == str(theirs)
    (a,) = [d for d in ours.results.drafters if d.runner == "reference"]
    (b,) = [d for d in got.results.drafters if d.runner == "reference"]
    assert len(b.per_prompt) == 4 and b.overall["num_steps"] > 0
    assert b.per_prompt == a.per_prompt  # counts and greedy answers, prompt by prompt
    assert json.dumps(b.overall) == json.dumps(a.overall)  # NaN where a position was never reached
    # what the report hashes is the speculators weights file: a new one is measured again
    assert (
        run_eval(cfg, heads, target).results.conditions.extra["fingerprint"]
        == got.results.conditions.extra["fingerprint"]
    )
    weights = theirs / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    assert (
        run_eval(cfg, heads, target).results.conditions.extra["fingerprint"]
        != got.results.conditions.extra["fingerprint"]
    )


@pytest.mark.slow
def test_an_export_is_evaluated_as_it_is_never_exported_again(tiny_trained_drafter, tmp_path, compose_config):
    """Issue #60 item 3: export.checkpoint= the main job's export ended in "--out ...: it holds the
    checkpoint ... being exported": the eval exported the export into its own default directory."""
    from dspark.target import load_target_heads

    target, data, ckpt = tiny_trained_drafter
    exports = tmp_path / "exports"
    mine = exports / "dspark-dspark"  # where this run's eval would export its own drafter
    export(ckpt, mine, target_dir=target)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in mine.iterdir()}
    heads = load_target_heads(target)
    ours = run_eval(eval_config(compose_config, target, data, tmp_path / "a", ckpt), heads, target)
    cfg = eval_config(compose_config, target, data, tmp_path / "b", mine, f"export.out_dir={exports}")
    got = run_eval(cfg, heads, target)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in mine.iterdir()} == before  # untouched
    assert got.results.conditions.checkpoint == str(mine)
    (a,) = [d for d in ours.results.drafters if d.runner == "reference"]
    (b,) = [d for d in got.results.drafters if d.runner == "reference"]
    assert b.per_prompt == a.per_prompt and b.overall["num_steps"] > 0
    assert (tmp_path / "b" / "report.md").is_file() or any((tmp_path / "b").rglob("report.md"))
