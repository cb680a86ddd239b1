"""The reference loop's draft pass (``eval.reference.DraftRunner.propose``) against another tree's,
in one process on the same drafter, context and anchors, interleaved: whether they draft the same
tokens and confidences, and the median ms of each (issue #60).

    git worktree add /tmp/old <rev>
    .venv/bin/python benchmarks/draft_step_ab.py --old-tree /tmp/old [--context 1024] [--repeats 20]

The drafter is the demo's (``+experiment=smollm2_cpu_demo``) with random weights and a nonzero
Markov head (a trained head's bias is not zero; costs do not depend on the values); fp32, greedy.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-tree", type=Path, required=True, help="a checkout whose eval/reference.py is compared")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    import eval.reference as new
    from dspark.config import load_config
    from dspark.recipe import build_drafter
    from dspark.target import prepare_target

    spec = importlib.util.spec_from_file_location("old_reference", args.old_tree / "eval" / "reference.py")
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_reference"] = old
    spec.loader.exec_module(old)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=["+experiment=smollm2_cpu_demo"]))
    heads, _ = prepare_target(cfg)
    drafter, _, _ = build_drafter(cfg, heads)
    drafter.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in drafter.markov_head.parameters():
            p.normal_(0, 0.02)
    width = len(cfg.context_layer_ids()) * int(heads.config["hidden_size"])
    states = torch.randn(args.context, width)
    runners = {}
    for name, mod in (("old", old), ("new", new)):
        r = mod.DraftRunner(drafter)
        r.reset()
        with torch.no_grad():
            r.extend(states)
        runners[name] = r
    gen = torch.Generator().manual_seed(0)
    same = all(
        runners["old"].propose(a, cfg.eval.gamma, 0.0, gen)[::2]
        == runners["new"].propose(a, cfg.eval.gamma, 0.0, gen)[::2]
        for a in (11, 500, 7000)
    )
    ms: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(args.repeats + 2):
        for name in ("old", "new") if i % 2 else ("new", "old"):
            t0 = time.perf_counter()
            runners[name].propose(11, cfg.eval.gamma, 0.0, gen)
            if i >= 2:  # warm-up
                ms[name].append(1e3 * (time.perf_counter() - t0))
    o, n = statistics.median(ms["old"]), statistics.median(ms["new"])
    print("| tree | draft pass, median ms | same tokens and confidences |")
    print("|---|---|---|")
    print(f"| old ({args.old_tree}) | {o:.1f} | |")
    print(f"| new ({REPO}) | {n:.1f} ({o / n:.2f}x faster) | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
