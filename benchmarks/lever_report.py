"""Training levers over seeds: the table issue #57 asks for, and the test that decides a default.

Reads the runs of ``+experiment=smollm2_cpu_levers`` (checkpoint directories named
``lever-NAME-seedK``, each with its ``validation.jsonl``), groups them by lever and gives, per
lever, over its seeds: training minutes, predictions per second, and the final validation's tau and
pos-1 as mean ± sd. Each lever is compared with the baseline arm (``--baseline``) by Welch's
two-sided t-test on the seeds' final val tau (unequal variances, Welch-Satterthwaite degrees of
freedom: with 3 seeds an arm, about 4, so the 95 % critical value is about 2.8, not the normal
1.96). A lever "passes" when its gain is positive and p < 0.05. A lever meant to save time rather
than add tau (``--noninferior LEVER=MARGIN``, the margin declared before its runs) is tested the
other way: it is no worse than the baseline when Welch's one-sided 95 % lower bound on its
difference lies above -MARGIN.

    .venv/bin/python benchmarks/lever_report.py outputs/checkpoints/levers/smollm2-135m \\
        --baseline fp32 --plot docs/img/levers.png [--json outputs/benchmarks/levers.json] \\
        [--side-by-side outputs/benchmarks/sbs-wallclock/*.json]   # speculators' arms beside ours
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

from dspark.core.file_reads import read_jsonl

RUN_NAME = re.compile(r"^lever-(?P<lever>.+)-seed(?P<seed>[0-9]+)$")


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_critical(df: float, p: float = 0.05) -> float:
    """The two-sided ``p`` critical value of Student's t with ``df`` degrees of freedom (bisection)."""
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > p else (lo, mid)
    return (lo + hi) / 2


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's t-test of mean(b) - mean(a): difference, t, Welch-Satterthwaite df, two-sided p."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(b) - statistics.mean(a)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {"diff": diff, "t": math.inf if diff else 0.0, "df": float("nan"), "p": 0.0 if diff else 1.0}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = diff / se
    return {"diff": diff, "se": se, "t": t, "df": df, "p": t_two_sided_p(t, df), "t_crit": t_critical(df)}


def noninferiority(a: list[float], b: list[float], margin: float, alpha: float = 0.05) -> dict:
    """Is mean(b) no worse than mean(a) by more than ``margin``? Welch's one-sided test of
    H0: diff <= -margin at ``alpha``: passes when the one-sided 1 - alpha lower bound exceeds -margin."""
    w = welch(a, b)
    t = (w["diff"] + margin) / w["se"]
    half = t_two_sided_p(t, w["df"]) / 2
    lower = w["diff"] - t_critical(w["df"], 2 * alpha) * w["se"]
    return {**w, "margin": margin, "t_ni": t, "p_ni": half if t > 0 else 1.0 - half, "lower": lower}


def noninferiority_table(
    found: dict[str, dict[int, list[dict]]], baseline: str, margins: dict[str, float], alpha: float = 0.05
) -> str:
    base = [vals[-1]["tau"] for vals in found.get(baseline, {}).values()]
    out = [
        f"| lever | seeds vs `{baseline}`'s | diff | one-sided {100 * (1 - alpha):g} % lower bound | margin | t (df) "
        "| p | no worse |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lever, margin in margins.items():
        if lever not in found:
            raise SystemExit(f"error: --noninferior {lever}={margin}: no runs of lever {lever!r}")
        taus = [vals[-1]["tau"] for vals in found[lever].values()]
        if len(taus) < 2 or len(base) < 2:
            raise SystemExit(f"error: --noninferior {lever}: needs 2 seeds or more in it and in {baseline!r}")
        n = noninferiority(base, taus, margin, alpha)
        out.append(
            f"| `{lever}` | {len(taus)} vs {len(base)} | {n['diff']:+.3f} | {n['lower']:+.3f} | -{margin:.3f} | "
            f"{n['t_ni']:.2f} ({n['df']:.1f}) | {n['p_ni']:.3f} | {'yes' if n['lower'] > -margin else 'no'} |"
        )
    return "\n".join(out)


def lever_runs(root: Path) -> dict[str, dict[int, list[dict]]]:
    """lever -> seed -> its validations, from ``root/lever-NAME-seedK/validation.jsonl``; a run
    that has not reached its lever's last step (still training, or stopped) is left out, named."""
    out: dict[str, dict[int, list[dict]]] = {}
    for f in sorted(root.glob("lever-*/validation.jsonl")):
        m = RUN_NAME.match(f.parent.name)
        if m:
            vals = [v for _, v in read_jsonl(f)]
            if vals:
                out.setdefault(m["lever"], {})[int(m["seed"])] = vals
    if not out:
        raise SystemExit(f"error: no lever-NAME-seedK/validation.jsonl under {root}")
    for lever, seeds in out.items():
        last = max(vals[-1]["step"] for vals in seeds.values())
        for seed in [k for k, vals in seeds.items() if vals[-1]["step"] < last]:
            print(f"left out: lever-{lever}-seed{seed} (at step {seeds[seed][-1]['step']} of {last}, unfinished)")
            del seeds[seed]
    return out


def heldout_runs(path: Path, found: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, list[dict]]]:
    """The runs of ``found`` re-validated by ``benchmarks/revalidate.py`` (its JSON lines): each
    seed's one validation is the held-out one, at the run's own step, predictions and minutes."""
    out: dict[str, dict[int, list[dict]]] = {}
    for _, row in read_jsonl(path):
        own = found.get(row["lever"], {}).get(row["seed"])
        if own is None:
            continue  # a run left out of found (unfinished) is left out here too
        if row["step"] != own[-1]["step"]:
            raise SystemExit(
                f"error: {path}: {row['run']} re-validated at step {row['step']}, its run ended at {own[-1]['step']}"
            )
        out.setdefault(row["lever"], {})[row["seed"]] = [
            {**own[-1], "tau": row["tau"], "accept_pos_1": row["accept_pos_1"]}
        ]
    if not out:
        raise SystemExit(f"error: {path}: no re-validated run of the levers found")
    return out


