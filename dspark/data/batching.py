"""Sequences from the shard reader -> padded training batches, and the data position that
checkpoints record so a resumed run neither skips nor repeats data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dspark.core import fp8
from dspark.data.shards import ShardDataset, ShardSequence


@dataclass
class Batch:
    """Shape symbols: B sequences, T padded tokens, S = T-1, C = n_ctx_layers * Ht."""

    seq_ids: list[str]
    input_ids: torch.Tensor  # [B, T] int64, 0-padded
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B]
    context_states: torch.Tensor  # [B, S, C]
    final_states: torch.Tensor  # [B, S, Ht]
    topk_ids: Optional[torch.Tensor] = None  # [B, S, K] int64: the target's cached top-k at each state row
    topk_probs: Optional[torch.Tensor] = None  # [B, S, K] float32 (0 where nothing is cached)
    context_scales: Optional[torch.Tensor] = None  # [B, S, n_ctx_layers] fp32 when the states are fp8
    final_scales: Optional[torch.Tensor] = None  # [B, S] fp32 when the states are fp8

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "Batch":
        """On ``device`` with the states in ``dtype``; fp8 states travel as fp8 (a byte per
        value) with their scales and are dequantized there, by the same arithmetic as the host
        reader (:func:`dspark.core.fp8.dequantize`), so the numbers do not depend on where."""
        return Batch(
            self.seq_ids,
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.lengths.to(device),
            _states_to(self.context_states, self.context_scales, device, dtype),
            _states_to(self.final_states, self.final_scales, device, dtype),
            None if self.topk_ids is None else self.topk_ids.to(device),
            None if self.topk_probs is None else self.topk_probs.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _states_to(
    states: torch.Tensor, scales: Optional[torch.Tensor], device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """States -> ``dtype`` on ``device``: a float dtype is cast; fp8 [..., H] with [...] scales, or
    [..., n*H] (n layers side by side) with [..., n] scales, is dequantized there."""
    if scales is None:
        return states.to(device, dtype)
    values, scales = states.to(device, non_blocking=True), scales.to(device, non_blocking=True)
    if scales.dim() == values.dim():  # [..., n*H] with [..., n]: one scale per layer of the row
        values = values.view(*values.shape[:-1], scales.shape[-1], -1)
        return fp8.dequantize(values, scales, dtype).flatten(-2)
    return fp8.dequantize(values, scales, dtype)


def collate(seqs: list[ShardSequence], *, context_index: list[int], final_index: int, max_len: int) -> Batch:
    """Keep the last ``max_len`` tokens of each sequence and pad to the longest in the batch.

    The answer (the loss region) is at the end of a sequence, so a long prompt loses its
    beginning rather than the answer losing its tokens. RoPE makes attention depend only on
    relative positions, so a window that starts at position 0 trains the same function.
    """
    lengths = [min(len(s.input_ids), max_len) for s in seqs]
    t = max(lengths)
    b, h = len(seqs), seqs[0].hidden_states.shape[-1]
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    ctx = torch.zeros(b, t - 1, len(context_index), h, dtype=seqs[0].hidden_states.dtype)
    fin = torch.zeros(b, t - 1, h, dtype=seqs[0].hidden_states.dtype)
    scaled = seqs[0].scales is not None  # fp8 values: padding is value 0 with scale 0
    ctx_s = torch.zeros(b, t - 1, len(context_index)) if scaled else None
    fin_s = torch.zeros(b, t - 1) if scaled else None
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        start = len(s.input_ids) - n  # states row t belongs to token t, so both crop alike
        ids[i, :n] = s.input_ids[start:]
        mask[i, :n] = s.loss_mask[start:]
        ctx[i, : n - 1] = s.hidden_states[start:, context_index]
        fin[i, : n - 1] = s.hidden_states[start:, final_index]
        if ctx_s is not None and fin_s is not None:
            assert s.scales is not None, f"{s.seq_id}: fp8 and dequantized sequences in one batch"
            ctx_s[i, : n - 1] = s.scales[start:, context_index]
            fin_s[i, : n - 1] = s.scales[start:, final_index]
    batch = Batch(
        [s.seq_id for s in seqs],
        ids,
        mask,
        torch.tensor(lengths),
        ctx.flatten(2),
        fin,
        context_scales=ctx_s,
        final_scales=fin_s,
    )
    if seqs[0].target_topk is not None:
        k = seqs[0].target_topk.ids.shape[1]
        batch.topk_ids = torch.zeros(b, t - 1, k, dtype=torch.long)
        batch.topk_probs = torch.zeros(b, t - 1, k)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            start, tk = len(s.input_ids) - n, s.target_topk
            keep = (tk.positions >= start) & (tk.positions < start + n - 1)
            rows = tk.positions[keep] - start
            batch.topk_ids[i, rows] = tk.ids[keep]
            batch.topk_probs[i, rows] = tk.probs[keep]
    return batch


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0  # position in this rank's order for the epoch


class RankBatches:
    """Endless micro-batches for one data-parallel rank, resumable from a DataPosition."""

    def __init__(
        self,
        ds: ShardDataset,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        seed: int,
        context_index: list[int],
        final_index: int,
        max_len: int,
        position: DataPosition | None = None,
    ):
        self.ds, self.rank, self.world, self.mb, self.seed = ds, rank, world_size, micro_batch, seed
        self.collate_kw = dict(context_index=context_index, final_index=final_index, max_len=max_len)
        self.pos = position or DataPosition()
        if len(ds) // world_size < micro_batch:
            raise ValueError(
                f"{ds.directory}/{ds.split}: {len(ds)} sequences cannot fill a micro batch of {micro_batch} on "
                f"{world_size} ranks"
            )
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        return self.ds.rank_indices(rank=self.rank, world_size=self.world, seed=self.seed, epoch=self.pos.epoch)

    def next(self) -> Batch:
        if self.pos.index + self.mb > len(self._order):
            self.pos = DataPosition(self.pos.epoch + 1, 0)
            self._order = self._epoch_order()
        idx = self._order[self.pos.index : self.pos.index + self.mb]
        self.pos = DataPosition(self.pos.epoch, self.pos.index + self.mb)
        return collate(self.ds.many(idx), **self.collate_kw)
