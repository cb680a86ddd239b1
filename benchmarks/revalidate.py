"""Re-validate finished lever runs on a bigger held-out set than their own 19 validation sequences.

The levers (``+experiment=smollm2_cpu_levers``) validate on the demo's split: 19 sequences, about 300
drafted blocks, where val tau spreads 0.05 between seeds of one recipe at val losses within 0.05 %
of each other (docs/benchmarks.md, "Training levers"). This tool measures each run's final weights
on prompts none of them trained on, with the trainer's own validation (``Trainer.evaluate``: the
same fixed anchors, loss terms and acceptance), so recipes are ranked on more blocks. Each run's own
validation is recomputed first and must equal its recorded final one (the weights and recipe are the run's):

    python benchmarks/revalidate.py prompts outputs/benchmarks/heldout.jsonl  # bundled prompts after the demo's 256
    python -m data_tools.extract +experiment=smollm2_cpu_demo data.source=$PWD/outputs/benchmarks/heldout.jsonl \\
        data.num_prompts=110 data.val_fraction=0 data.shards_dir=outputs/data/smollm2-135m-heldout
    python benchmarks/revalidate.py runs outputs/checkpoints/levers/smollm2-135m outputs/data/smollm2-135m-heldout \\
        --levers fp32,bf16-equal-steps,muon-lr2e3-bf16-mb4 --out outputs/benchmarks/revalidate.jsonl
    python benchmarks/lever_report.py outputs/checkpoints/levers/smollm2-135m --baseline fp32 \\
        --validations outputs/benchmarks/revalidate.jsonl --alpha 0.025 --noninferior bf16-equal-steps=0.035

A run already in ``--out`` is skipped, so a killed re-validation continues where it stopped. A
held-out sequence that is also in the run's training shards is refused by name.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.lever_report import RUN_NAME  # noqa: E402
from dspark.core.file_reads import read_jsonl  # noqa: E402


def heldout_prompts(out: Path, *, skip: int, count: int) -> int:
    """Writes the bundled source's distinct conversations ``skip + 1`` .. ``skip + count`` (the
    demo trains and validates on the first ``skip``) as OpenAI-style JSON lines; returns how many."""
    from data_tools.prompts import bundled_conversations

    seen: set[str] = set()
    rows = []
    for conv in bundled_conversations():
        if conv.seq_id in seen:
            continue
        seen.add(conv.seq_id)
        if len(seen) > skip:
            rows.append({"messages": [{"role": r, "content": c} for r, c in conv.messages]})
        if len(rows) == count:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def seq_ids(dataset: Path) -> set[str]:
    """Every sequence id in a shard dataset (both splits), read from the Parquet column alone."""
    import pyarrow.parquet as pq

    files = sorted(dataset.glob("*/shard-*.parquet"))
    if not files:
        raise SystemExit(f"error: {dataset}: no */shard-*.parquet; expected a dataset written by data_tools.extract")
    return {i for f in files for i in pq.read_table(f, columns=["seq_id"]).column("seq_id").to_pylist()}


def revalidate(run_dir: Path, shards: Path) -> dict:
    """The final weights of ``run_dir`` validated on every sequence of ``shards``' train split."""
    import torch
    from hydra import compose, initialize_config_dir

    from dspark.checkpoint import load_with_frozen_from_the_target
    from dspark.checkpoint_run import run_differences
    from dspark.checkpoint_tags import resolve_tag
    from dspark.checkpoint_weights import load_training_checkpoint
    from dspark.config import load_config
    from dspark.data.shards import ShardDataset
    from dspark.recipe import build_trainer
    from dspark.target import load_target_heads, resolve_target

    ck = load_training_checkpoint(run_dir)
    m = RUN_NAME.match(run_dir.name)
    with tempfile.TemporaryDirectory(prefix="dspark-revalidate-") as tmp:
        overrides = [
            "+experiment=smollm2_cpu_levers",
            f"+lever={m['lever'].replace('-', '_')}",
            f"seed={m['seed']}",
            f"train.checkpoint_dir={Path(tmp) / 'ckpt'}",  # fresh: nothing resumed, nothing written to the run's
            "logging.wandb=false",
        ]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = load_config(compose(config_name="config", overrides=overrides))
        changed = run_differences(resolve_tag(run_dir), cfg)
        if changed:  # the lever's file or the demo changed since the run: not the recipe it trained with
            raise SystemExit(
                f"error: {run_dir}: today's {' '.join(overrides[:3])} differs from the run: {'; '.join(changed)}"
            )
        heads = load_target_heads(resolve_target(cfg.target).path)
        trainer = build_trainer(cfg, heads)
        try:
            held = ShardDataset(shards, "train", states_dtype=torch.float32, keep_fp8=True)
            both = sorted(seq_ids(Path(cfg.data.shards_dir).expanduser()) & seq_ids(shards))
            if both:
                raise SystemExit(
                    f"error: {shards}: {len(both)} held-out sequences are in {run_dir}'s training data ({both[0]}, ...)"
                )
            load_with_frozen_from_the_target(ck.weights, trainer.engine.module.drafter)
            own = trainer.evaluate()  # the run's own validation again: the weights and recipe are the run's
            recorded = list(read_jsonl(run_dir / "validation.jsonl"))[-1][1]
            if abs(own["tau"] - recorded["tau"]) > 1e-4 or abs(own["loss"] - recorded["loss"]) > 1e-4:
                raise SystemExit(
                    f"error: {run_dir}: its own validation reads tau {own['tau']:.5f}, loss {own['loss']:.5f} "
                    f"here against {recorded['tau']:.5f}, {recorded['loss']:.5f} recorded at step {recorded['step']}"
                )
            res = trainer.evaluate(held)
        finally:
            trainer.close()
    return {"step": ck.step, "sequences": len(held), **res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prompts", help="write the bundled prompts the demo never saw")
    pr.add_argument("out", type=Path)
    pr.add_argument("--skip", type=int, default=256, help="the demo's data.num_prompts")
    pr.add_argument("--count", type=int, default=110)
    ru = sub.add_parser("runs", help="re-validate lever-NAME-seedK runs on held-out shards")
    ru.add_argument("root", type=Path, help="the directory holding lever-NAME-seedK checkpoint directories")
    ru.add_argument("shards", type=Path, help="the held-out shards (their train split)")
    ru.add_argument("--levers", default=None, help="comma-separated lever names (default: all)")
    ru.add_argument("--out", type=Path, required=True, help="JSON lines, one per run; runs already there are skipped")
    args = p.parse_args()
    if args.cmd == "prompts":
        print(f"{heldout_prompts(args.out, skip=args.skip, count=args.count)} prompts -> {args.out}")
        return
    wanted = set(args.levers.split(",")) if args.levers else None
    done = set()
    if args.out.is_file():
        done = {row["run"] for _, row in read_jsonl(args.out)}
    runs = sorted(d for d in args.root.glob("lever-*") if RUN_NAME.match(d.name))
    runs = [d for d in runs if wanted is None or RUN_NAME.match(d.name)["lever"] in wanted]
    if not runs:
        raise SystemExit(
            f"error: no lever-NAME-seedK runs under {args.root}" + (f" for {sorted(wanted)}" if wanted else "")
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for d in runs:
        if d.name in done:
            continue
        if not (d / "latest").is_file():  # still training (a lever run saves its final tag alone)
            print(f"left out: {d.name} (no checkpoint yet)", flush=True)
            continue
        res = revalidate(d, args.shards)
        m = RUN_NAME.match(d.name)
        row = {"run": d.name, "lever": m["lever"], "seed": int(m["seed"]), **res}
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{d.name}: step {row['step']}, {row['sequences']} sequences, {row['blocks']} blocks: "
            f"tau {row['tau']:.3f}, loss {row['loss']:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
