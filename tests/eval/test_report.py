"""The report against hand-computed numbers: the speedup model, the Markdown tables, the JSON
round trip, the PNGs, the CLI and an offline W&B run. Counts come from ``add_step`` so every
figure below is derived, not typed in; the hand values are in the comments."""

import json
import math
import socket
from dataclasses import asdict

import pytest

from eval.acceptance import AcceptanceCounts
from eval.checks import quality_checks, ratio_check
from eval.intervals import STATS, bootstrap_interval
from eval.report import main, summary_lines, write_report
from eval.results import (
    INSIDE_NOISE,
    Calibration,
    Check,
    DrafterResult,
    EvalConditions,
    EvalResults,
    expected_tokens,
    fit_p,
    load_checks,
    load_results,
    speedup_row,
)

GAMMA = 3
BINS = [1024, 4096]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# accepted tokens per verification step, per drafter and context bin; None: a step on which the
# proposer proposed nothing (ngram without a match), a step but not a draft. Each bin's steps are
# two prompts: the first half and the rest.
STEPS = {
    "dspark": {"1024": [3, 3, 2, 1, 0], "4096": [3, 2, 2, 0]},
    "dspark-markov-off": {"1024": [2, 1, 0, 1], "4096": [1, 0, 0]},
    "ngram": {"1024": [1, 0, None, None, 0, 0], "4096": [None, None]},
}


def counts(accepted: list) -> AcceptanceCounts:
    c = AcceptanceCounts(GAMMA)
    for a in accepted:
        c.add_step(0, 0) if a is None else c.add_step(GAMMA, a)
    return c


def prompts_of(steps: list) -> list[list]:
    half = (len(steps) + 1) // 2
    return [steps[:half], steps[half:]]


def per_prompt(name: str) -> list[dict]:
    return [
        {"prompt_id": f"{b}-{i}", "bin": int(b), **asdict(counts(part))}
        for b, s in STEPS[name].items()
        for i, part in enumerate(prompts_of(s))
    ]


def overall(name: str) -> AcceptanceCounts:
    total = AcceptanceCounts(GAMMA)
    for steps in STEPS[name].values():
        total.merge(counts(steps))
    return total


def drafter(name: str, **kw) -> DrafterResult:
    per_bin = {b: {**counts(s).summary(), "num_prompts": 2} for b, s in STEPS[name].items()}
    return DrafterResult(
        name=name,
        runner="reference",
        method=name,
        overall=overall(name).summary(),
        per_bin=per_bin,
        per_prompt=per_prompt(name),
        **kw,
    )


@pytest.fixture
def results() -> EvalResults:
    cond = EvalConditions(
        target="smollm2-135m",
        target_path="/models/smollm2",
        gamma=GAMMA,
        temperature=0.0,
        max_new_tokens=64,
        prompt_source="offline",
        context_bins=BINS,
        prompts_per_bin={"1024": 2, "4096": 2},
        checkpoint="/ckpt/step_100",
    )
    cal = Calibration(
        ece=0.05, bin_edges=[0.0, 0.5, 1.0], bin_confidence=[0.3, 0.8], bin_accuracy=[0.25, 0.85], bin_count=[4, 6]
    )
    cal_gap = Calibration(
        ece=0.2, bin_edges=[0.0, 0.5, 1.0], bin_confidence=[None, 0.7], bin_accuracy=[None, 0.5], bin_count=[0, 5]
    )
    return EvalResults(
        cond,
        [
            drafter("dspark", calibration=cal, draft_cost_ratio=0.25, tokens_per_s=180.0, baseline_tokens_per_s=100.0),
            drafter("dspark-markov-off", calibration=cal_gap, draft_cost_ratio=0.2),
            drafter("ngram", tokens_per_s=120.0, baseline_tokens_per_s=100.0),
        ],
    )


def table(md: str, heading: str, nth: int = 0) -> list[list[str]]:
    """The nth Markdown table under ``## heading``: its header row, then its rows."""
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    tables, current = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    header, _, *rows = tables[nth]
    return [header, *rows]


