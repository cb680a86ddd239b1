"""The ablation table and the scaling curve from the runs' own records.

Every training run keeps its validations in ``<checkpoint_dir>/validation.jsonl`` (step,
predictions consumed, training seconds, val tau and per-position acceptance). This reads the
runs named on the command line (checkpoint directories, or a parent holding several), prints a
Markdown table (recipe, steps, training time, predictions per second, val tau, pos-1,
loss) and plots val tau against training predictions and against training time, one line per
run: the scaling curve.

Each val tau and pos-1 carries its 95 % interval over the validation's ``blocks`` (drafted
blocks, one per anchor, as the trainer records them). With a_k = P(accepted length >= k), the
shares the validation records as ``accept_pos_k``, the accepted length L of a block has
E[L] = sum_k a_k and E[L^2] = sum_k (2k - 1) a_k, so tau = 1 + E[L] has the standard error
sqrt(Var(L) / blocks) and the interval tau +- 1.96 SE; pos-1 (a share) has the binomial one,
a_1 +- 1.96 sqrt(a_1 (1 - a_1) / blocks). The blocks of one sequence are correlated (several
anchors share its context), so this treats them as more independent draws than they are: it
is a lower bound on the noise, and the seed-to-seed spread that ``--paired`` gives is the
fuller measure. A run whose interval overlaps the best run's is marked "inside the noise" of
the best: the table cannot rank the two. Validations recorded before the trainer counted the
blocks show "n/a".

    .venv/bin/python benchmarks/ablation_report.py outputs/checkpoints/smollm2-135m/ablate-* \\
        --plot docs/img/ablation.png [--json outputs/benchmarks/ablation.json]

``--paired A=B`` compares two arms run over the same seeds (an A/B that must be judged against
the run-to-run noise, e.g. fp8 against fp16 shards): each run whose name holds A is paired with
the run named with B in its place, and the table gives each pair's val tau and loss difference,
their mean with its standard error, and the seed-to-seed spread of each arm. Whether the twins
read the same data in the same order is checked from the checkpoints' data digests.

    .venv/bin/python benchmarks/ablation_report.py outputs/checkpoints/smollm2-135m/fp8-* \\
        --paired float16=float8_e4m3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from dspark.core.file_reads import read_jsonl

Z95 = 1.96  # two-sided 95 % quantile of the normal distribution


def runs(paths: list[Path], dirs: dict[str, Path] | None = None) -> dict[str, list[dict]]:
    """Run name -> its validations; ``dirs`` (if given) gets run name -> checkpoint directory."""
    found: dict[str, list[dict]] = {}
    for p in paths:
        for f in (
            [p / "validation.jsonl"] if (p / "validation.jsonl").is_file() else sorted(p.glob("*/validation.jsonl"))
        ):
            found[f.parent.name] = [v for _, v in read_jsonl(f)]
            if dirs is not None:
                dirs[f.parent.name] = f.parent
    if not found:
        raise SystemExit(f"error: no validation.jsonl under {[str(p) for p in paths]}")
    return found


def noise(v: dict) -> dict | None:
    """The 95 % intervals of one validation's tau and pos-1 over its ``blocks`` (module
    docstring); None when the record has no block count. Keys: blocks, tau_se, tau_lo, tau_hi,
    pos1_se, pos1_lo, pos1_hi."""
    n = v.get("blocks")
    if not n:
        return None
    a: list[float] = []  # a_k = accept_pos_k, k = 1 .. block size
    while f"accept_pos_{len(a) + 1}" in v:
        a.append(v[f"accept_pos_{len(a) + 1}"])
    mean = sum(a)
    second = sum((2 * k - 1) * ak for k, ak in enumerate(a, start=1))
    tau_se = math.sqrt(max(second - mean**2, 0.0) / n)  # max: rounding may leave -1e-17
    pos1_se = math.sqrt(max(a[0] * (1.0 - a[0]), 0.0) / n)
    return {
        "blocks": n,
        "tau_se": tau_se,
        "tau_lo": v["tau"] - Z95 * tau_se,
        "tau_hi": v["tau"] + Z95 * tau_se,
        "pos1_se": pos1_se,
        "pos1_lo": a[0] - Z95 * pos1_se,
        "pos1_hi": a[0] + Z95 * pos1_se,
    }


def ranking(found: dict[str, list[dict]]) -> list[tuple[str, dict | None, str]]:
    """(run, its final validation's :func:`noise`, its standing) from the highest val tau down.
    Standing: "best" for the first, "inside the noise" where a run's tau interval overlaps the
    best's, "n/a" where either has no interval, "" otherwise."""
    order = sorted(found, key=lambda name: -found[name][-1]["tau"])
    ivs = {name: noise(found[name][-1]) for name in order}
    best = ivs[order[0]]
    out = []
    for i, name in enumerate(order):
        iv = ivs[name]
        if i == 0:
            standing = "best"
        elif iv is None or best is None:
            standing = "n/a"
        else:
            standing = "inside the noise" if iv["tau_lo"] <= best["tau_hi"] and best["tau_lo"] <= iv["tau_hi"] else ""
        out.append((name, iv, standing))
    return out


def table(found: dict[str, list[dict]]) -> str:
    head = (
        "| run | steps | train min | predictions | pred/s | val tau (95 %) | val pos-1 (95 %) | val loss | blocks "
        "| vs best |\n" + "|---" * 10 + "|"
    )
    rows = []
    ranked = ranking(found)
    for name, iv, standing in ranked:
        v = found[name][-1]
        rate = v["predictions"] / v["train_seconds"] if v["train_seconds"] else float("nan")
        tau_pm, pos1_pm = (f"{Z95 * iv['tau_se']:.3f}", f"{Z95 * iv['pos1_se']:.3f}") if iv else ("n/a", "n/a")
        rows.append(
            f"| {name} | {v['step']} | {v['train_seconds'] / 60:.1f} | {v['predictions']:,} | {rate:.0f} | "
            f"{v['tau']:.3f} ± {tau_pm} | {v['accept_pos_1']:.3f} ± {pos1_pm} | {v['loss']:.3f} | "
            f"{iv['blocks'] if iv else 'n/a'} | {standing} |"
        )
    best, best_iv, _ = ranked[0]
    note = (
        "\n\n± is 1.96 standard errors over the validation blocks, a lower bound on the noise (the blocks of "
        "one sequence are correlated; the seed-to-seed spread of --paired is the fuller measure). "
    )
    if best_iv is None:
        note += f"The best run, {best}, has no block count in its validation: no run can be placed inside its noise."
    else:
        inside = [name for name, _, standing in ranked if standing == "inside the noise"]
        note += (
            f"Inside the noise of the best run, {best} (val tau intervals overlap its own): {', '.join(inside)}."
            if inside
            else f"No run's val tau interval overlaps the best run's ({best})."
        )
        unknown = [name for name, _, standing in ranked if standing == "n/a"]
        if unknown:
            note += f" No block count, not compared: {', '.join(unknown)}."
    return "\n".join([head, *rows]) + note


def by_step(found: dict[str, list[dict]]) -> str:
    """Val tau / pos-1 of every run at every validated step, each with its 95 % half-width
    (:func:`noise`): runs of one budget compared step for step (their schedules are the same), as
    the final-step table cannot when one run stopped early."""
    steps = sorted({v["step"] for vals in found.values() for v in vals})
    lines = [
        "| run | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for name, vals in found.items():
        at = {v["step"]: v for v in vals}
        cells = []
        for s in steps:
            v, iv = at.get(s), noise(at[s]) if s in at else None
            if v is None:
                cells.append("")
            elif iv is None:
                cells.append(f"{v['tau']:.3f} / {v['accept_pos_1']:.3f}")
            else:
                tau_pm, pos1_pm = Z95 * iv["tau_se"], Z95 * iv["pos1_se"]
                cells.append(f"{v['tau']:.3f} ± {tau_pm:.3f} / {v['accept_pos_1']:.3f} ± {pos1_pm:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit(vals: list[dict], goal: float) -> dict:
    """Least-squares tau = a + b log10(predictions) over a run's validations, and where that
    line reaches ``goal``: predictions, and training hours at the run's own predictions/s."""
    xs = [math.log10(v["predictions"]) for v in vals]
    ys = [v["tau"] for v in vals]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    rate = vals[-1]["predictions"] / vals[-1]["train_seconds"]
    need = 10 ** ((goal - a) / b) if b > 0 else math.inf
    return {"a": a, "b": b, "points": n, "goal": goal, "predictions": need, "hours": need / rate / 3600}


def data_digest(run_dir: Path) -> str:
    """The data-order digest of a run's newest checkpoint (DeepSpeed's client state, read
    memory-mapped: the weights beside it are not loaded)."""
    import torch

    latest = (run_dir / "latest").read_text().strip() if (run_dir / "latest").is_file() else None
    if latest is None:
        return ""
    states = run_dir / latest / "mp_rank_00_model_states.pt"
    return str(torch.load(states, map_location="cpu", mmap=True, weights_only=False).get("data_digest", ""))


def paired(found: dict[str, list[dict]], dirs: dict[str, Path], a: str, b: str) -> str:
    """Markdown: B - A per pair of twins (same name but A -> B), their mean and standard error,
    and each arm's seed-to-seed standard deviation."""
    pairs = sorted((name, name.replace(a, b)) for name in found if a in name and name.replace(a, b) in found)
    if not pairs:
        raise SystemExit(f"error: no run holding {a!r} has a twin holding {b!r} among {sorted(found)}")
    head = (
        f"| pair | {a} val tau | {b} val tau | tau diff ({b} - {a}) | diff % | {a} val loss | {b} val loss "
        "| loss diff | same data order |\n" + "|---" * 9 + "|"
    )
    rows, dtau, dpct, dloss = [], [], [], []
    for x, y in pairs:
        vx, vy = found[x][-1], found[y][-1]
        same = data_digest(dirs[x]) == data_digest(dirs[y]) != ""
        dtau.append(vy["tau"] - vx["tau"])
        dpct.append(100 * dtau[-1] / vx["tau"])
        dloss.append(vy["loss"] - vx["loss"])
        rows.append(
            f"| {x} | {vx['tau']:.4f} | {vy['tau']:.4f} | {dtau[-1]:+.4f} | {dpct[-1]:+.2f} | {vx['loss']:.5f} | "
            f"{vy['loss']:.5f} | {dloss[-1]:+.5f} | {'yes' if same else 'NO'} |"
        )

    def mean_sd(xs: list[float]) -> tuple[float, float]:
        return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan")

    n = len(pairs)
    (mt, st), (mp, sp), (ml, sl) = mean_sd(dtau), mean_sd(dpct), mean_sd(dloss)
    sa, sb = mean_sd([found[x][-1]["tau"] for x, _ in pairs])[1], mean_sd([found[y][-1]["tau"] for _, y in pairs])[1]
    rows.append(
        f"| mean of {n} pairs (standard error) | | | {mt:+.4f} ({st / n**0.5:.4f}) | {mp:+.2f} ({sp / n**0.5:.2f}) "
        f"| | | {ml:+.5f} ({sl / n**0.5:.5f}) | |"
    )
    rows.append(f"| seed-to-seed sd of val tau | {sa:.4f} | {sb:.4f} | | | | | | |")
    return "\n".join([head, *rows])


def plot(found: dict[str, list[dict]], out: Path, fits: dict[str, dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, vals in sorted(found.items()):
        for ax, key in ((axes[0], "tau"), (axes[1], "accept_pos_1")):
            ax.plot([v["predictions"] for v in vals], [v[key] for v in vals], marker="o", label=name)
    for name, f in (fits or {}).items():
        lo = found[name][0]["predictions"]
        xs = [lo * (f["predictions"] / lo) ** (i / 20) for i in range(21)]
        axes[0].plot(xs, [f["a"] + f["b"] * math.log10(x) for x in xs], "--", color="gray", lw=1, label=f"{name} fit")
        axes[0].axhline(f["goal"], color="gray", lw=0.8, ls=":")
        axes[0].annotate(
            f"fit reaches {f['goal']:.2f} at {f['predictions']:.1e} predictions",
            (xs[-1], f["goal"]),
            fontsize=7,
            ha="right",
            va="bottom",
        )
    axes[0].set_ylabel("val tau (greedy, teacher-forced)")
    axes[1].set_ylabel("val acceptance at position 1")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("training predictions")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="checkpoint dirs (or their parent)")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--fit",
        action="append",
        default=[],
        metavar="RUN=TAU",
        help="fit tau against log10(predictions) for RUN and say where it reaches TAU",
    )
    p.add_argument("--paired", default=None, metavar="A=B", help="B against A over twin runs (names differ in A/B)")
    p.add_argument("--by-step", action="store_true", help="also val tau / pos-1 of every run at every validated step")
    args = p.parse_args()
    dirs: dict[str, Path] = {}
    found = runs(args.runs, dirs)
    print(table(found))
    if args.by_step:
        print("\nVal tau / pos-1 (± 95 %) at each validated step:\n\n" + by_step(found))
    if args.paired:
        a, b = args.paired.split("=")
        print("\n" + paired(found, dirs, a, b))
    fits = {}
    for spec in args.fit:
        name, goal = spec.split("=")
        fits[name] = fit(found[name], float(goal))
        f = fits[name]
        print(
            f"{name}: tau = {f['a']:.3f} + {f['b']:.3f} log10(predictions) over {f['points']} validations; "
            f"reaches {f['goal']} at {f['predictions']:.2e} predictions, {f['hours']:.3g} h at its predictions/s"
        )
    if args.plot:
        plot(found, args.plot, fits)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        intervals = {name: {**(iv or {}), "standing": standing} for name, iv, standing in ranking(found)}
        args.json.write_text(json.dumps({"runs": found, "intervals": intervals, "fits": fits}, indent=1))


if __name__ == "__main__":
    main()
