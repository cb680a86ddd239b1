"""Sequences from the shard reader -> padded training batches, and the data position that
checkpoints record so a resumed run neither skips nor repeats data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dspark.shards import ShardDataset, ShardSequence


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

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "Batch":
        return Batch(
            self.seq_ids,
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.lengths.to(device),
            self.context_states.to(device, dtype),
            self.final_states.to(device, dtype),
            None if self.topk_ids is None else self.topk_ids.to(device),
            None if self.topk_probs is None else self.topk_probs.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


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
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        start = len(s.input_ids) - n  # states row t belongs to token t, so both crop alike
        ids[i, :n] = s.input_ids[start:]
        mask[i, :n] = s.loss_mask[start:]
        ctx[i, : n - 1] = s.hidden_states[start:, context_index]
        fin[i, : n - 1] = s.hidden_states[start:, final_index]
    batch = Batch([s.seq_id for s in seqs], ids, mask, torch.tensor(lengths), ctx.flatten(2), fin)
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
        return collate([self.ds[i] for i in idx], **self.collate_kw)