def side_by_side_runs(paths: list[Path], found: dict[str, dict[int, list[dict]]], baseline: str) -> None:
    """Adds the arms of ``benchmarks/speculators_side_by_side.py --json`` runs (speculators' model,
    its default and its Muon option, at steps that fill the baseline's minutes) to ``found``, seeded
    by each run's ``seed=`` override. Every arm sees the baseline's batches, so its predictions at a
    step are the baseline's at that step (its runs' predictions per step)."""
    base = found.get(baseline)
    if not base:
        raise SystemExit(f"error: --side-by-side needs the baseline arm {baseline!r}'s runs for predictions per step")
    per_step = statistics.mean(vals[-1]["predictions"] / vals[-1]["step"] for vals in base.values())
    for path in paths:
        report = json.loads(path.read_text())
        seeds = [int(o.split("=", 1)[1]) for o in report.get("overrides", []) if o.startswith("seed=")]
        if len(seeds) != 1:
            raise SystemExit(f"error: {path}: overrides {report.get('overrides')}: expected one seed=N")
        for arm, res in report.items():
            if arm in ("overrides", "steps", "ours") or not isinstance(res, dict):
                continue
            vals = [
                {
                    "step": v["step"],
                    "train_seconds": v["train_seconds"],
                    "predictions": v["step"] * per_step,
                    "tau": v["tau"],
                    "accept_pos_1": v["pos1"],
                }
                for v in res["validations"]
            ]
            if vals:
                found.setdefault(arm, {})[seeds[0]] = vals


def summary(found: dict[str, dict[int, list[dict]]], baseline: str) -> list[dict]:
    rows = []
    base = [vals[-1]["tau"] for vals in found.get(baseline, {}).values()]
    for lever, seeds in sorted(found.items(), key=lambda kv: (kv[0] != baseline, kv[0])):
        last = [vals[-1] for vals in seeds.values()]
        taus = [v["tau"] for v in last]
        row = {
            "lever": lever,
            "seeds": sorted(seeds),
            "steps": sorted({v["step"] for v in last}),
            "train_min": [v["train_seconds"] / 60 for v in last],
            "pred_s": [v["predictions"] / v["train_seconds"] for v in last],
            "tau": taus,
            "pos1": [v["accept_pos_1"] for v in last],
        }
        if lever != baseline and len(base) >= 2 and len(taus) >= 2:
            row["test"] = welch(base, taus)
        rows.append(row)
    return rows


def _ms(xs: list[float], fmt: str = ".3f") -> str:
    if len(xs) < 2:
        return f"{xs[0]:{fmt}}" if xs else "-"
    return f"{statistics.mean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"