def table_rows(md: str, heading: str, nth: int = 0) -> dict[str, list[str]]:
    """The nth Markdown table under ``## heading``, keyed by its first cell (header row excluded)."""
    header, *rows = table(md, heading, nth)
    return {"__header__": header, **{r[0]: r for r in rows}}


def test_expected_tokens_and_fit_p_match_hand_values():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)  # (1 - .8^5) / .2
    assert expected_tokens(1.0, 3) == 4.0
    assert fit_p(1.875, 3) == pytest.approx(0.5, abs=1e-12)
    assert fit_p(3.3616, 4) == pytest.approx(0.8, abs=1e-12)
    assert fit_p(1.0, 3) == 0.0 and fit_p(0.7, 3) == 0.0  # clamped at the ends
    assert fit_p(4.0, 3) == 1.0 and fit_p(4.2, 3) == 1.0
    assert math.isnan(fit_p(math.nan, 3))


def test_speedup_row_by_hand():
    row = speedup_row(1.875, 3, 0.25)
    assert row.p == pytest.approx(0.5) and row.tokens_per_step == 1.875 and row.r == 0.25
    assert row.predicted == pytest.approx(1.5)  # 1.875 / 1.25


def test_ratio_check():
    ok = ratio_check("ours over ngram", "dspark tau", 2.4, "ngram tau", 1.6, 1.3)
    assert ok.measured == pytest.approx(1.5) and ok.target == 1.3 and ok.passed and ok.verdict == "PASS"
    assert "dspark tau 2.400 / ngram tau 1.600 = 1.500" in ok.detail
    assert not ratio_check("x", "a", 1.0, "b", 1.0, 1.3).passed
    no_data = ratio_check("x", "a", 2.0, "b", 0.0, 1.0)
    assert math.isnan(no_data.measured) and not no_data.passed


def test_a_check_whose_interval_crosses_its_line_is_inside_the_noise():
    above = ratio_check("g", "a", 1.5, "b", 1.0, 1.3, interval=(1.35, 1.7))
    crossing = ratio_check("g", "a", 1.5, "b", 1.0, 1.3, interval=(1.2, 1.7))
    below = ratio_check("g", "a", 1.1, "b", 1.0, 1.3, interval=(1.0, 1.25))
    missed_but_close = ratio_check("g", "a", 1.2, "b", 1.0, 1.3, interval=(1.0, 1.4))
    assert [c.verdict for c in (above, crossing, below, missed_but_close)] == [
        "PASS",
        INSIDE_NOISE,
        "MISS",
        INSIDE_NOISE,
    ]
    assert crossing.passed and not missed_but_close.passed  # the point estimate's side is kept
    assert "= 1.500 [1.200, 1.700] (need >= 1.3)" in crossing.detail
    assert ratio_check("g", "a", 1.5, "b", 1.0, 1.3, interval=(math.nan, math.nan)).verdict == "PASS"


