"""The eval set's tokens per target step for finished lever runs, over seeds (issue #57, item 1).

Val tau ranks recipes on short on-policy sequences; the demo's eval set (8 AA-LCR-style prompts,
1k-7k tokens) is what the README's table reports. This tool runs the reference loop's ``dspark``
row (``python -m eval.run``, nothing else: no plain decoding, vLLM or llama.cpp rows) on each
``lever-NAME-seedK`` run's final checkpoint, composed exactly as the run trained
(``+experiment=smollm2_cpu_levers +lever=NAME seed=K``), and tests the arms over seeds:

    python benchmarks/eval_candidates.py runs outputs/checkpoints/levers/smollm2-135m \\
        --levers fp32,muon-lr2e3-bf16-mb4 --seeds 0,1,2 --out outputs/benchmarks/eval-candidates
    python benchmarks/eval_candidates.py report outputs/benchmarks/eval-candidates --baseline fp32

A run whose ``results.json`` is already under ``--out`` is skipped (a killed sweep continues).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.lever_report import RUN_NAME, welch  # noqa: E402


def eval_command(run_dir: Path, out: Path) -> list[str]:
    """``eval.run`` on one lever run's final checkpoint: its own config, the reference loop's ``dspark`` row."""
    m = RUN_NAME.match(run_dir.name)
    if m is None:
        raise SystemExit(f"error: {run_dir}: expected a directory named lever-NAME-seedK")
    return [
        sys.executable,
        "-m",
        "eval.run",
        "+experiment=smollm2_cpu_levers",
        f"+lever={m['lever'].replace('-', '_')}",
        f"seed={m['seed']}",
        f"export.checkpoint={run_dir}",
        f"export.out_dir={out / 'exports' / run_dir.name}",  # apart: eval.out_dir must be its own
        f"eval.out_dir={out / run_dir.name}",
        "eval.reference_proposers=[dspark]",
        "eval.baselines=[]",
        "eval.llama_cpp=never",
        "eval.measure_plain=false",
        "logging.wandb=false",
        f"hydra.run.dir={out / 'hydra' / run_dir.name}",
    ]


def read_results(out: Path) -> dict[str, dict[int, dict]]:
    """{lever: {seed: the dspark row's overall counts and its per-prompt tokens per step}} under ``out``."""
    found: dict[str, dict[int, dict]] = {}
    for res in sorted(out.glob("lever-*/results.json")):
        m = RUN_NAME.match(res.parent.name)
        if m is None:
            continue
        rows = {d["name"]: d for d in json.loads(res.read_text())["drafters"]}
        if "dspark" not in rows:
            raise SystemExit(f"error: {res}: no 'dspark' row in drafters (found {sorted(rows)})")
        d = rows["dspark"]
        found.setdefault(m["lever"], {})[int(m["seed"])] = {
            "tokens_per_step": d["overall"]["tokens_per_step"],
            "per_prompt": {str(p["prompt_id"]): 1 + p["num_accepted"] / p["num_steps"] for p in d["per_prompt"]},
        }
    return found


def report(found: dict[str, dict[int, dict]], baseline: str) -> str:
    """A table: each arm's tokens per target step over seeds, Welch's t against ``baseline``."""
    if baseline not in found:
        raise SystemExit(f"error: --baseline {baseline}: no results for it (found {sorted(found)})")
    prompts = {frozenset(r["per_prompt"]) for seeds in found.values() for r in seeds.values()}
    if len(prompts) != 1:
        raise SystemExit("error: the runs were evaluated on different prompts; evaluate every run on the same set")
    base = [r["tokens_per_step"] for r in found[baseline].values()]
    out = [
        f"| arm | seeds | eval tokens/step (mean ± sd) | per seed | vs `{baseline}`: diff, t (df), p |",
        "|---|---|---|---|---|",
    ]
    for lever in [baseline, *sorted(k for k in found if k != baseline)]:
        tps = [found[lever][s]["tokens_per_step"] for s in sorted(found[lever])]
        sd = f" ± {statistics.stdev(tps):.3f}" if len(tps) > 1 else ""
        if lever == baseline:
            test = "baseline"
        elif len(tps) < 2 or len(base) < 2:
            test = "- (needs 2 seeds an arm)"
        else:
            w = welch(base, tps)
            test = f"{w['diff']:+.3f}, {w['t']:.2f} ({w['df']:.1f}), {w['p']:.3f}"
        per = " / ".join(f"{t:.3f}" for t in tps)
        out.append(f"| `{lever}` | {len(tps)} | {statistics.mean(tps):.3f}{sd} | {per} | {test} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ru = sub.add_parser("runs", help="evaluate lever-NAME-seedK runs (the reference loop's dspark row)")
    ru.add_argument("root", type=Path, help="the directory holding lever-NAME-seedK checkpoint directories")
    ru.add_argument("--levers", required=True, help="comma-separated lever names")
    ru.add_argument("--seeds", required=True, help="comma-separated seeds")
    ru.add_argument("--out", type=Path, required=True)
    re_ = sub.add_parser("report", help="the table over seeds")
    re_.add_argument("out", type=Path)
    re_.add_argument("--baseline", required=True)
    args = p.parse_args()
    if args.cmd == "report":
        print(report(read_results(args.out), args.baseline))
        return
    for lever in args.levers.split(","):
        for seed in args.seeds.split(","):
            run_dir = args.root / f"lever-{lever}-seed{seed}"
            if not (run_dir / "latest").is_file():
                raise SystemExit(f"error: {run_dir}: no finished checkpoint (no 'latest' file)")
            if (args.out / run_dir.name / "results.json").is_file():
                print(f"{run_dir.name}: done, skipped", flush=True)
                continue
            cmd = eval_command(run_dir, args.out.resolve())
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"error: {run_dir.name}: eval.run exited {r.returncode}:\n{r.stderr[-3000:]}")
            tps = read_results(args.out)[lever][int(seed)]["tokens_per_step"]
            print(f"{run_dir.name}: tokens/step {tps:.3f}", flush=True)


if __name__ == "__main__":
    main()
