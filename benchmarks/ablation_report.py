"""The ablation table and the scaling curve from the runs' own records.

Every training run keeps its validations in ``<checkpoint_dir>/validation.jsonl`` (step,
predictions consumed, training seconds, val tau and per-position acceptance). This reads the
runs named on the command line (checkpoint directories, or a parent holding several), prints a
Markdown table (recipe, steps, training time, predictions per second, val tau, pos-1,
loss) and plots val tau against training predictions and against training time, one line per
run: the scaling curve.

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

from dspark.core.files import read_jsonl


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


def table(found: dict[str, list[dict]]) -> str:
    head = "| run | steps | train min | predictions | pred/s | val tau | val pos-1 | val loss |\n" + "|---" * 8 + "|"
    rows = []
    for name, vals in sorted(found.items(), key=lambda kv: -kv[1][-1]["tau"]):
        v = vals[-1]
        rate = v["predictions"] / v["train_seconds"] if v["train_seconds"] else float("nan")
        rows.append(
            f"| {name} | {v['step']} | {v['train_seconds'] / 60:.1f} | {v['predictions']:,} | {rate:.0f} | "
            f"{v['tau']:.3f} | {v['accept_pos_1']:.3f} | {v['loss']:.3f} |"
        )
    return "\n".join([head, *rows])


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
    args = p.parse_args()
    dirs: dict[str, Path] = {}
    found = runs(args.runs, dirs)
    print(table(found))
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
        args.json.write_text(json.dumps({"runs": found, "fits": fits}, indent=1))


if __name__ == "__main__":
    main()
