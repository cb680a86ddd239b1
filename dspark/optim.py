"""The drafter's optimizer (``train.optimizer``): AdamW, or Muon over the hidden matrices with AdamW
over the rest, handed to DeepSpeed as one client optimizer.

Muon follows speculators 0.9 (``speculators/train/optimizers.py``), the peer our trainer is compared
with: ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``) over every trainable 2-D matrix whose
both sides exceed 1, except the vocabulary-indexed ones (embedding, LM head, the Markov head's W1 and
W2, which are looked up or read out row by row), and AdamW over everything else (norms, biases, the
confidence head's row). DeepSpeed takes a single optimizer, so :class:`MuonWithAdamW` is one
``torch.optim.Optimizer`` whose two parameter groups the two torch optimizers step: one state, one
``state_dict``, and the learning-rate schedule scales both groups.

DeepSpeed's own ``Muon`` optimizer type (``MuonWithAuxAdam``) is not used on CPU: its Newton-Schulz
update is ``torch.compile``'d (minutes of compilation on 2 cores, per matrix shape), and its name
rule sends the Markov head's vocabulary matrices to Muon.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "markov_w1", "markov_w2", "codebook")
"""2-D parameters that AdamW, not Muon, updates (speculators' list): vocabulary-indexed matrices."""
BETAS = (0.9, 0.95)


def split_for_muon(named: Iterable[tuple[str, torch.nn.Parameter]]) -> tuple[list, list]:
    """(Muon's, AdamW's) trainable parameters, as (name, parameter) pairs."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS)
        (muon if matrix else adamw).append((name, p))
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_params`` and ``torch.optim.AdamW`` over ``adamw_params`` as
    one optimizer: group 0 is Muon's (``lr``: ``muon_lr``), group 1 AdamW's; both optimizers read
    and write this object's groups and state, so DeepSpeed's checkpoints and the LR scheduler see
    one optimizer."""

    def __init__(
        self,
        muon_params: list[torch.nn.Parameter],
        adamw_params: list[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float,
        muon_lr: float,
        muon_momentum: float,
        muon_weight_decay: float,
        fused: bool = False,
    ):
        groups = []
        if muon_params:
            groups.append({"params": muon_params, "lr": muon_lr, "weight_decay": muon_weight_decay, "use_muon": True})
        if adamw_params:
            groups.append({"params": adamw_params, "lr": lr, "weight_decay": weight_decay, "use_muon": False})
        super().__init__(groups, {})
        self._muon = (
            torch.optim.Muon(
                muon_params,
                lr=muon_lr,
                weight_decay=muon_weight_decay,
                momentum=muon_momentum,
                adjust_lr_fn="match_rms_adamw",
            )
            if muon_params
            else None
        )
        self._adamw = (
            torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay, betas=BETAS, fused=fused or None)
            if adamw_params
            else None
        )
        self._link()

    def _link(self) -> None:
        """Point both torch optimizers at this object's groups (their own keys filled in) and state."""
        for opt, use_muon in ((self._muon, True), (self._adamw, False)):
            if opt is None:
                continue
            mine = [g for g in self.param_groups if g["use_muon"] is use_muon]
            for g in mine:
                for k, v in opt.defaults.items():
                    g.setdefault(k, v)
            opt.param_groups = mine
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self._muon, self._adamw):
            if opt is not None:
                opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: link them again
        self._link()


def build_optimizer(model: torch.nn.Module, t: Any) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``model``'s trainable parameters (``t``: the train config)."""
    if t.optimizer == "muon":
        muon, adamw = split_for_muon(model.named_parameters())
        return MuonWithAdamW(
            [p for _, p in muon],
            [p for _, p in adamw],
            lr=t.lr,
            weight_decay=t.weight_decay,
            muon_lr=t.muon_lr,
            muon_momentum=t.muon_momentum,
            muon_weight_decay=t.muon_weight_decay,
            fused=t.fused_optimizer,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=BETAS, fused=t.fused_optimizer or None)
