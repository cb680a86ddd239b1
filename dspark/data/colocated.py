"""Colocated training (``data.mode=colocated``): the target runs inside each training rank and
computes the captured layers' states for every batch from token ids. No hidden-state shards, no
vLLM: SpecForge's online mode, for targets that fit on a device beside the drafter.

The sequences come from any dataset directory the shard reader opens: token-id shards (a
manifest with ``layer_ids: []``, written by ``data.engine=transformers``, :mod:`data_tools.generate`)
or hidden-state shards, whose stored states are then ignored. :class:`ColocatedDataset` has the
shard dataset's interface (length, ``[i]``, :meth:`many`, ``rank_indices``), so the trainer's
batches, data order, resume position and validation are the offline run's: a colocated run
trains on the same sequences in the same order as a run on shards of the same states, and a
killed one resumes at its cursor like any offline run.

The states follow :mod:`dspark.core.layer_ids` (id L = transformers' ``hidden_states[L]``, id
``num_hidden_layers`` = the final state before the norm), computed by the decoder alone (the
target's LM head is the drafter's frozen head, applied by the loss). A micro batch runs as one
right-padded forward: attention is causal, so a real token never reads a padding token and the
padding changes nothing. Every data-parallel rank holds its own copy of the target, on its own
device, in ``train.dtype``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from dspark.data.shards import ShardDataset, ShardSequence

log = logging.getLogger(__name__)

TOKENS_PER_CALL = 32768
"""Tokens one target forward reads (a micro batch is split into such calls): bounds the target's
activation memory (``output_hidden_states`` keeps every layer's states of the call)."""


class ColocatedTarget:
    """The target's decoder in this process: token ids -> the captured layers' states."""

    def __init__(
        self,
        path: Path,
        layer_ids: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        trust_remote_code: bool = False,
        tokens_per_call: int = TOKENS_PER_CALL,
    ):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
        self.decoder = model.get_decoder().to(device).eval().requires_grad_(False)
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in self.layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside [0, {self.num_layers}] for the target at {path}")
        self.device, self.dtype, self.tokens_per_call = torch.device(device), dtype, tokens_per_call
        self._pre_norm: Optional[torch.Tensor] = None
        self.decoder.norm.register_forward_pre_hook(lambda _m, args: setattr(self, "_pre_norm", args[0]))
        del model  # the LM head: the drafter holds its own frozen copy

    @torch.no_grad()
    def states(self, input_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sequence's states [T-1, L, H] (row t: the state after ``ids[:t+1]``, as a shard row
        stores them), on the host, in the target's dtype. Sequences of a call are right-padded."""
        out: list[torch.Tensor] = []
        start = 0
        while start < len(input_ids):
            end, width = start + 1, len(input_ids[start]) - 1
            while (
                end < len(input_ids) and max(width, len(input_ids[end]) - 1) * (end + 1 - start) <= self.tokens_per_call
            ):
                width = max(width, len(input_ids[end]) - 1)
                end += 1
            out += self._call(input_ids[start:end])
            start = end
        return out

    def _call(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        lengths = [len(s) - 1 for s in seqs]  # the last token has no successor: no state
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            ids[i, :n] = s[:n]
        res = self.decoder(input_ids=ids.to(self.device), output_hidden_states=True, use_cache=False)
        layers = [self._pre_norm if i == self.num_layers else res.hidden_states[i] for i in self.layer_ids]
        stacked = torch.stack(layers, dim=2).cpu()  # [B, T, L, H]
        return [stacked[i, :n] for i, n in enumerate(lengths)]


class ColocatedDataset:
    """A dataset split whose states the target computes as sequences are read (the interface of
    :class:`~dspark.data.shards.ShardDataset` that the trainer uses)."""

    def __init__(self, base: ShardDataset, target: ColocatedTarget):
        self.base, self.target = base, target
        self.directory, self.split, self.manifest = base.directory, base.split, base.manifest
        self.n_layers, self.hidden_size = len(target.layer_ids), base.hidden_size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> ShardSequence:
        return self.many([index])[0]

    def many(self, indices: Sequence[int]) -> list[ShardSequence]:
        """The sequences at ``indices`` with their states, from one target forward per call."""
        seqs = [self.base.read(i) for i in indices]
        states = self.target.states([s.input_ids for s in seqs])
        return [
            ShardSequence(seq_id=s.seq_id, input_ids=s.input_ids, loss_mask=s.loss_mask, hidden_states=h)
            for s, h in zip(seqs, states)
        ]

    def tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of a sequence, no target forward (:meth:`ShardDataset.tokens`)."""
        return self.base.tokens(index)

    def rank_indices(self, **kw) -> list[int]:  # noqa: ANN003 - ShardDataset.rank_indices' keywords
        return self.base.rank_indices(**kw)


def device_for_rank() -> torch.device:
    """This rank's device: its local GPU (``LOCAL_RANK``, DeepSpeed's choice too) or the CPU."""
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
