"""The target's next-token distribution, computed once per dataset instead of every step.

The target is frozen, so ``softmax(lm_head(final_norm(s_t)))`` at a supervised position never
changes; recomputing it every step costs a [rows, V] matmul and softmax per prediction (13% of
the demo's step, benchmarks/train_profile.py). This module computes the top ``k`` probabilities
and their token ids once per shard, at the positions the loss can read (states whose next
token is an answer token, or every state for ``train.supervise=all``), and stores them beside
the shards' Arrow cache (``<dataset>/.target_topk/``), keyed by the shard's sha256, ``k``, the
position rule and a fingerprint of the target's head. A killed computation leaves no partial
file (atomic writes); a rerun computes only the missing shards.

The loss then works on the stored support (:func:`dspark.loss.topk_tv`): the total variation on
the k ids plus the difference of the remaining masses, a lower bound of the exact TV that is
exact when the target's mass outside the top k is negligible (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.config import SUPERVISE
from dspark.core import derived_files, fp8
from dspark.formats.shard_format import ShardInfo, topk_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceTopK:
    """One sequence's cached target distribution. N cached state rows, K kept tokens."""

    positions: torch.Tensor  # [N] int64 state rows t (the state that predicts token t+1)
    ids: torch.Tensor  # [N, K] int64, by decreasing probability (ids[:, 0] is the target's argmax)
    probs: torch.Tensor  # [N, K] float32


def supervised_tokens(loss_mask: torch.Tensor, lengths: torch.Tensor, rule: str) -> torch.Tensor:
    """[B, T] bool: the tokens the loss supervises under ``train.supervise``: the answer tokens
    (``answer``: the shards' loss mask as it is) or every token after the first within each
    sequence's length (``all``: padding excluded)."""
    if rule != "all":
        return loss_mask
    mask = torch.arange(loss_mask.shape[-1])[None, :] < lengths[:, None]
    mask[:, 0] = False
    return mask


def cached_positions(loss_mask: torch.Tensor, rule: str) -> torch.Tensor:
    """State rows whose distribution the loss can read: t in [0, T-2] with token t+1 supervised
    under ``rule`` (:func:`supervised_tokens` of the one unpadded sequence)."""
    supervised = supervised_tokens(loss_mask[None], torch.tensor([len(loss_mask)]), rule)[0]
    return torch.nonzero(supervised[1:], as_tuple=False).flatten()


def head_fingerprint(lm_head: torch.Tensor, final_norm: torch.Tensor) -> str:
    """A short hash of the frozen head that defines the target distribution."""
    h = hashlib.sha256()
    for t in (lm_head, final_norm):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


@torch.no_grad()
def sequence_topk(
    loss_mask: torch.Tensor,
    hidden_states: torch.Tensor,
    *,
    k: int,
    rule: str,
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    final_index: int,
    rows_per_call: int = 256,
    scales: Optional[torch.Tensor] = None,
) -> SequenceTopK:
    """One sequence's top ``k`` target distribution at the positions ``rule`` lets the loss read
    (what the dataset cache stores per sequence; online training computes it as a sequence arrives)."""
    pos = cached_positions(loss_mask, rule)
    ids, probs = [], []
    for s in range(0, len(pos), rows_per_call):
        sel = pos[s : s + rows_per_call]
        rows = hidden_states[sel, final_index]
        rows = rows.float() if scales is None else fp8.dequantize(rows, scales[sel, final_index])
        p = torch.softmax(target_logits(rows).float(), dim=-1)
        top = p.topk(k, dim=-1)
        ids.append(top.indices)
        probs.append(top.values)
    return SequenceTopK(
        pos.long(),
        torch.cat(ids).long() if ids else torch.zeros(0, k, dtype=torch.long),
        torch.cat(probs).float() if probs else torch.zeros(0, k),
    )


class TargetTopK:
    """Top-k target distributions for every sequence of a :class:`~dspark.data.shards.ShardDataset`
    split, computed on first use and cached on disk per shard."""

    def __init__(
        self,
        ds,  # noqa: ANN001 - dspark.data.shards.ShardDataset (imported lazily: shards imports this module's users)
        *,
        k: int,
        rule: str,
        target_logits: Callable[[torch.Tensor], torch.Tensor],
        head_id: str,
        final_index: int,
        rank: int = 0,
        world_size: int = 1,
        rows_per_call: int = 256,
    ):
        if rule not in SUPERVISE:
            raise ValueError(f"position rule (train.supervise) must be one of {SUPERVISE}, got {rule!r}")
        self.ds, self.k, self.rule = ds, k, rule
        self.target_logits, self.head_id, self.final_index = target_logits, head_id, final_index
        self.rows_per_call = rows_per_call
        self.root = Path(ds.directory) / derived_files.TOPK_DIR / ds.split
        # each rank computes every world_size-th missing shard; the caller synchronises, then loads
        # checked as a derived file, bound to its shard (a pair copied from another shard is rebuilt)
        missing = [s for s in ds.shards if derived_files.problem(self.path(s), source=self.source(s)) is not None]
        for info in tqdm(
            missing[rank::world_size], desc=f"target top-{k} ({ds.split})", unit="shard", disable=rank != 0
        ):
            self._compute(info)

    def source(self, info: ShardInfo) -> str:
        """What a shard's cache must have been built from (its record's ``source``)."""
        return topk_source(info, k=self.k, rule=self.rule, head_id=self.head_id)

    def path(self, info: ShardInfo) -> Path:
        return self.root / f"{info.name}-{info.sha256[:12]}-k{self.k}-{self.rule}-{self.head_id}.safetensors"

    def _shard_rows(self, info: ShardInfo) -> range:
        i = self.ds.shards.index(info)
        start = sum(s.rows for s in self.ds.shards[:i])
        return range(start, start + info.rows)

    @torch.no_grad()
    def _compute(self, info: ShardInfo) -> None:
        def build(tmp: Path) -> None:
            tensors: dict[str, torch.Tensor] = {}
            for j, index in enumerate(self._shard_rows(info)):
                seq = self.ds.read(index)
                top = sequence_topk(
                    seq.loss_mask,
                    seq.hidden_states,
                    scales=seq.scales,
                    k=self.k,
                    rule=self.rule,
                    target_logits=self.target_logits,
                    final_index=self.final_index,
                    rows_per_call=self.rows_per_call,
                )
                tensors[f"{j}.positions"] = top.positions.to(torch.int32)
                tensors[f"{j}.ids"] = top.ids.to(torch.int32)
                tensors[f"{j}.probs"] = top.probs
            meta = {"k": str(self.k), "rule": self.rule, "shard_sha256": info.sha256}
            save_file(tensors, str(tmp), metadata=meta)

        derived_files.reuse_or_build(self.path(info), build, what="target top-k cache", source=self.source(info))

    def load(self) -> list[SequenceTopK]:
        """Every sequence's cache, in dataset order (raises if a shard's file is missing)."""
        out: list[SequenceTopK] = []
        for info in self.ds.shards:
            path = self.path(info)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing target top-k cache for shard {info.name}")
            t = load_file(str(path))
            for j in range(info.rows):
                out.append(SequenceTopK(t[f"{j}.positions"].long(), t[f"{j}.ids"].long(), t[f"{j}.probs"].float()))
        return out
