"""Every acceptance figure declared in ``eval.acceptance.ACCEPTANCE_METRICS`` reaches every output
that shows acceptance: report.md's figures table, the report's W&B scalars, serve_bench.md and
serve_bench's W&B scalars and table. A figure added to the list but not shown somewhere fails here."""

from dataclasses import asdict

import pytest

from eval.acceptance import ACCEPTANCE_METRICS, AcceptanceCounts, per_bin_summary
from eval.intervals import STATS
from eval.report import metric_text, write_report
from eval.report_wandb import _wandb_scalars
from eval.results import DrafterResult, EvalConditions, EvalResults
from eval.serve_bench.client import METRICS
from eval.serve_bench.report import TABLE_COLUMNS, render_markdown, table_rows, wandb_scalars

GAMMA = 3
# accepted tokens per step, None: a step without a draft. 6 steps, 4 drafts, 6 accepted: every
# figure differs (tokens/step 2.000, tau 2.500, drafted 67%, pos-1 0.750), so a column that shows
# another figure's value fails too.
STEPS = [3, 1, None, 2, 0, None]


def counts(steps: list) -> AcceptanceCounts:
    c = AcceptanceCounts(GAMMA)
    for a in steps:
        c.add_step(0, 0) if a is None else c.add_step(GAMMA, a)
    return c


def first_table(md: str, after: str) -> tuple[list[str], list[str]]:
    """The header and first row of the first Markdown table after ``after``."""
    lines = [line for line in md.split(after, 1)[1].splitlines() if line.startswith("|")]
    header, _, row = ([c.strip() for c in line.strip().strip("|").split("|")] for line in lines[:3])
    return header, row


def test_every_declared_metric_is_a_summary_key_with_its_interval_in_stats():
    summary = counts(STEPS).summary()
    for m in ACCEPTANCE_METRICS:
        assert m.name in summary and (not m.stat or m.stat in STATS), m
    assert [m.value(summary) for m in ACCEPTANCE_METRICS] == [2.0, 2.5, pytest.approx(4 / 6), 0.75]


def test_every_declared_metric_reaches_the_report_and_its_wandb_scalars(tmp_path):
    prompts = [counts(STEPS[:3]), counts(STEPS[3:])]
    overall, per_bin = per_bin_summary([1024, 1024], prompts, GAMMA)
    per_prompt = [{"prompt_id": f"p{i}", "bin": 1024, **asdict(p)} for i, p in enumerate(prompts)]
    d = DrafterResult("dspark", "reference", "dspark", overall, per_bin, per_prompt=per_prompt)
    results = EvalResults(EvalConditions("t", "/t", GAMMA, 0.0, 16, "offline", [1024], {"1024": 2}), [d])
    header, row = first_table(write_report(results, tmp_path).markdown.read_text(), "## Tokens per target step\n")
    scalars = _wandb_scalars(results, [])
    for m in ACCEPTANCE_METRICS:
        cell = row[header.index(m.label)]
        assert cell.startswith(metric_text(m, m.value(overall))) and cell.endswith("]") == bool(m.stat), (m, cell)
        if m.per_position:
            logged = [scalars[f"eval/dspark/{m.position_name(k)}"] for k in range(1, GAMMA + 1)]
            assert logged == pytest.approx(overall[m.name]), m
        else:
            assert scalars[f"eval/dspark/{m.name}"] == pytest.approx(m.value(overall)), m
        if m.per_bin:
            assert scalars[f"eval/dspark/{m.name}_bin_1024"] == pytest.approx(m.value(per_bin["1024"])), m


def test_every_declared_metric_reaches_serve_bench_md_and_its_wandb(tmp_path):
    spec = counts(STEPS).summary()
    level = {
        "concurrency": 1,
        "metrics": {k: 1.0 for k in METRICS},
        "spec": spec,
        "memory": {"peak_rss_gib": 1.0, "peak_gpu_gib": None},
    }
    conditions = {
        "target": "t",
        "target_path": "/t",
        "device": "cpu",
        "dtype": "float32",
        "gamma": GAMMA,
        "num_requests": 2,
        "traffic_kind": "eval set",
        "traffic": "e.jsonl",
        "output_len": 8,
        "ignore_eos": True,
        "temperature": 0.0,
        "request_rate": None,
        "concurrency": [1],
    }
    config = {"name": "ngram", "label": "ngram", "server_log": "s.log", "server_start_s": 1.0, "levels": [level]}
    data = {"conditions": conditions, "configs": [config], "speedup_over_none": {}}
    header, row = first_table(render_markdown(data, {}), "# Serving benchmark")
    scalars, table = wandb_scalars(data), dict(zip(TABLE_COLUMNS, table_rows(data)[0]))
    for m in ACCEPTANCE_METRICS:
        assert row[header.index(m.serve_label)] == metric_text(m, m.value(spec)), m
        if not m.per_position:  # serve_bench's W&B holds one number per cell: per-position lists stay out
            assert scalars[f"serve_bench/ngram/c1/{m.name}"] == pytest.approx(m.value(spec)), m
            assert table[m.name] == pytest.approx(m.value(spec)), m
