"""benchmarks/lever_report.py: its t distribution against the tables, Welch's test, the grouping of
runs by lever and seed, and the fit's crossing."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import lever_report as lr


@pytest.mark.parametrize("df, crit", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (1e6, 1.960)])
def test_the_t_critical_values_are_the_tables(df, crit):
    assert lr.t_critical(df) == pytest.approx(crit, abs=1e-3)
    assert lr.t_two_sided_p(crit, df) == pytest.approx(0.05, abs=1e-4)


def test_welch_by_hand():
    a, b = [1.38, 1.40, 1.37], [1.50, 1.52, 1.49]
    t = lr.welch(a, b)
    se = math.sqrt((0.000233333 + 0.000233333) / 3)
    assert t["diff"] == pytest.approx(0.12) and t["se"] == pytest.approx(se, rel=1e-4)
    assert t["df"] == pytest.approx(4.0) and t["t"] == pytest.approx(0.12 / se, rel=1e-4) and t["p"] < 0.001
    same = lr.welch([1.0, 1.1, 1.2], [1.05, 1.15, 1.1])
    assert same["p"] > 0.5  # a difference inside the seeds' spread does not pass


def _run(root: Path, name: str, taus: list[float], secs: float = 600.0) -> None:
    d = root / name
    d.mkdir(parents=True)
    lines = [
        {
            "step": 100 * (i + 1),
            "predictions": 2e4 * 10**i,
            "train_seconds": secs * (i + 1) / len(taus),
            "tau": t,
            "accept_pos_1": t - 1,
        }  # fmt: skip
        for i, t in enumerate(taus)
    ]
    (d / "validation.jsonl").write_text("".join(json.dumps(v) + "\n" for v in lines))


def test_runs_are_grouped_by_lever_and_tested_against_the_baseline(tmp_path, capsys):
    for seed, (base, new) in enumerate([(1.38, 1.50), (1.40, 1.52), (1.37, 1.49)]):
        _run(tmp_path, f"lever-fp32-seed{seed}", [1.1, 1.2, base])
        _run(tmp_path, f"lever-bf16-dv16k-seed{seed}", [1.1, 1.3, new])
    (tmp_path / "not-a-lever").mkdir()
    _run(tmp_path, "lever-fp32-seed3", [1.1, 1.2])  # still training: its last validation is not the arm's last step
    found = lr.lever_runs(tmp_path)
    assert "left out: lever-fp32-seed3 (at step 200 of 300, unfinished)" in capsys.readouterr().out
    assert sorted(found) == ["bf16-dv16k", "fp32"] and sorted(found["fp32"]) == [0, 1, 2]
    rows = lr.summary(found, "fp32")
    assert [r["lever"] for r in rows] == ["fp32", "bf16-dv16k"] and "test" not in rows[0]
    assert rows[1]["test"]["diff"] == pytest.approx(0.12) and rows[1]["test"]["p"] < 0.05
    md = lr.table(rows, "fp32")
    assert "| `bf16-dv16k` | 3 | 300 | 10.0 ± 0.0 |" in md and md.rstrip().endswith("| yes |")
    fit = lr.fit_crossing(found["fp32"], 2.0)
    assert fit["points"] == 9 and fit["b"] > 0 and fit["predictions"] > 2e6
    assert lr.fit_crossing(found["fp32"], 2.0, rate=100.0)["hours"] == pytest.approx(fit["predictions"] / 100 / 3600)


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no lever-NAME-seedK/validation.jsonl under"):
        lr.lever_runs(tmp_path)


def test_speculators_side_by_side_runs_join_the_table_at_the_baselines_predictions_per_step(tmp_path):
    for seed, base in enumerate([1.38, 1.40, 1.37]):
        _run(tmp_path, f"lever-fp32-seed{seed}", [1.1, 1.2, base])  # 2e6 predictions at step 300
    runs = []
    for seed, tau in enumerate([1.30, 1.31, 1.29]):
        path = tmp_path / f"sbs-{seed}.json"
        vals = [{"step": 50, "train_seconds": 60.0, "tau": 1.05, "pos1": 0.05},
                {"step": 150, "train_seconds": 590.0, "tau": tau, "pos1": 0.2}]  # fmt: skip
        path.write_text(json.dumps({"overrides": ["+experiment=x", f"seed={seed}"], "steps": 150,
                                    "speculators-muon": {"validations": vals, "seconds_per_step": 3.9}}))  # fmt: skip
        runs.append(path)
    found = lr.lever_runs(tmp_path)
    lr.side_by_side_runs(runs, found, "fp32")
    assert sorted(found["speculators-muon"]) == [0, 1, 2]
    last = found["speculators-muon"][1][-1]
    assert last["predictions"] == pytest.approx(150 * 2e6 / 300) and last["accept_pos_1"] == 0.2
    row = next(r for r in lr.summary(found, "fp32") if r["lever"] == "speculators-muon")
    assert row["steps"] == [150] and row["test"]["diff"] == pytest.approx(1.30 - 1.3833333, abs=1e-6)
    assert row["test"]["p"] < 0.05  # behind beyond the noise
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"overrides": ["+experiment=x"], "speculators": {"validations": []}}))
    with pytest.raises(SystemExit, match=r"bad.json: overrides \['\+experiment=x'\]: expected one seed=N"):
        lr.side_by_side_runs([bad], found, "fp32")
    with pytest.raises(SystemExit, match="needs the baseline arm 'bf16'"):
        lr.side_by_side_runs(runs, found, "bf16")


def test_noninferiority_passes_a_level_arm_and_fails_a_worse_or_noisy_one(tmp_path, capsys):
    base = [1.362, 1.357, 1.413, 1.380, 1.370, 1.366]
    level = [1.359, 1.376, 1.357, 1.403, 1.372, 1.368]
    n = lr.noninferiority(base, level, 0.035)
    w = lr.welch(base, level)
    # the lower bound is the difference less t(0.95, df) standard errors: by hand, against the table's 1.812 at 10 df
    assert n["lower"] == pytest.approx(w["diff"] - lr.t_critical(w["df"], 0.10) * w["se"])
    assert lr.t_critical(10, 0.10) == pytest.approx(1.812, abs=1e-3)
    assert n["lower"] > -0.035 and n["p_ni"] < 0.05
    worse = lr.noninferiority(base, [t - 0.04 for t in level], 0.035)
    assert worse["lower"] < -0.035 and worse["p_ni"] > 0.05  # level in spread but 0.04 lower: not shown no worse
    noisy = lr.noninferiority(base[:3], level[:2], 0.035)
    assert noisy["lower"] < -0.035  # two seeds against three cannot show it, whatever the means
    for seed, (a, b) in enumerate(zip(base, level)):
        _run(tmp_path, f"lever-fp32-seed{seed}", [1.1, 1.2, a])
        _run(tmp_path, f"lever-bf16-equal-steps-seed{seed}", [1.1, 1.2, b])
    md = lr.noninferiority_table(lr.lever_runs(tmp_path), "fp32", {"bf16-equal-steps": 0.035})
    assert md.splitlines()[-1].startswith("| `bf16-equal-steps` | 6 vs 6 |") and md.rstrip().endswith("| yes |")
    with pytest.raises(SystemExit, match="no runs of lever 'muon'"):
        lr.noninferiority_table(lr.lever_runs(tmp_path), "fp32", {"muon": 0.035})


def test_heldout_validations_replace_each_runs_final_one_at_its_own_step(tmp_path):
    for seed, (a, b) in enumerate([(1.38, 1.40), (1.40, 1.41), (1.37, 1.39)]):
        _run(tmp_path, f"lever-fp32-seed{seed}", [1.1, 1.2, a])
        _run(tmp_path, f"lever-bf16-seed{seed}", [1.1, 1.2, b])
    rows = [
        {"run": f"lever-{lv}-seed{s}", "lever": lv, "seed": s, "step": 300, "tau": t, "accept_pos_1": t - 1}
        for lv, taus in (("fp32", [1.30, 1.31, 1.29]), ("bf16", [1.35, 1.36, 1.34]))
        for s, t in enumerate(taus)
    ]
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = lr.heldout_runs(f, lr.lever_runs(tmp_path))
    assert [v["tau"] for v in held["bf16"][1]] == [1.36] and held["bf16"][1][0][
        "predictions"
    ] == 2e6  # the run's own count
    out = lr.summary(held, "fp32")
    assert out[1]["test"]["diff"] == pytest.approx(0.05) and out[1]["test"]["p"] < 0.01
    assert lr.table(out, "fp32", alpha=0.001).rstrip().endswith("| no |")  # the level is the caller's
    f.write_text(json.dumps({**rows[0], "step": 200}) + "\n")
    with pytest.raises(SystemExit, match="re-validated at step 200, its run ended at 300"):
        lr.heldout_runs(f, lr.lever_runs(tmp_path))
