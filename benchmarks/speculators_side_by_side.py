"""Learning side by side with speculators (issue #38, item 3): the same data, sequences, anchors per
sequence, block, steps, optimizer and lr schedule; each arm validated by our validator.

Arms (``--arms``):

- ``ours``: our trainer as the run's config has it (its loss, init, anchors, top-k targets).
- ``speculators``: speculators 0.9.0's ``DSparkDraftModel`` with its own defaults: its init, its
  default loss (``kl_div``), its position weights (exp(-k/4)), its confidence loss, its anchor
  sampling and masks, its reduction; in a minimal loop, because its trainer cannot run on a CPU
  (it takes ``torch.accelerator`` or ``cuda``: docs/speculators_notes.md, "On a CPU"). Its model
  and losses are its own; the loop only feeds it our batches and steps the same AdamW.
- ``speculators-muon``: the same model, init and loss with speculators' Muon option, built by its own
  ``speculators.train.optimizers.build_optimizers`` (``torch.optim.Muon`` over the hidden 2-D matrices,
  AdamW over the rest) with its CLI's defaults (``--optimizer`` defaults to ``muon`` in 0.9.0's schema:
  ``muon_lr`` = ``lr``, momentum 0.95, weight decay 0.1, 5 Newton-Schulz steps, ``match_rms_adamw``);
  one schedule per optimizer, as its trainer keeps.
- ``speculators-matched``: the same, started from our arm's initial weights and with our loss
  weights (the run's ``train.kl_weight``/``tv_weight``/``ce_weight`` as speculators' ``kl_div``/
  ``tv``/``ce``; KL alone by default since issue #38, 0.9 TV + 0.1 CE in the runs recorded before):
  what is left is the implementation (CE against the target's argmax, its reduction and mask
  alignment, its anchors).

Each arm gets the sequences in the same order (the run's seed), ``train.anchors_per_seq`` anchors
per sequence (speculators' ``max_anchors``), the same ``train.lr`` warmup-cosine schedule, AdamW
(0.9, 0.95) with ``train.weight_decay``, gradients clipped at ``train.grad_clip`` (1.0, as
speculators' trainer does). At each ``--validate-at`` step the arm's weights go into
our drafter (the tensor names are shared) and our validator (``Trainer.evaluate``, the run's
validation split, fixed anchors) gives val tau and pos-1 with their 95 % intervals
(:func:`benchmarks.ablation_report.noise`). Seconds are training seconds only.

    .venv/bin/python benchmarks/speculators_side_by_side.py +experiment=smollm2_cpu_demo \\
        --steps 200 --validate-at 25 50 100 200 [--json outputs/benchmarks/side_by_side.json]
    .venv/bin/python benchmarks/speculators_side_by_side.py --summarize RUN.json [RUN.json ...]  # seeds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = ("ours", "speculators", "speculators-muon", "speculators-matched")


def _config(overrides: list[str], tmp: str, steps: int, validate_at: list[int]) -> Any:
    from hydra import compose, initialize_config_dir

    from dspark.config import load_config

    extra = [
        "logging.wandb=false",
        "train.resume=never",
        f"train.max_steps={steps}",
        f"train.eval_every={10 * steps}",
        f"train.eval_at_steps=[{','.join(map(str, validate_at))}]",
        f"train.save_every={10 * steps}",
        f"train.checkpoint_dir={tmp}/ckpt",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return load_config(compose(config_name="config", overrides=[*overrides, *extra]))


def _val(res: dict[str, float]) -> dict[str, float]:
    from benchmarks.ablation_report import noise

    row = {"tau": res["tau"], "pos1": res["accept_pos_1"]}
    spread = noise(res)
    if spread:
        row.update({k: spread[k] for k in ("blocks", "tau_lo", "tau_hi", "pos1_lo", "pos1_hi")})
    return row


def speculators_model(tr: Any, heads: Any, tmp: Path) -> Any:
    """speculators' DSparkDraftModel for the trainer's drafter shape: our drafter's config through
    our own export and conversion (dspark.export, dspark.export.speculators_format), eager attention."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    from dspark.checkpoint_weights import TrainingCheckpoint
    from dspark.export import export
    from dspark.export.speculators_format import write_speculators

    drafter = tr.engine.module.drafter
    weights = {k: v.detach().float().clone() for k, v in drafter.named_parameters() if v.requires_grad}
    ckpt = TrainingCheckpoint(
        tmp / "init" / "step00000000",
        0,
        drafter.cfg,
        drafter.dims,
        weights,
        {"target": {"name": tr.cfg.target.name}, "train": {"dtype": "float32"}},
        0,
        tr.cfg.context_layer_ids(),
    )
    export(ckpt, tmp / "init-export", target_dir=Path(heads.path))
    out = write_speculators(tmp / "init-export", tmp / "init-speculators")
    config = DSparkSpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    model = DSparkDraftModel(config)  # its own init
    model.load_verifier_weights()
    return model, weights


