"""The DSpark training loss, a pure function of the drafter output and the target states.

For each anchor's k-th prediction (k = 1..gamma) with weight w_k = exp(-(k-1)/decay) on valid
positions (answer-token label inside the sequence):

    p_t = softmax(lm_head(final_norm(s_{a+k-1})))      target distribution (frozen pieces)
    p_d = softmax(lm_head(h_k) + W2 W1[x_{a+k-1}])      draft distribution
    CE  = -log p_d(x_{a+k})
    TV  = 1/2 ||p_d - p_t||_1
    LK  = -log(sum_v min(p_d, p_t)) = -log(1 - TV)      (the acceptance probability's log)
    KL  = sum_v p_t log(p_t / p_d)                      (speculators' default loss, ``kl_div``)
    BCE = bce(confidence_logit_k, 1 - TV)              (target detached)
    loss = sum_k w_k (ce_weight*CE + tv_weight*TV + lk_weight*LK + kl_weight*KL
                      + confidence_weight*BCE) / sum_k w_k

LK is the acceptance loss of arXiv 2602.23881 (speculators PRs #657/#673): under sampling the
k-th draft is accepted with probability sum_v min(p_d, p_t) = 1 - TV, and the log makes its
gradient 1/(1 - TV) times TV's, large exactly where acceptance is small and TV's gradient is flat
(a fresh drafter, a hard position). Its 1 - TV is floored at ``LK_FLOOR``.

With the target's distribution cached as its top k (``topk_ids``/``topk_probs``,
:mod:`dspark.data.target_topk`), the target logits are not computed at all and TV is taken on the
stored support (:func:`topk_tv`) and KL on the top k and one tail bin (:func:`topk_kl`); the
greedy match compares with the cached argmax.

With a reduced draft vocabulary D (``drafter.draft_vocab_size``, :mod:`dspark.data.draft_vocab`) the
draft distribution p_d lives on D and is 0 on every other target token, exactly as vLLM serves it
(its draft logits are scattered into the target vocabulary with -inf elsewhere before sampling).
The target keeps its full distribution; its mass outside D, m_out = sum_{v not in D} p_t(v), is
unattainable:

    TV = 1/2 (sum_{v in D} |p_d(v) - p_t(v)| + m_out)    (so TV >= m_out, and 1 - TV is still the
                                                          acceptance probability under sampling)
    CE = -log p_d(x_{a+k}) where x_{a+k} is in D; 0 where it is not (no draft can be right there:
         the prediction keeps its weight in the mean, with nothing to learn from the label)

LK and the confidence target read this TV. KL(target || draft) would be infinite (the target has
mass where the draft has none), so KL takes the target renormalised over D, as speculators does
(below): q = p_t / (1 - m_out) on D, KL = sum_{v in D} q log(q / p_d); with the cached top k, the
top-k ids outside D drop out and the tail is taken to lie in D (:func:`topk_kl`). The greedy
match compares the target id of the draft's argmax (``d2t``) with the target's argmax, so a target
argmax outside D never matches.
With the cached top k, the top-k ids outside D count p_d = 0 (:func:`topk_tv`). Speculators
instead renormalises the target over D (``verifier_lm_head`` holds the kept rows only,
``speculators/models/dflash/core.py``): its minimiser p_d = p_t / (1 - m_out) on D is one of this
TV's minimisers, but its TV (and 1 - TV as a confidence target) does not see m_out.

Vocabulary-sized logits exist only for ``CHUNK_ROWS`` positions at a time, and each chunk is
recomputed in backward (activation checkpointing), so thousands of positions never hold
[rows, V] tensors at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dspark.config import LossSettings
from dspark.model import DraftOutput, DSparkDrafter

CHUNK_ROWS = 1024
"""Predictions whose vocabulary-wide logits exist at one time."""


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    ce: torch.Tensor  # scalar, detached (weighted mean)
    tv: torch.Tensor
    confidence_bce: torch.Tensor
    lk: torch.Tensor  # -log(1 - TV), weighted mean (logged whatever its weight)
    accept_per_position: torch.Tensor  # [K] P(first k drafts all match): acceptance as vLLM counts it
    accept_cond_per_position: (
        torch.Tensor
    )  # [K] greedy match rate at each position given a correct prefix (teacher-forced)
    accept_prob_per_position: torch.Tensor  # [K] mean 1 - TV = expected acceptance under sampling
    confidence: torch.Tensor = field(
        default_factory=lambda: torch.empty(0)
    )  # [P] predicted acceptance of valid positions
    confidence_target: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [P] 1 - TV
    num_positions: int = 0
    kl: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # KL(target || draft), weighted mean

    @property
    def tau(self) -> float:
        """Expected accepted length per draft step incl. the bonus token (greedy, teacher-forced)."""
        return 1.0 + float(self.accept_per_position.sum())

    def scalars(self) -> dict[str, float]:
        """The logged scalars (:func:`scalar_names`' keys, in their order): the loss terms and
        acceptance per position. ``accept_pos_k``: the first k drafts all match (unconditional, as
        vLLM counts acceptance; tau = 1 + their sum); ``accept_cond_pos_k``: draft k matches given
        a correct prefix (teacher-forced); ``accept_prob_pos_k``: 1 - TV."""
        d = {name: _scalar(getattr(self, name)) for name in LOSS_TERMS}
        for k in range(len(self.accept_per_position)):
            for prefix, per_position in POSITION_RATES.items():
                d[f"{prefix}_pos_{k + 1}"] = float(getattr(self, per_position)[k])
        return d


#: The scalars of a :class:`LossOutput` that training logs and validation averages.
LOSS_TERMS = ("loss", "ce", "tv", "lk", "kl", "confidence_bce", "tau")

LK_FLOOR = 1e-6
"""The smallest 1 - TV the LK term takes the log of (a draft with no overlap at all)."""
TAIL_FLOOR = 1e-6
"""Added to the draft's tail mass before :func:`topk_kl` takes its log (a draft all on the top k)."""
#: Per-position rates: metric prefix -> the LossOutput field holding them.
POSITION_RATES = {
    "accept": "accept_per_position",
    "accept_cond": "accept_cond_per_position",
    "accept_prob": "accept_prob_per_position",
}


def _scalar(value: torch.Tensor | float) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)  # .item(): no grad warning