def test_markdown_tables_carry_the_measured_numbers(results, tmp_path):
    checks = [
        ratio_check("ours over ngram", "dspark", results.drafters[0].tau, "ngram", results.drafters[2].tau, 1.3),
        ratio_check("markov helps", "dspark", results.drafters[0].tau, "off", results.drafters[1].tau, 5.0),
    ]
    md = write_report(results, tmp_path, checks=checks).markdown.read_text()

    conditions = table_rows(md, "Conditions")
    assert conditions["gamma"][1] == "3" and conditions["temperature"][1] == "0"
    assert conditions["context bins"][1] == "1024 (2 prompts), 4096 (2 prompts)"
    assert conditions["checkpoint"][1] == "`/ckpt/step_100`" and conditions["export dir"][1] == "n/a"

    head = ["tokens/step (all steps)", "tau (drafted steps)", "drafted", "pos-1", "steps"]
    figures = table_rows(md, "Tokens per target step", 0)
    assert figures["__header__"] == ["drafter", "runner", *head, "fade @4096/@1024"]
    for name in STEPS:
        d = next(d for d in results.drafters if d.name == name)
        lo, hi = bootstrap_interval(
            [counts(p) for s in STEPS[name].values() for p in prompts_of(s)], STATS["tokens_per_step"]
        )
        assert figures[name][2] == f"{overall(name).tokens_per_step:.3f} [{lo:.3f}, {hi:.3f}]"
        assert lo <= overall(name).tokens_per_step <= hi and (lo, hi) == d.interval("tokens_per_step")
        assert figures[name][3] == f"{overall(name).tau:.3f}"
    # ngram: 8 steps, 4 of them drafted, 1 token accepted: 1 + 1/8 per step, 1 + 1/4 per draft
    assert figures["ngram"][2].startswith("1.125 [") and figures["ngram"][3:5] == ["1.250", "50%"]
    assert figures["ngram"][6] == "8"
    fade = overall_of("dspark", "4096").tokens_per_step / overall_of("dspark", "1024").tokens_per_step
    assert figures["dspark"][7].startswith(f"{fade:.3f} [")
    # dspark drafts every step: 9 steps, 16 accepted, so both figures are 1 + 16/9
    assert figures["dspark"][2].startswith("2.778 [") and figures["dspark"][3:5] == ["2.778", "100%"]
    per_bin = {(r[0], r[1]): r for r in table(md, "Tokens per target step", 1)[1:]}
    assert per_bin[("dspark", "1024")][3].startswith("2.800 [")  # 1 + (3+3+2+1+0)/5, by hand
    assert per_bin[("dspark", "1024")][2] == "2"  # prompts
    # ngram at 4096: two steps without a draft: one token per step, no tau, nothing drafted
    assert per_bin[("ngram", "4096")][3:6] == ["1.000 [1.000, 1.000]", "n/a", "0%"]

    uncond = table_rows(md, "Acceptance per draft position", 0)
    cond = table_rows(md, "Acceptance per draft position", 1)
    assert uncond["__header__"] == ["drafter", "pos 1", "pos 2", "pos 3"]
    assert uncond["dspark"][1:] == [f"{a:.3f}" for a in overall("dspark").accept_per_pos]
    assert uncond["dspark"][1:] == ["0.778", "0.667", "0.333"]  # 7/9, 6/9, 3/9 of 9 drafts
    assert cond["dspark"][1:] == ["0.778", "0.857", "0.500"]  # 7/9, 6/7, 3/6

    speed = table_rows(md, "Speedup")
    dspark_tau = overall("dspark").tokens_per_step
    assert speed["dspark"][1:] == [
        f"{dspark_tau:.3f}",
        f"{fit_p(dspark_tau, GAMMA):.3f}",
        "0.250",
        f"{dspark_tau / 1.25:.2f}",
        "1.80",
    ]
    assert speed["ngram"][1] == "1.125" and speed["ngram"][3:] == ["n/a", "n/a", "1.20"]  # E over every step; no r

    cal = table_rows(md, "Confidence calibration")
    assert cal["dspark"][1:] == ["0.050", "10"] and "ngram" not in cal

    gates = table_rows(md, "Quality checks")
    assert gates["ours over ngram"][3] == "pass" and gates["markov helps"][3] == "**FAIL**"
    assert gates["ours over ngram"][2] == f"{checks[0].measured:.3f}"
    for name in ("acceptance_per_position", "tokens_per_step_per_bin", "calibration"):
        assert f"![{name}]({name}.png)" in md


def test_plots_are_pngs_with_the_expected_names(results, tmp_path):
    paths = write_report(results, tmp_path)
    assert set(paths.plots) == {"acceptance_per_position", "tokens_per_step_per_bin", "calibration"}
    for name, p in paths.plots.items():
        assert p == tmp_path / f"{name}.png"
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_no_calibration_plot_without_a_confidence_head(results, tmp_path):
    for d in results.drafters:
        d.calibration = None
    paths = write_report(results, tmp_path)
    assert "calibration" not in paths.plots and not (tmp_path / "calibration.png").exists()
    md = paths.markdown.read_text()
    assert "## Confidence calibration" not in md and "calibration.png" not in md


