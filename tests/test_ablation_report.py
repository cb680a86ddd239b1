"""benchmarks/ablation_report.py: the 95 % intervals of val tau and pos-1 over the validation's
blocks, checked against values worked out by hand, and the table's "inside the noise" marks."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks.ablation_report import by_step, main, noise, ranking, runs, table

GAMMA = 4


def record(lengths: dict[int, float], blocks: int | None, *, step: int = 100, loss: float = 2.0) -> dict:
    """A validation record whose blocks accept L drafted tokens with the shares ``lengths``
    ({L: share}): accept_pos_k = P(L >= k), tau = 1 + E[L]."""
    a = [sum(p for length, p in lengths.items() if length >= k) for k in range(1, GAMMA + 1)]
    v = {"step": step, "predictions": 1000 * step, "train_seconds": 60.0 * step, "loss": loss, "tau": 1.0 + sum(a)}
    v |= {f"accept_pos_{k}": ak for k, ak in enumerate(a, start=1)}
    if blocks is not None:
        v["blocks"] = blocks
    return v


def write_run(root: Path, name: str, *vals: dict) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "validation.jsonl").write_text("".join(json.dumps(v) + "\n" for v in vals))
    return d


def test_no_block_accepted_and_every_block_fully_accepted_have_no_spread():
    none = noise(record({0: 1.0}, 50))
    assert none["tau_se"] == 0.0 and (none["tau_lo"], none["tau_hi"]) == (1.0, 1.0)
    assert none["pos1_se"] == 0.0 and (none["pos1_lo"], none["pos1_hi"]) == (0.0, 0.0)
    full = noise(record({GAMMA: 1.0}, 50))  # E[L] = 4, E[L^2] = 1 + 3 + 5 + 7 = 16: Var 0
    assert full["tau_se"] == pytest.approx(0.0, abs=1e-12)
    assert (full["tau_lo"], full["tau_hi"]) == pytest.approx((5.0, 5.0))
    assert full["pos1_se"] == 0.0 and full["blocks"] == 50


def test_mixed_blocks_by_hand():
    # half the blocks accept nothing, half all 4: a = .5 each, E[L] = 2, E[L^2] = 8, Var 4
    half = noise(record({0: 0.5, GAMMA: 0.5}, 100))
    assert half["tau_se"] == pytest.approx(0.2)  # sqrt(4 / 100)
    assert (half["tau_lo"], half["tau_hi"]) == pytest.approx((3.0 - 0.392, 3.0 + 0.392))
    assert half["pos1_se"] == pytest.approx(0.05)  # sqrt(.25 / 100)
    assert (half["pos1_lo"], half["pos1_hi"]) == pytest.approx((0.5 - 0.098, 0.5 + 0.098))
    # L = 1 or 2 evenly: a = (1, .5, 0, 0), E[L] = 1.5, E[L^2] = 1 + 3 * .5 = 2.5, Var .25
    one_two = noise(record({1: 0.5, 2: 0.5}, 25))
    assert one_two["tau_se"] == pytest.approx(0.1)  # sqrt(.25 / 25)
    assert (one_two["tau_lo"], one_two["tau_hi"]) == pytest.approx((2.5 - 0.196, 2.5 + 0.196))
    assert one_two["pos1_se"] == 0.0  # every block accepts its first draft
    # L = 0, 1, 2, 3 with shares .4, .3, .2, .1: a = (.6, .3, .1, 0), E[L] = 1, E[L^2] = .6 + .9 + .5 = 2
    spread = noise(record({0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1}, 400))
    assert spread["tau_se"] == pytest.approx(math.sqrt(1.0 / 400))
    assert spread["pos1_se"] == pytest.approx(math.sqrt(0.24 / 400))


def test_a_record_without_block_count_has_no_interval():
    assert noise(record({0: 0.5, GAMMA: 0.5}, None)) is None
    assert noise(record({0: 0.5, GAMMA: 0.5}, 0)) is None


def fake_runs(root: Path) -> None:
    write_run(root, "best", record({0: 1.0}, 10, step=50), record({0: 0.5, GAMMA: 0.5}, 100))  # 3 +- .392
    write_run(root, "near", record({1: 0.5, 2: 0.5}, 25))  # 2.5 +- .196: reaches 2.696 > 2.608
    write_run(root, "tight", record({1: 0.5, 2: 0.5}, 100))  # 2.5 +- .098: up to 2.598 < 2.608
    write_run(root, "old", record({1: 0.1, 2: 0.9}, None))  # tau 2.9, no count
    write_run(root, "zero", record({0: 1.0}, 100))  # 1 +- 0


def test_table_shows_intervals_and_marks_runs_inside_the_noise_of_the_best(tmp_path):
    fake_runs(tmp_path)
    found = runs([tmp_path])
    assert [(name, standing) for name, _, standing in ranking(found)] == [
        ("best", "best"),
        ("old", "n/a"),
        ("near", "inside the noise"),
        ("tight", ""),
        ("zero", ""),
    ]
    text = table(found)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 3.000 ± 0.392 | 0.500 ± 0.098 |" in rows["best"] and rows["best"].endswith("| 100 | best |")
    assert "| 2.500 ± 0.196 | 1.000 ± 0.000 |" in rows["near"] and rows["near"].endswith("| 25 | inside the noise |")
    assert "| 2.500 ± 0.098 |" in rows["tight"] and rows["tight"].endswith("| 100 |  |")
    assert "| 1.000 ± 0.000 | 0.000 ± 0.000 |" in rows["zero"] and rows["zero"].endswith("| 100 |  |")
    assert "| 2.900 ± n/a | 1.000 ± n/a |" in rows["old"] and rows["old"].endswith("| n/a | n/a |")
    assert [name for name, row in rows.items() if row.endswith("| inside the noise |")] == ["near"]
    assert "Inside the noise of the best run, best (val tau intervals overlap its own): near." in text
    assert "No block count, not compared: old." in text
    assert "lower bound on the noise" in text and "--paired" in text


def test_no_overlap_and_a_best_run_without_count_are_said_so(tmp_path):
    write_run(tmp_path / "a", "top", record({0: 0.5, GAMMA: 0.5}, 100))
    write_run(tmp_path / "a", "low", record({0: 1.0}, 100))
    assert "No run's val tau interval overlaps the best run's (top)." in table(runs([tmp_path / "a"]))
    write_run(tmp_path / "b", "top", record({0: 0.5, GAMMA: 0.5}, None))
    write_run(tmp_path / "b", "low", record({0: 1.0}, 100))
    text = table(runs([tmp_path / "b"]))
    assert "The best run, top, has no block count" in text and "inside the noise" not in text


def test_json_carries_the_intervals(tmp_path, monkeypatch, capsys):
    fake_runs(tmp_path / "ckpt")
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["ablation_report.py", str(tmp_path / "ckpt"), "--json", str(out)])
    main()
    assert "| 3.000 ± 0.392 |" in capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["intervals"]["best"]["tau_se"] == pytest.approx(0.2) and got["intervals"]["best"]["blocks"] == 100
    assert (got["intervals"]["near"]["tau_lo"], got["intervals"]["near"]["tau_hi"]) == pytest.approx((2.304, 2.696))
    assert got["intervals"]["near"]["standing"] == "inside the noise"
    assert got["intervals"]["old"] == {"standing": "n/a"}
    assert len(got["runs"]["best"]) == 2  # the records themselves, as before


def test_by_step_lines_up_runs_at_each_validated_step_and_leaves_missing_steps_empty(tmp_path):
    half = {0: 0.5, 2: 0.5}  # tau 2, pos-1 0.5 (the "best" record of fake_runs)
    write_run(tmp_path, "long", record({0: 1.0}, 100, step=50), record(half, 100, step=100))
    write_run(tmp_path, "short", record(half, None, step=50))
    rows = {line.split(" | ")[0].strip("| "): line for line in by_step(runs([tmp_path])).splitlines()}
    assert rows["run"] == "| run | step 50 | step 100 |"
    assert rows["long"] == "| long | 1.000 ± 0.000 / 0.000 ± 0.000 | 2.000 ± 0.196 / 0.500 ± 0.098 |"
    assert rows["short"] == "| short | 2.000 / 0.500 |  |"  # no block count: no interval; no step 100