def scalar_names(block_size: int) -> list[str]:
    """The keys of :meth:`LossOutput.scalars` for ``block_size`` positions, in order: what every
    rank all-reduces in the same order, whether or not it had a batch to compute them on."""
    return [*LOSS_TERMS, *(f"{p}_pos_{k}" for k in range(1, block_size + 1) for p in POSITION_RATES)]


def _label_ce(model: DSparkDrafter, logp_d: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[P] -log p_d(label); 0 where the label (a target id) is outside the draft vocabulary."""
    ids, in_vocab = model.to_draft_ids(labels)
    ce = -logp_d.gather(-1, ids[:, None]).squeeze(-1)
    return ce if in_vocab is None else ce * in_vocab


def _chunk_terms(model: DSparkDrafter, hidden, markov, target_final, labels):  # noqa: ANN001 - internal
    """Per-row CE, TV, KL, greedy match. hidden [P, H], markov [P, R] or None, target_final [P, Ht], labels [P]."""
    logp_d = F.log_softmax(model.draft_logits(hidden, markov), dim=-1)  # [P, Vd]
    with torch.no_grad():
        logits_t = model.target_logits(target_final)  # [P, V]
        logp_t = F.log_softmax(logits_t, dim=-1)
    p_t = logp_t.exp()
    ce = _label_ce(model, logp_d, labels)
    if model.draft_to_target is None:
        tv = 0.5 * (logp_d.exp() - p_t).abs().sum(-1)
        kl = (p_t * (logp_t - logp_d)).sum(-1)
    else:  # p_d is 0 outside the draft vocabulary: the target's mass there adds to the distance
        p_t_kept = p_t[:, model.draft_to_target]
        tv = 0.5 * ((logp_d.exp() - p_t_kept).abs().sum(-1) + (1.0 - p_t_kept.sum(-1)).clamp_min(0))
        logq = logp_t[:, model.draft_to_target]  # the target renormalised over D, in log space
        logq = logq - logq.logsumexp(-1, keepdim=True)  # (its mass on D may underflow in fp32)
        kl = (logq.exp() * (logq - logp_d)).sum(-1)
    match = (model.to_target_ids(logp_d.argmax(-1)) == logits_t.argmax(-1)).float()
    return ce, tv, kl, match


def topk_tv(
    p_d: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, in_vocab: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """TV between a full draft distribution and a target known by its top k.

    p_d [P, V]; ids, probs [P, K]. On the k ids the exact |p_d - p_t|; outside them only the
    remaining masses are known, so their difference stands for the tail's L1 distance:

        TV_k = 1/2 (sum_{i in S} |p_d,i - p_t,i| + |(1 - sum_S p_d) - (1 - sum_S p_t)|) <= TV

    (triangle inequality), with equality when the target's tail is 0 or the two tails are
    proportional. ``in_vocab`` [P, K] (a reduced draft vocabulary): p_d is over draft ids, ``ids``
    are the top k's draft ids, and an id with ``in_vocab`` False has p_d = 0 there.
    """
    pd_s = p_d.gather(-1, ids)
    if in_vocab is not None:
        pd_s = pd_s * in_vocab
    tail = (probs.sum(-1) - pd_s.sum(-1)).abs()  # |(1 - sum pd_S) - (1 - sum pt_S)|
    return 0.5 * ((pd_s - probs).abs().sum(-1) + tail)


def topk_kl(
    logp_d: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, in_vocab: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """KL(target || draft) with the target known by its top k: the KL of the two distributions
    coarsened to the k ids and one bin for the rest,

        KL_k = sum_{i in S} p_t,i log(p_t,i / p_d,i) + r_t log(r_t / r_d) <= KL,
        r = 1 - sum_S p (each side's tail mass)

    (the log-sum inequality: merging outcomes never increases a KL), exact when the target's tail is
    0 or the two tails are proportional. logp_d [P, V] log-probabilities; ids, probs [P, K].
    ``in_vocab`` [P, K] (a reduced draft vocabulary D; ``ids`` are then draft ids): the top-k ids
    outside D drop out and the target is renormalised over the rest and its tail (the tail taken to
    lie in D), as the full-distribution path renormalises it over D. The draft's tail is taken with
    ``TAIL_FLOOR`` added before its log: its gradient stays a strong pull back until the tail is
    far below the floor (a draft whose tail is already below 1e-6 is pulled back only weakly)."""
    logpd_s = logp_d.gather(-1, ids)
    pd_s = logpd_s.exp()
    probs = probs.float()
    r_t = (1.0 - probs.sum(-1)).clamp_min(0)
    if in_vocab is not None:
        probs, pd_s = probs * in_vocab, pd_s * in_vocab
        logpd_s = logpd_s.masked_fill(~in_vocab, 0.0)  # an id outside D: its probs are 0 now
        z = (probs.sum(-1) + r_t).clamp_min(TAIL_FLOOR)
        probs, r_t = probs / z[:, None], r_t / z
    head = (torch.xlogy(probs, probs) - probs * logpd_s).sum(-1)
    r_d = (1.0 - pd_s.sum(-1)).clamp_min(0) + TAIL_FLOOR  # floored with its gradient kept: a draft
    return head + torch.xlogy(r_t, r_t) - r_t * r_d.log()  # with no tail left is still pulled back


def _chunk_terms_topk(model: DSparkDrafter, hidden, markov, topk_ids, topk_probs, labels):  # noqa: ANN001
    """As :func:`_chunk_terms` with the target's cached top k ([P, K] target ids and probabilities)."""
    logp_d = F.log_softmax(model.draft_logits(hidden, markov), dim=-1)
    ce = _label_ce(model, logp_d, labels)
    ids, in_vocab = model.to_draft_ids(topk_ids)
    tv = topk_tv(logp_d.exp(), ids, topk_probs, in_vocab)
    kl = topk_kl(logp_d, ids, topk_probs, in_vocab)
    match = (model.to_target_ids(logp_d.argmax(-1)) == topk_ids[:, 0]).float()
    return ce, tv, kl, match


@dataclass
class _Targets:
    """Where each of the B*A*K predictions is supervised. P = number of valid predictions."""

    idx: torch.Tensor  # [P] flat indices of the valid predictions in [B*A*K]
    valid: torch.Tensor  # [B, A, K] bool: anchor valid, label inside the sequence and in the answer
    labels: torch.Tensor  # [P] x_{a+k}
    weights: torch.Tensor  # [P] exp(-(k-1)/decay)
    state_pos: torch.Tensor  # [B, A*K] position of the target state that predicts each label


def _targets(
    out: DraftOutput,
    *,
    input_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    valid_anchors: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    num_states: int,
    position_decay: float,
) -> _Targets:
    b, a, k, _ = out.hidden.shape
    steps = torch.arange(k, device=input_ids.device)
    label_pos = anchor_positions[:, :, None] + steps + 1  # [B, A, K]: x_{a+k}
    in_seq = label_pos < lengths[:, None, None]
    label_pos_c = label_pos.clamp(max=input_ids.shape[1] - 1)
    labels = input_ids.gather(1, label_pos_c.view(b, -1)).view(b, a, k)
    valid = valid_anchors[:, :, None] & in_seq & loss_mask.gather(1, label_pos_c.view(b, -1)).view(b, a, k)
    state_pos = (label_pos_c - 1).clamp(max=num_states - 1)  # the state predicting x_{a+k} is s_{a+k-1}
    weights = torch.exp(-steps.float() / position_decay)[None, None, :] * valid  # [B, A, K]
    idx = valid.view(-1).nonzero().squeeze(-1)
    return _Targets(idx, valid, labels.view(-1)[idx], weights.view(-1)[idx], state_pos.view(b, -1))


def _vocab_terms(
    model: DSparkDrafter,
    hidden: torch.Tensor,
    markov: Optional[torch.Tensor],
    target: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    cfg: LossSettings,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CE, TV, KL and greedy match per prediction, ``chunk_rows`` rows of vocabulary-wide logits at a
    time (recomputed in backward unless ``recompute_vocab_chunks`` is off). ``target``: the target's
    final states ([P, Ht]) or its cached top k (ids and probabilities, [P, K] each)."""
    fn = _chunk_terms if len(target) == 1 else _chunk_terms_topk
    parts = []
    for s in range(0, len(labels), chunk_rows):
        sl = slice(s, s + chunk_rows)
        args = (model, hidden[sl], markov[sl] if markov is not None else None, *(t[sl] for t in target), labels[sl])
        recompute = cfg.recompute_vocab_chunks and torch.is_grad_enabled()
        parts.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    if not parts:
        empty = hidden.new_zeros(0)
        return empty, empty, empty, empty
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def _acceptance(tg: _Targets, match: torch.Tensor, tv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position k: P(first k drafts all match) over anchors whose first label is valid (as
    vLLM counts), the conditional match rate, and the mean 1 - TV."""
    b, a, k = tg.valid.shape

    def spread(values: torch.Tensor) -> torch.Tensor:  # [P] -> [B, A, K], zero where invalid
        full = torch.zeros(b * a * k, device=values.device)
        full[tg.idx] = values.detach().float()
        return full.view(b, a, k)

    n = tg.valid.sum((0, 1)).clamp_min(1)
    match_full = spread(match)
    cond = (match_full * tg.valid).sum((0, 1)) / n
    prob = (spread(1.0 - tv) * tg.valid).sum((0, 1)) / n
    first_ok = tg.valid[:, :, 0]
    run = torch.cumprod(torch.where(tg.valid, match_full, torch.zeros_like(match_full)), dim=-1)
    uncond = (run * first_ok[:, :, None]).sum((0, 1)) / first_ok.sum().clamp_min(1)
    return uncond, cond, prob


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
    cfg: LossSettings,
    topk_ids: Optional[torch.Tensor] = None,  # [B, S, K] the target's cached top k (replaces final_states)
    topk_probs: Optional[torch.Tensor] = None,  # [B, S, K]
    chunk_rows: int = CHUNK_ROWS,
) -> LossOutput:
    b, a, k, _ = out.hidden.shape
    tg = _targets(
        out,
        input_ids=input_ids,
        anchor_positions=anchor_positions,
        valid_anchors=valid_anchors,
        loss_mask=loss_mask,
        lengths=lengths,
        num_states=final_states.shape[1],
        position_decay=cfg.position_decay,
    )
    hidden = out.hidden.reshape(b * a * k, -1)[tg.idx]
    markov = out.markov_embed.reshape(b * a * k, -1)[tg.idx] if out.markov_embed is not None else None

    def at_predictions(per_state: torch.Tensor) -> torch.Tensor:  # [B, S, X] -> [P, X]
        rows = per_state.gather(1, tg.state_pos[..., None].expand(-1, -1, per_state.shape[-1]))
        return rows.view(b * a * k, -1)[tg.idx]

    target = (
        (at_predictions(final_states),) if topk_ids is None else (at_predictions(topk_ids), at_predictions(topk_probs))
    )
    ce_v, tv_v, kl_v, match_v = _vocab_terms(model, hidden, markov, target, tg.labels, cfg, chunk_rows)
    w, wsum = tg.weights, tg.weights.sum().clamp_min(1e-8)
    ce = (w * ce_v).sum() / wsum
    tv = (w * tv_v).sum() / wsum
    lk_v = -torch.log((1.0 - tv_v).clamp_min(LK_FLOOR))
    lk = (w * lk_v).sum() / wsum
    kl = (w * kl_v).sum() / wsum
    # only the weighted terms enter the graph: a term at weight 0 would still cost its backward
    # (TV's through the vocabulary-wide exp, 0 times its gradient); the others are logged detached
    weighted = ((cfg.ce_weight, ce), (cfg.tv_weight, tv), (cfg.lk_weight, lk), (cfg.kl_weight, kl))
    loss = sum(weight * term for weight, term in weighted if weight)
    bce = torch.zeros((), device=ce.device)
    conf_p = conf_t = hidden.new_zeros(0)
    if out.confidence_logits is not None:
        logit = out.confidence_logits.reshape(-1)[tg.idx]
        conf_t = (1.0 - tv_v).detach()
        bce = (w * F.binary_cross_entropy_with_logits(logit, conf_t, reduction="none")).sum() / wsum
        loss = loss + cfg.confidence_weight * bce
        conf_p = torch.sigmoid(logit).detach()
    uncond, cond, prob = _acceptance(tg, match_v, tv_v)
    return LossOutput(
        loss=loss,
        ce=ce.detach(),
        tv=tv.detach(),
        lk=lk.detach(),
        kl=kl.detach(),
        confidence_bce=bce.detach(),
        accept_per_position=uncond,
        accept_cond_per_position=cond,
        accept_prob_per_position=prob,
        confidence=conf_p,
        confidence_target=conf_t,
        num_positions=int(len(tg.idx)),
    )