def test_json_is_strict_writes_nan_as_null_and_round_trips(results, tmp_path):
    checks = [Check("gate", measured=math.nan, target=1.0, passed=False, detail="no data")]
    paths = write_report(results, tmp_path, checks=checks)

    def no_constants(name: str):
        raise AssertionError(f"non-standard JSON constant {name}")

    data = json.loads(paths.json.read_text(), parse_constant=no_constants)
    ngram = data["drafters"][2]
    assert ngram["per_bin"]["4096"]["tau"] is None and ngram["per_bin"]["4096"]["accept_per_pos"] == [None] * GAMMA
    assert ngram["per_bin"]["4096"]["tokens_per_step"] == 1.0 and ngram["per_bin"]["4096"]["num_steps"] == 2
    assert ngram["tokens_per_step"] == pytest.approx(1.125) and ngram["overall"]["draft_share"] == pytest.approx(0.5)
    lo, hi = ngram["intervals"]["overall"]["tokens_per_step"]
    assert lo <= 1.125 <= hi and ngram["intervals"]["confidence"] == 0.95
    assert data["checks"] == [
        {"name": "gate", "measured": None, "target": 1.0, "passed": False, "detail": "no data", "interval": None}
    ]
    speed = {row["drafter"]: row for row in data["speedup"]}
    assert set(speed) == {"dspark", "dspark-markov-off", "ngram"}
    assert speed["dspark"]["predicted"] == pytest.approx(overall("dspark").tau / 1.25)
    assert speed["dspark"]["measured"] == pytest.approx(1.8) and speed["ngram"]["r"] is None

    loaded = load_results(paths.json)
    assert loaded.conditions == results.conditions
    for got, want in zip(loaded.drafters, results.drafters):
        assert got.name == want.name and got.tau == want.tau and got.calibration == want.calibration
        assert got.per_prompt == want.per_prompt and got.tokens_per_step == want.tokens_per_step
        for b in want.per_bin:
            assert got.per_bin[b]["num_prompts"] == 2
            assert got.per_bin[b]["tau"] == want.per_bin[b]["tau"] or math.isnan(want.per_bin[b]["tau"])
    assert math.isnan(loaded.drafters[2].per_bin["4096"]["tau"])  # null came back as NaN
    (gate,) = load_checks(paths.json)
    assert math.isnan(gate.measured) and gate.detail == "no data"


def test_cli_rerenders_the_same_report(results, tmp_path):
    first = write_report(results, tmp_path / "a", checks=[ratio_check("g", "a", 2.0, "b", 1.0, 1.5)])
    main([str(first.json), "--out", str(tmp_path / "b")])
    assert (tmp_path / "b" / "report.md").read_text() == first.markdown.read_text()
    assert (tmp_path / "b" / "results.json").read_text() == first.json.read_text()
    assert {p.name for p in (tmp_path / "b").glob("*.png")} == {p.name for p in first.plots.values()}