def _speculators_losses(model: Any, batch: Any, mask: torch.Tensor, loss_config: Any, tv_fn: Any, anchors: int) -> list:
    """speculators' own forward and loss on each sequence of one of our batches (it packs one
    sequence stream per call)."""
    out = []
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.lengths[b])
        pad = torch.zeros(1, 1, batch.context_states.shape[-1])  # no state after the last token
        states = torch.cat([batch.context_states[b : b + 1, : n - 1].float(), pad], 1)
        last = torch.cat([batch.final_states[b : b + 1, : n - 1].float(), pad[..., : batch.final_states.shape[-1]]], 1)
        # speculators masks a prediction by its input's position p + k, ours by its label's p + k + 1
        their_mask = torch.zeros(1, n)
        their_mask[0, : n - 1] = mask[b, 1:n].float()
        _, loss, _ = model(
            states,
            batch.input_ids[b : b + 1, :n],
            their_mask,
            last,
            torch.zeros(1, n, dtype=torch.long),
            loss_config=loss_config,
            tv_loss_fn=tv_fn,
            max_anchors=anchors,
        )
        out.append(loss)
    return out


def run_speculators(
    tr: Any, heads: Any, tmp: Path, *, matched: bool, validate_at: list[int], log: Any, muon: bool = False
) -> dict:
    from speculators.losses import resolve_loss_config

    from dspark.data.target_topk import supervised_tokens
    from dspark.recipe import lr_lambda

    t = tr.cfg.train
    model, ours_init = speculators_model(tr, heads, tmp)
    if matched:
        missing, unexpected = model.load_state_dict(ours_init, strict=False)
        assert not unexpected, unexpected
    if matched and t.lk_weight:
        raise SystemExit("speculators-matched: train.lk_weight has no speculators loss to match; set it to 0")
    ours = {"kl_div": t.kl_weight, "tv": t.tv_weight, "ce": t.ce_weight}
    spec = json.dumps({k: w for k, w in ours.items() if w}) if matched else "kl_div"
    loss_config = resolve_loss_config(spec, "eager")
    tv_fn = resolve_loss_config("tv", "eager")["tv"][0]
    params = [p for p in model.parameters() if p.requires_grad]
    if muon:  # speculators' own builder, its CLI's defaults (muon_lr defaults to lr)
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig

        opts = build_optimizers(
            model, TrainerConfig(lr=t.lr, num_epochs=1, save_path=str(tmp), optimizer="muon", muon_lr=t.lr)
        )
    else:
        opts = [torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))]
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_lambda(s, warmup=t.warmup_steps, total=t.max_steps, min_ratio=t.min_lr_ratio)
        )
        for o in opts
    ]
    torch.manual_seed(tr.cfg.seed)  # speculators draws its anchors from torch's global generator
    rows, seconds, steps_done = [], 0.0, 0
    model.train()
    for step in range(1, t.max_steps + 1):
        t0 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=True)
        losses = []
        for batch in (tr.batches.next() for _ in range(t.grad_accum_steps)):
            mask = supervised_tokens(batch.loss_mask, batch.lengths, t.supervise)
            losses += _speculators_losses(model, batch, mask, loss_config, tv_fn, t.anchors_per_seq)
        loss = torch.stack(losses).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"speculators arm: non-finite loss at step {step}")
        loss.backward()
        # speculators' trainer clips at 1.0 (speculators/train/trainer.py: clip_grad_norm_), as ours does
        # (train.grad_clip, through DeepSpeed's gradient_clipping)
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for o, sc in zip(opts, scheds):
            o.step()
            sc.step()
        seconds += time.perf_counter() - t0
        steps_done = step
        if step in validate_at:
            drafter = tr.engine.module.drafter
            with torch.no_grad():
                state = {k: v for k, v in model.state_dict().items() if k in ours_init}
                missing, unexpected = drafter.load_state_dict(state, strict=False)
            row = {"step": step, "train_seconds": seconds, "loss": loss.item(), **_val(tr.evaluate())}
            rows.append(row)
            log(row)
    optimizer = "muon (speculators' build_optimizers)" if muon else "adamw"
    return {"validations": rows, "seconds_per_step": seconds / max(steps_done, 1), "loss": spec, "optimizer": optimizer}


