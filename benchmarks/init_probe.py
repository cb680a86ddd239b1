"""Validation at step 0: what a drafter initialised from the target's layers knows before training.

For each choice of target layers (``train.init_from_target_layers``; "random" for today's init)
builds the run's drafter, trains nothing and validates it on the run's validation split.

    .venv/bin/python benchmarks/init_probe.py +experiment=smollm2_cpu_ablate \\
        --choices random 25,26,27,28,29 5,11,17,23,29 0,1,2,3,4 [--json outputs/benchmarks/init_probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides naming the run, as for train.py")
    p.add_argument("--choices", nargs="+", default=["random", "25,26,27,28,29"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from hydra import compose, initialize_config_dir

    from dspark.config import load_config
    from dspark.recipe import build_trainer
    from dspark.target import prepare_target

    report = {}
    heads = None
    for choice in args.choices:
        extra = ["logging.wandb=false", "train.resume=never"]
        if choice != "random":
            extra += [f"train.init_from_target_layers=[{choice}]"]
        extra += ["drafter.intermediate_size=1536", "drafter.rope_theta=100000.0"]  # the same shape for every choice
        with (
            tempfile.TemporaryDirectory() as tmp,
            initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"),
        ):
            cfg = load_config(
                compose(config_name="config", overrides=[*args.overrides, *extra, f"train.checkpoint_dir={tmp}"])
            )
            if heads is None:
                heads, _ = prepare_target(cfg)
            tr = build_trainer(cfg, heads)
            res = tr.evaluate()
            tr.close()
        report[choice] = {k: res[k] for k in ("tau", "accept_pos_1", "loss", "ce", "tv")}
        print(
            f"{choice:>16}: val tau {res['tau']:.3f}, pos-1 {res['accept_pos_1']:.3f}, "
            f"CE {res['ce']:.2f}, TV {res['tv']:.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