def table(rows: list[dict], baseline: str, alpha: float = 0.05) -> str:
    out = [
        f"| lever | seeds | steps | train min | predictions/s | val tau (mean ± sd) | val pos-1 | vs `{baseline}`: "
        "diff, t (df), p | passes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r.get("test")
        if t is None:
            vs, passes = "baseline" if r["lever"] == baseline else "-", ""
        else:
            vs = f"{t['diff']:+.3f}, {t['t']:.2f} ({t['df']:.1f}), {t['p']:.3f}"
            passes = "yes" if t["p"] < alpha and t["diff"] > 0 else "no"
        out.append(
            f"| `{r['lever']}` | {len(r['seeds'])} | {'/'.join(map(str, r['steps']))} | {_ms(r['train_min'], '.1f')} | "
            f"{_ms(r['pred_s'], '.0f')} | {_ms(r['tau'])} | {_ms(r['pos1'])} | {vs} | {passes} |"
        )
    return "\n".join(out)


def fit_crossing(
    seeds: dict[int, list[dict]], goal: float, *, min_predictions: float = 2e4, rate: float | None = None
) -> dict:
    """Least squares tau = a + b log10(predictions) over every seed's validations past
    ``min_predictions`` (the first ones sit at tau 1, before the drafter learns anything), and where
    it reaches ``goal``: predictions, and hours at the arm's own predictions per second."""
    pts = [(math.log10(v["predictions"]), v["tau"]) for vals in seeds.values() for v in vals]
    pts = [(x, y) for x, y in pts if 10**x >= min_predictions]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    if rate is None:  # the runs' own: inflated where they shared the cores
        rate = statistics.mean(vals[-1]["predictions"] / vals[-1]["train_seconds"] for vals in seeds.values())
    predictions = 10 ** ((goal - a) / b) if b > 0 else math.inf
    return {"a": a, "b": b, "points": n, "goal": goal, "predictions": predictions, "rate": rate,
            "hours": predictions / rate / 3600}  # fmt: skip


def plot(found: dict[str, dict[int, list[dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (lever, seeds) in enumerate(sorted(found.items())):
        color = f"C{i}"
        for j, vals in enumerate(seeds.values()):
            label = lever if j == 0 else None
            axes[0].plot([v["train_seconds"] / 60 for v in vals], [v["tau"] for v in vals], "-o", ms=3, color=color,
                         alpha=0.8, label=label)  # fmt: skip
            axes[1].plot([v["predictions"] for v in vals], [v["tau"] for v in vals], "-o", ms=3, color=color,
                         alpha=0.8, label=label)  # fmt: skip
    axes[0].set_xlabel("training minutes (steps only)")
    axes[1].set_xlabel("training predictions")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("val tau (greedy, teacher-forced)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("each lever's seeds, validated on the way")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the directory holding lever-NAME-seedK checkpoint directories")
    p.add_argument("--baseline", default="fp32", help="the arm every lever is tested against")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--fit", type=float, default=None, metavar="TAU", help="where each arm's fit reaches TAU")
    p.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="LEVER=PRED_S",
        help="an arm's predictions per second measured alone, for the fit's hours (default: its runs' own)",
    )
    p.add_argument(
        "--side-by-side",
        type=Path,
        nargs="+",
        default=[],
        metavar="RUN.json",
        help="benchmarks/speculators_side_by_side.py --json runs on the same data: their arms join the table",
    )
    p.add_argument(
        "--noninferior",
        action="append",
        default=[],
        metavar="LEVER=MARGIN",
        help="test LEVER for being no worse than the baseline by more than MARGIN val tau (declare it first)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.05, help="the tests' level (two-sided; one-sided for --noninferior)"
    )
    p.add_argument(
        "--validations",
        type=Path,
        default=None,
        metavar="REVALIDATE.jsonl",
        help="benchmarks/revalidate.py's held-out validations in place of each run's own final one",
    )
    args = p.parse_args()
    found = lever_runs(args.root)
    side_by_side_runs(args.side_by_side, found, args.baseline)
    if args.validations:  # the levers' own runs only: speculators' arms were not re-validated
        found = heldout_runs(args.validations, found)
    rows = summary(found, args.baseline)
    print(table(rows, args.baseline, args.alpha))
    if args.noninferior:
        margins = {k: float(v) for k, v in (r.split("=") for r in args.noninferior)}
        print("\n" + noninferiority_table(found, args.baseline, margins, args.alpha))
    if args.fit is not None and not args.validations:
        print(f"\n| lever | fit: tau = a + b log10(predictions) | points | reaches {args.fit} at | hours at its rate |")
        print("|---|---|---|---|---|")
        rates = {k: float(v) for k, v in (r.split("=") for r in args.rate)}
        for lever, seeds in sorted(found.items()):
            f = fit_crossing(seeds, args.fit, rate=rates.get(lever))
            print(f"| `{lever}` | {f['a']:.3f} + {f['b']:.3f} log10(p) | {f['points']} | {f['predictions']:.2e} "
                  f"| {f['hours']:.3g} h at {f['rate']:.0f}/s |")  # fmt: skip
    if args.plot and not args.validations:
        plot(found, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