@pytest.fixture
def no_network(monkeypatch):
    """Fail any in-process connection that leaves the machine (the wandb service talks over
    loopback or a Unix socket, which stays allowed)."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"network access to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # even a stray sync would stay local
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_run_gets_scalars_plots_and_tables(results, tmp_path, no_network):
    import wandb

    run = wandb.init(mode="offline", dir=tmp_path, project="dspark-test")
    try:
        write_report(results, tmp_path / "report", wandb_run=run)
        summary = dict(run.summary)  # wandb 0.31 empties run.summary once the run is finished
    finally:
        run.finish()
    assert run.offline
    assert summary["eval/dspark/tau"] == pytest.approx(overall("dspark").tau)
    assert summary["eval/ngram/tokens_per_step"] == pytest.approx(1.125) and summary["eval/ngram/tau"] == 1.25
    assert summary["eval/ngram/draft_share"] == pytest.approx(0.5)
    assert summary["eval/ngram/tokens_per_step_lo"] <= 1.125 <= summary["eval/ngram/tokens_per_step_hi"]
    assert summary["eval/ngram/tokens_per_step_bin_4096"] == 1.0
    assert summary["eval/dspark/tau_bin_1024"] == pytest.approx(2.8)
    assert summary["eval/dspark/accept_pos_1"] == pytest.approx(7 / 9)
    assert summary["eval/dspark/ece"] == pytest.approx(0.05)
    assert summary["eval/dspark/predicted_speedup"] == pytest.approx(overall("dspark").tau / 1.25)
    assert summary["eval/dspark/measured_speedup"] == pytest.approx(1.8)
    assert summary["eval/ngram/measured_speedup"] == pytest.approx(1.2)
    assert "eval/ngram/tau_bin_4096" not in summary  # NaN (no drafts) is not logged
    assert summary["_step"] == 0  # everything went in one log call
    # the offline run file holds the same names, media and tables; teardown stops the wandb
    # service, which is what guarantees the file is flushed (finish alone can return before)
    wandb.teardown()
    record = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    for key in (
        "eval/dspark-markov-off/tau",
        "eval/plots/acceptance_per_position",
        "eval/plots/calibration",
        "eval/speedup_table",
        "eval/tokens_per_step_per_bin_table",
    ):
        assert key.encode() in record, key
    media = [p.suffix for p in (tmp_path / "wandb").glob("offline-run-*/files/media/**/*") if p.is_file()]
    assert media.count(".png") == 3 and media.count(".json") == 2  # the plots and the two tables


def test_preset_goals_are_reported_beside_the_measured_tau_and_pos1(results):
    from dspark.config import EvalConfig

    ours = overall("dspark").summary()  # 9 steps: tau = 1 + 16/9, pos-1 = 7/9
    tau, pos1 = ours["tau"], ours["accept_per_pos"][0]
    assert tau == pytest.approx(1 + 16 / 9) and pos1 == pytest.approx(7 / 9)
    checks = {c.name: c for c in quality_checks(results, EvalConfig(target_tau=2.5, target_pos1=0.8))}
    t, p = checks["tokens per target step on the eval set"], checks["first-position acceptance on the eval set"]
    assert (t.measured, t.target, t.passed) == (pytest.approx(tau), 2.5, True)
    assert (p.measured, p.target, p.passed) == (pytest.approx(pos1), 0.8, False)
    assert t.interval == results.drafters[0].interval("tokens_per_step") and t.interval[0] <= tau <= t.interval[1]
    assert "tokens per target step on the eval set" not in {c.name for c in quality_checks(results, EvalConfig())}


def test_the_ngram_check_compares_tokens_per_step_over_every_step(results):
    results.drafters[2].name = "ngram"
    check = {c.name: c for c in quality_checks(results)}["DSpark over vLLM ngram"]
    # dspark 1 + 16/9 per step; ngram 1 + 1/8 per step (its tau over drafted steps would be 1.25)
    assert check.measured == pytest.approx((1 + 16 / 9) / 1.125)
    assert "tokens/step dspark 2.778 / tokens/step ngram 1.125" in check.detail
    lo, hi = check.interval
    assert lo <= check.measured <= hi and lo < hi  # paired over the four prompts both ran


def overall_of(name: str, b: str) -> AcceptanceCounts:
    return counts(STEPS[name][b])


def test_the_fade_pairs_prompts_where_the_bins_hold_the_same_ones():
    """fade = tokens/step at the longest bin over the shortest's. On a fixed_passage set each prompt
    is measured at every length, so the interval resamples the pairs (each prompt's own difficulty
    cancels); on a set whose bins hold other documents, each bin is resampled apart."""
    easy, hard = [3, 3, 3, 2], [0, 1, 0, 0]  # two prompts of very different difficulty ...
    easy_long, hard_long = [3, 2, 2, 2], [0, 0, 0, 0]  # ... each a little worse at the longer length
    steps = {"1024": [easy, hard, easy, hard], "4096": [easy_long, hard_long, easy_long, hard_long]}

    def result(ids: str) -> DrafterResult:
        recs = [
            {"prompt_id": ids.format(b=b, i=i), "bin": int(b), **asdict(counts(part))}
            for b, parts in steps.items()
            for i, part in enumerate(parts)
        ]
        per_bin = {}
        for b, parts in steps.items():
            total = AcceptanceCounts(GAMMA)
            for part in parts:
                total.merge(counts(part))
            per_bin[b] = {**total.summary(), "num_prompts": len(parts)}
        return DrafterResult("dspark", "reference", "dspark", per_bin["1024"], per_bin, per_prompt=recs)

    paired, apart = result("fixed-s0-b{b}-{i}"), result("offline-s0-b{b}-{i}")
    want = (
        AcceptanceCounts.from_dict(paired.per_bin["4096"]).tokens_per_step
        / AcceptanceCounts.from_dict(paired.per_bin["1024"]).tokens_per_step
    )
    (v1, (lo1, hi1)), (v2, (lo2, hi2)) = paired.fade(), apart.fade()
    assert v1 == v2 == pytest.approx(want) and want < 1
    assert lo1 <= want <= hi1 and lo2 <= want <= hi2
    assert hi1 - lo1 < 0.5 * (hi2 - lo2)  # the pairs cancel the prompts' own difficulty
    cond = EvalConditions("t", "/t", GAMMA, 0.0, 64, "fixed_passage", [1024, 4096], {"1024": 4, "4096": 4})
    line = next(x for x in summary_lines(EvalResults(cond, [paired]), []) if x.startswith("eval"))
    assert line.endswith(f"fade @4096/@1024 {want:.3f} [{lo1:.3f}, {hi1:.3f}]")


def test_summary_lines_put_tokens_per_step_first(results):
    check = ratio_check("g", "a", 1.5, "b", 1.0, 1.3, interval=(1.2, 1.7))
    lines = summary_lines(results, [check])
    ngram = next(line for line in lines if " ngram " in line)
    assert ngram.startswith("eval     ngram") and "tokens/step 1.125 [" in ngram
    assert "(tau 1.250 over drafted steps, 50% drafted; reference)" in ngram
    assert lines[-1] == f"check    g: inside the noise ({check.detail})"


def test_the_report_opens_with_a_summary_and_no_table_cell_holds_a_dict(results, tmp_path):
    """Issue #60 item 2: report.md's conditions table held raw Python dicts (part_seconds,
    greedy_outputs_equal, and about 2,500 characters of llama_cpp_parity in one cell), and it had no
    summary of what was found."""
    results.conditions.extra.update(
        part_seconds={"export": 30.0, "reference": 540.0},
        greedy_outputs_equal={"dspark": {"equal": 3, "prompts": 4, "reference": "vLLM ngram in this run"}},
        llama_cpp_parity={
            "llama.cpp dspark": {
                "per_prompt": [
                    {
                        "prompt_id": "1024-0",
                        "tokens_equal": False,
                        "first_difference": 7,
                        "accepted": [22, 19],
                        "drafts": [30, 30],
                        "steps": [31, 33],
                    }  # fmt: skip
                ]
            }
        },
        fingerprint="abc123",
    )
    md = write_report(results, tmp_path).markdown.read_text()
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Summary"
    summary = md.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    ours, ngram = results.drafters[0], results.drafters[2]
    assert len(summary) == 4  # ours, ngram, their ratio, the fade (this run has no chain)
    assert summary[0].startswith(f"- **Ours** (`dspark`, reference): **{ours.tokens_per_step:.3f}** [")
    assert summary[1].startswith("- **vLLM ngram**") or summary[1].startswith("- **vLLM ngram** (prompt lookup")
    ratio = ours.tokens_per_step / ngram.tokens_per_step
    assert summary[2].startswith(f"- **Ours / ngram**: {ratio:.3f} [")
    assert summary[3].startswith("- **Fade** (ours at 4096 tokens of context over 1024): ")
    for line in md.splitlines():
        if line.startswith("|"):
            assert "{" not in line and "'" not in line, line  # a number or a short string per cell
    conditions = table_rows(md, "Conditions")
    assert conditions["fingerprint"][1] == "abc123" and "part_seconds" not in conditions
    assert table_rows(md, "Where the eval's time went")["reference"][1] == "9.0"
    assert table_rows(md, "Greedy outputs against the reference")["dspark"][1] == "3 of 4"
    assert table_rows(md, "llama.cpp against the reference loop")["llama.cpp dspark"][2] == "no (from token 7)"
