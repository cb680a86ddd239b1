"""The DSpark training loss, a pure function of the drafter output and the target states.

For each anchor's k-th prediction (k = 1..gamma) with weight w_k = exp(-(k-1)/decay) on valid
positions (answer-token label inside the sequence):

    p_t = softmax(lm_head(final_norm(s_{a+k-1})))      target distribution (frozen pieces)
    p_d = softmax(lm_head(h_k) + W2 W1[x_{a+k-1}])      draft distribution
    CE  = -log p_d(x_{a+k})
    TV  = 1/2 ||p_d - p_t||_1
    BCE = bce(confidence_logit_k, 1 - TV)              (target detached)
    loss = sum_k w_k (ce_weight*CE + tv_weight*TV + confidence_weight*BCE) / sum_k w_k

Vocabulary-sized logits exist only for ``chunk_rows`` positions at a time, and each chunk is
recomputed in backward (activation checkpointing), so thousands of positions never hold
[rows, V] tensors at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dspark.model import DraftOutput, DSparkDrafter


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The loss terms' weights (their defaults live in ``train.*``, :class:`TrainConfig`) and how
    the vocabulary-wide terms are computed."""

    ce_weight: float
    tv_weight: float
    confidence_weight: float
    position_decay: float
    chunk_rows: int = 1024
    # Recompute each chunk's logits in backward. ZeRO-3 turns it off: its parameters are
    # re-partitioned between forward and recompute, which torch's checkpoint rejects.
    recompute_chunks: bool = True


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # scalar, detached (weighted mean)
    tv: torch.Tensor
    confidence_bce: torch.Tensor
    accept_per_position: torch.Tensor  # [K] P(first k drafts all match): acceptance as vLLM counts it
    accept_cond_per_position: torch.Tensor  # [K] greedy match rate at each position given a correct prefix (teacher-forced)
    accept_prob_per_position: torch.Tensor  # [K] mean 1 - TV = expected acceptance under sampling
    confidence: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [P] predicted acceptance of valid positions
    confidence_target: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [P] 1 - TV
    num_positions: int = 0

    @property
    def tau(self) -> float:
        """Expected accepted length per draft step incl. the bonus token (greedy, teacher-forced)."""
        return 1.0 + float(self.accept_per_position.sum())


def _chunk_terms(model: DSparkDrafter, hidden, markov, target_final, labels):  # noqa: ANN001 - internal
    """Per-row CE, TV, greedy match. hidden [P, H], markov [P, R] or None, target_final [P, Ht], labels [P]."""
    logp_d = F.log_softmax(model.draft_logits(hidden, markov), dim=-1)
    with torch.no_grad():
        logits_t = model.target_logits(target_final)
    p_t = torch.softmax(logits_t, dim=-1)
    ce = -logp_d.gather(-1, labels[:, None]).squeeze(-1)
    tv = 0.5 * (logp_d.exp() - p_t).abs().sum(-1)
    match = (logp_d.argmax(-1) == logits_t.argmax(-1)).float()
    return ce, tv, match


def dspark_loss(
    model: DSparkDrafter,
    out: DraftOutput,
    *,
    input_ids: torch.Tensor,  # [B, T]
    final_states: torch.Tensor,  # [B, S, Ht] target final pre-norm states, S = T-1
    anchor_positions: torch.Tensor,  # [B, A]
    valid_anchors: torch.Tensor,  # [B, A] bool
    loss_mask: torch.Tensor,  # [B, T] bool, answer tokens
    lengths: torch.Tensor,  # [B]
    cfg: LossConfig,
) -> LossOutput:
    b, a, k, _ = out.hidden.shape
    steps = torch.arange(k, device=input_ids.device)
    label_pos = anchor_positions[:, :, None] + steps + 1  # [B, A, K]: x_{a+k}
    in_seq = label_pos < lengths[:, None, None]
    label_pos_c = label_pos.clamp(max=input_ids.shape[1] - 1)
    labels = input_ids.gather(1, label_pos_c.view(b, -1)).view(b, a, k)
    valid = valid_anchors[:, :, None] & in_seq & loss_mask.gather(1, label_pos_c.view(b, -1)).view(b, a, k)
    # the state predicting x_{a+k} is s_{a+k-1}
    state_pos = (label_pos_c - 1).clamp(max=final_states.shape[1] - 1)
    weights = torch.exp(-steps.float() / cfg.position_decay)[None, None, :] * valid  # [B, A, K]

    idx = valid.view(-1).nonzero().squeeze(-1)
    hidden = out.hidden.reshape(b * a * k, -1)[idx]
    markov = out.markov_embed.reshape(b * a * k, -1)[idx] if out.markov_embed is not None else None
    tfinal = final_states.gather(1, state_pos.view(b, -1, 1).expand(-1, -1, final_states.shape[-1])).view(b * a * k, -1)[idx]
    lab = labels.view(-1)[idx]
    ce_parts, tv_parts, match_parts = [], [], []
    for s in range(0, len(idx), cfg.chunk_rows):
        sl = slice(s, s + cfg.chunk_rows)
        args = (model, hidden[sl], markov[sl] if markov is not None else None, tfinal[sl], lab[sl])
        ce_c, tv_c, m_c = checkpoint(_chunk_terms, *args, use_reentrant=False) if (cfg.recompute_chunks and torch.is_grad_enabled()) else _chunk_terms(*args)
        ce_parts.append(ce_c)
        tv_parts.append(tv_c)
        match_parts.append(m_c)
    empty = hidden.new_zeros(0)
    ce_v = torch.cat(ce_parts) if ce_parts else empty
    tv_v = torch.cat(tv_parts) if tv_parts else empty
    match_v = torch.cat(match_parts) if match_parts else empty
    w = weights.view(-1)[idx]
    wsum = w.sum().clamp_min(1e-8)
    ce = (w * ce_v).sum() / wsum
    tv = (w * tv_v).sum() / wsum
    loss = cfg.ce_weight * ce + cfg.tv_weight * tv
    bce = torch.zeros((), device=ce.device)
    conf_p = conf_t = empty
    if out.confidence_logits is not None:
        logit = out.confidence_logits.reshape(-1)[idx]
        conf_t = (1.0 - tv_v).detach()
        bce = (w * F.binary_cross_entropy_with_logits(logit, conf_t, reduction="none")).sum() / wsum
        loss = loss + cfg.confidence_weight * bce
        conf_p = torch.sigmoid(logit).detach()

    # acceptance statistics per position
    def per_pos(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(b * a * k, device=values.device)
        full[idx] = values.detach().float()
        full = full.view(b, a, k)
        n = valid.sum((0, 1)).clamp_min(1)
        return (full * valid).sum((0, 1)) / n, full

    acc, match_full = per_pos(match_v)
    acc_prob, _ = per_pos(1.0 - tv_v)
    # unconditional: the first k drafts all match, over anchors whose first label is valid
    first_ok = valid[:, :, 0]
    run = torch.cumprod(torch.where(valid, match_full, torch.zeros_like(match_full)), dim=-1)
    uncond = (run * first_ok[:, :, None]).sum((0, 1)) / first_ok.sum().clamp_min(1)
    return LossOutput(loss=loss, ce=ce.detach(), tv=tv.detach(), confidence_bce=bce.detach(),
                      accept_per_position=uncond, accept_cond_per_position=acc, accept_prob_per_position=acc_prob,
                      confidence=conf_p, confidence_target=conf_t, num_positions=int(len(idx)))