def summarize(paths: list[Path]) -> str:
    """One Markdown table over several runs' JSON (one per seed): per arm and validated step the
    mean val tau and pos-1 over seeds with their standard error, the training seconds per step and
    predictions/s (every arm sees the same batches, so ours' predictions per step hold for all),
    then each arm's difference from ``ours`` at the last step, paired by seed."""
    import statistics

    reports = [json.loads(p.read_text()) for p in paths]

    def mean_se(xs: list[float]) -> str:
        if len(xs) < 2:
            return f"{xs[0]:.3f}" if xs else "-"
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / math.sqrt(len(xs)):.3f}"

    arms = [a for a in ARMS if any(a in r for r in reports)]
    steps = sorted({v["step"] for r in reports for a in arms if a in r for v in r[a]["validations"]})
    per_step = {}  # predictions per step, from ours
    for r in reports:
        if "ours" in r:
            per_step[id(r)] = r["ours"]["predictions_per_s"] * r["ours"]["seconds_per_step"]
    head = " | ".join(f"step {s}" for s in steps)
    lines = [
        f"| arm | seeds | {head} | pos-1, step {steps[-1]} | s / step | predictions/s |",
        "|---|---|" + "---|" * (len(steps) + 3),
    ]
    last: dict[str, dict[int, dict]] = {}
    for arm in arms:
        runs = [r for r in reports if arm in r]
        taus = []
        for s in steps:
            taus.append(mean_se([v["tau"] for r in runs for v in r[arm]["validations"] if v["step"] == s]))
        pos1 = [v["pos1"] for r in runs for v in r[arm]["validations"] if v["step"] == steps[-1]]
        sps = [r[arm]["seconds_per_step"] for r in runs]
        pps = [per_step[id(r)] / r[arm]["seconds_per_step"] for r in runs if id(r) in per_step]
        pps_txt = f"{statistics.mean(pps):.0f}" if pps else "-"
        lines.append(
            f"| {arm} | {len(runs)} | {' | '.join(taus)} | {mean_se(pos1)} | {statistics.mean(sps):.2f} | {pps_txt} |"
        )
        last[arm] = {  # keyed by run: each run's arms share its seed
            i: next(v for v in r[arm]["validations"] if v["step"] == steps[-1])
            for i, r in enumerate(reports)
            if arm in r
        }
    lines.append("")
    for arm in arms[1:]:
        pairs = [k for k in last[arm] if k in last.get("ours", {})]
        for key in ("tau", "pos1"):
            d = [last[arm][k][key] - last["ours"][k][key] for k in pairs]
            lines.append(f"- {arm} - ours, {key} at step {steps[-1]}, paired over {len(d)} seeds: {mean_se(d)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides naming the run, as for train.py")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--validate-at", type=int, nargs="+", default=[25, 50, 100, 200])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--summarize", type=Path, nargs="+", metavar="RUN.json", help="print one table over these runs' --json (seeds)"
    )
    args = p.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    validate_at = sorted(set(args.validate_at) | {args.steps})

    from dspark.recipe import build_trainer
    from dspark.target import prepare_target

    report: dict[str, Any] = {"overrides": args.overrides, "steps": args.steps}
    heads = None
    for arm in args.arms:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(args.overrides, tmp, args.steps, validate_at)
            if heads is None:
                heads, _ = prepare_target(cfg)
            tr = build_trainer(cfg, heads)

            def log(row: dict, arm: str = arm) -> None:
                ci = (
                    f" [{row['tau_lo']:.3f}, {row['tau_hi']:.3f}]"
                    if "tau_lo" in row and not math.isnan(row["tau_lo"])
                    else ""
                )
                print(
                    f"{arm:>20} step {row['step']:>5}: val tau {row['tau']:.3f}{ci}, pos-1 {row['pos1']:.3f}, "
                    f"{row['train_seconds']:.0f} s",
                    flush=True,
                )

            try:
                if arm == "ours":
                    state = tr.train()
                    rows = [
                        {
                            "step": v["step"],
                            "train_seconds": v["train_seconds"],
                            "predictions": v["predictions"],
                            **_val(v),
                        }
                        for v in state.validations
                        if v["step"] in validate_at
                    ]
                    for row in rows:
                        log(row)
                    report[arm] = {
                        "validations": rows,
                        "seconds_per_step": state.train_seconds / max(state.step, 1),
                        "predictions_per_s": state.predictions / max(state.train_seconds, 1e-9),
                    }
                else:
                    report[arm] = run_speculators(
                        tr,
                        heads,
                        Path(tmp),
                        matched=arm.endswith("matched"),
                        validate_at=validate_at,
                        log=log,
                        muon=arm.endswith("muon"),
                    )
            finally:
                tr.close()
        print(f"{arm}: {report[arm]['seconds_per_step']:.2f} s per step", flush=True)
        if args.json:  # after each arm: a run stopped later keeps the arms it finished
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
