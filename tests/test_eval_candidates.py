"""benchmarks/eval_candidates.py: each run evaluated with its own training config, the arms tested
over seeds on the dspark row's tokens per step, and results from other prompts refused."""

import json
import math

import pytest

from benchmarks import eval_candidates as ec


def _results(out, run, steps_accepted, name="dspark"):
    per = [{"prompt_id": f"p{i}", "num_steps": s, "num_accepted": a} for i, (s, a) in enumerate(steps_accepted)]
    steps, acc = sum(s for s, _ in steps_accepted), sum(a for _, a in steps_accepted)
    d = {"name": name, "overall": {"tokens_per_step": 1 + acc / steps}, "per_prompt": per}
    (out / run).mkdir(parents=True)
    (out / run / "results.json").write_text(json.dumps({"drafters": [d]}))
    return 1 + acc / steps


def test_the_command_composes_the_run_as_it_trained_and_runs_only_the_dspark_row(tmp_path):
    cmd = ec.eval_command(tmp_path / "lever-muon-lr2e3-bf16-mb4-seed4", tmp_path / "o")
    assert cmd[3:6] == ["+experiment=smollm2_cpu_levers", "+lever=muon_lr2e3_bf16_mb4", "seed=4"]
    assert f"export.checkpoint={tmp_path / 'lever-muon-lr2e3-bf16-mb4-seed4'}" in cmd
    assert {"eval.reference_proposers=[dspark]", "eval.baselines=[]", "eval.llama_cpp=never"} <= set(cmd)
    with pytest.raises(SystemExit, match="lever-NAME-seedK"):
        ec.eval_command(tmp_path / "markov256-win256", tmp_path / "o")


def test_the_table_holds_each_arms_mean_sd_and_welchs_test_against_the_baseline(tmp_path):
    base = [_results(tmp_path, f"lever-fp32-seed{s}", [(100, 20 + s), (50, 10)]) for s in range(3)]
    new = [_results(tmp_path, f"lever-muon-seed{s}", [(100, 30 + 2 * s), (50, 12)]) for s in range(3)]
    found = ec.read_results(tmp_path)
    assert found["fp32"][1]["per_prompt"] == {"p0": 1.21, "p1": 1.2}
    lines = ec.report(found, "fp32").splitlines()
    assert lines[2].startswith(f"| `fp32` | 3 | {sum(base) / 3:.3f} ± ") and lines[2].endswith("| baseline |")
    diff = sum(new) / 3 - sum(base) / 3  # the sds: 1/150 and 2/150, so se = sqrt(5/3) / 150
    t = diff / (math.sqrt(5 / 3) / 150)
    assert f"| `muon` | 3 | {sum(new) / 3:.3f} ± {2 / 150:.3f} | " in lines[3]
    assert f"{diff:+.3f}, {t:.2f} (" in lines[3]


def test_runs_on_other_prompts_or_without_a_dspark_row_are_refused(tmp_path):
    _results(tmp_path / "a", "lever-fp32-seed0", [(10, 2)])
    _results(tmp_path / "a", "lever-fp32-seed1", [(10, 3), (10, 1)])
    with pytest.raises(SystemExit, match="different prompts"):
        ec.report(ec.read_results(tmp_path / "a"), "fp32")
    _results(tmp_path / "b", "lever-fp32-seed0", [(10, 2)], name="ngram")
    with pytest.raises(SystemExit, match="no 'dspark' row"):
        ec.read_results(tmp_path / "b")
    _results(tmp_path / "c", "lever-fp32-seed0", [(10, 2)])
    with pytest.raises(SystemExit, match="--baseline bf16: no results"):
        ec.report(ec.read_results(tmp_path / "c"), "bf16")
