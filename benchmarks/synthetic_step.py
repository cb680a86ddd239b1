"""The synthetic training step the step benchmarks share: the default drafter at a target's
shapes with random frozen heads, one batch, and the trainer's loss on it (no target or shards)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from dspark.config import DSparkConfig, LossSettings
from dspark.loss import LossOutput, dspark_loss
from dspark.model import DSparkDrafter, resolve_dims, sample_anchors


def add_shape_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The target's shapes (SmolLM2-135M by default) and the batch."""
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--context-layers", type=int, default=5)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--batch", "--micro-batch", type=int, default=2, help="sequences (train.micro_batch_size)")
    p.add_argument("--seq", "--window", type=int, default=512, help="tokens per sequence (train.max_seq_len)")
    p.add_argument("--anchors", type=int, default=16, help="anchors per sequence (train.anchors_per_seq)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--topk", type=int, default=0, help="train.target_topk: the target's top k cached (0: full)")
    p.add_argument(
        "--no-recompute", action="store_true", help="train.recompute_vocab_chunks=false: keep the chunk's logits"
    )
    p.add_argument(
        "--loss", choices=("kl", "tv_ce"), default="kl", help="KL alone (the default since #38) or 0.9 TV + 0.1 CE"
    )


@dataclass
class SyntheticStep:
    model: DSparkDrafter
    batch: dict[str, torch.Tensor]
    loss_cfg: LossSettings

    def to(self, device: torch.device | str, dtype: torch.dtype) -> SyntheticStep:
        floats = ("context_states", "final_states", "topk_probs")
        batch = {k: t.to(device, dtype) if k in floats else t.to(device) for k, t in self.batch.items()}
        return SyntheticStep(self.model.to(device, dtype), batch, self.loss_cfg)

    def loss(self) -> LossOutput:
        """The trainer's forward and loss (:class:`dspark.recipe.DrafterWithLoss`) on the batch."""
        b = self.batch
        out = self.model(b["input_ids"], b["context_states"], b["anchor_positions"])
        return dspark_loss(
            self.model,
            out,
            input_ids=b["input_ids"],
            final_states=b["final_states"],
            anchor_positions=b["anchor_positions"],
            valid_anchors=b["valid_anchors"],
            loss_mask=b["loss_mask"],
            lengths=b["lengths"],
            cfg=self.loss_cfg,
            topk_ids=b.get("topk_ids"),
            topk_probs=b.get("topk_probs"),
        )


def build(args: argparse.Namespace, *, seed: int = 0) -> SyntheticStep:
    """The model (same weights for the same seed) and a batch whose last three quarters are answer."""
    torch.manual_seed(seed)
    h, v = args.hidden, args.vocab
    cfg = DSparkConfig(markov_rank=args.markov_rank)
    dims = resolve_dims(
        cfg,
        target_config={"hidden_size": h, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads},
        vocab_size=v,
        num_context_layers=args.context_layers,
        mask_token_id=0,
    )
    model = DSparkDrafter(
        cfg,
        dims,
        embed_tokens=torch.randn(v, h) * 0.02,
        lm_head=torch.randn(v, h) * 0.02,
        target_norm=torch.ones(h),
        target_norm_eps=1e-6,
    )
    ids = torch.randint(0, v, (args.batch, args.seq))
    mask = torch.zeros(args.batch, args.seq, dtype=torch.bool)
    mask[:, args.seq // 4 :] = True
    lengths = torch.full((args.batch,), args.seq)
    anchors, valid = sample_anchors(mask, lengths, args.anchors, torch.Generator().manual_seed(seed))
    batch = dict(
        input_ids=ids,
        loss_mask=mask,
        lengths=lengths,
        anchor_positions=anchors,
        valid_anchors=valid,
        context_states=torch.randn(args.batch, args.seq - 1, args.context_layers * h),
        final_states=torch.randn(args.batch, args.seq - 1, h),
    )
    if getattr(args, "topk", 0):
        with torch.no_grad():  # what the dataset's cache holds (computed once, not per step)
            top = torch.softmax(model.target_logits(batch["final_states"]), -1).topk(args.topk, -1)
        batch.update(topk_ids=top.indices, topk_probs=top.values)
    old_loss = getattr(args, "loss", "kl") == "tv_ce"  # 0.9 TV + 0.1 CE, the default before issue #38
    lcfg = LossSettings(
        ce_weight=0.1 if old_loss else 0.0,
        tv_weight=0.9 if old_loss else 0.0,
        kl_weight=0.0 if old_loss else 1.0,
        confidence_weight=1.0,
        position_decay=4.0,
        recompute_vocab_chunks=not getattr(args, "no_recompute", False),
    )
    return SyntheticStep(model, batch, lcfg)
