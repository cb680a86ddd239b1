"""The draft vocabulary (``drafter.draft_vocab_size``): the target tokens the drafter can draft,
chosen once from the training split's token frequencies, as speculators 0.9.0 chooses them
(``speculators/train/vocab_mapping.py``) and as vLLM 0.32 serves them (``d2t``).

* **counts**: how often each target token is a supervised next token of the training split (the
  tokens ``train.supervise`` supervises: the answers by default; the first
  ``data.train_sequences`` sequences when that is set);
* **kept**: the N tokens ranked by (count descending, token id ascending). Tokens never seen rank
  last in id order, which is speculators' fill when fewer than N tokens were seen;
* **draft ids** run over the kept tokens in ascending target-id order;
* ``d2t`` [N] int64 offsets: ``target_id = draft_id + d2t[draft_id]`` (vLLM's loader reads it as
  ``draft_id_to_target_id``, llama.cpp's converter as ``d2t``);
* ``t2d`` [V] bool: the kept target ids (speculators' training-side mask; vLLM skips it).

The counts are computed once per dataset and cached beside its shards
(``<dataset>/.draft_vocab/``), keyed by the training shards' SHA-256, the rule and the number of
sequences, so any N reuses them. A run's map then lives in its checkpoints (the drafter's ``d2t``
buffer, :class:`dspark.model.DSparkDrafter`): a resumed run reads it from the tag it resumes
(:func:`dspark.checkpoint_weights.saved_draft_map`), never from the data again, and an export carries it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from dspark.core import derived_files
from dspark.data.target_topk import supervised_tokens

log = logging.getLogger(__name__)

CACHE_DIR = derived_files.COUNTS_DIR


def token_counts(ds: Any, *, vocab_size: int, rule: str) -> torch.Tensor:
    """[V] int64: how often each token is a supervised next token (``rule``, as the loss
    supervises it) in ``ds`` (a :class:`~dspark.data.shards.ShardDataset` split, or anything with its
    ``tokens(index)`` and length). The states are not read."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(ds)):
        ids, mask = ds.tokens(i)
        supervised = supervised_tokens(mask[None], torch.tensor([len(ids)]), rule)[0]
        tokens = ids[supervised]
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
            raise ValueError(
                f"{ds.directory}/{ds.split} sequence {i}: token ids outside [0, {vocab_size}), the target's vocabulary"
            )
        counts += torch.bincount(tokens, minlength=vocab_size)
    return counts


def cached_token_counts(ds: Any, *, vocab_size: int, rule: str) -> torch.Tensor:
    """:func:`token_counts`, computed on first use and cached beside the dataset's shards
    (written atomically: concurrent ranks write the same bytes, a killed count leaves nothing)."""
    shards = getattr(ds, "base", ds).shards  # a ColocatedDataset reads its base's shards
    source = hashlib.sha256(repr([(s.name, s.sha256) for s in shards] + [rule, len(ds), vocab_size]).encode())
    key = source.hexdigest()
    path = Path(ds.directory) / CACHE_DIR / f"{ds.split}-{rule}-{len(ds)}-{key[:12]}.safetensors"
    source_name = f"the {ds.split} split's {len(shards)} shards (sha256 of their names and hashes {key})"

    def build(tmp: Path) -> None:
        counts = token_counts(ds, vocab_size=vocab_size, rule=rule)
        save_file({"counts": counts}, str(tmp), metadata={"rule": rule, "sequences": str(len(ds))})

    return load_file(str(derived_files.reuse_or_build(path, build, what="token-count cache", source=source_name)))[
        "counts"
    ]


def build_d2t(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The N = ``size`` most frequent tokens of ``counts`` [V] (ties and unseen tokens by id) as
    ``d2t`` [N] int64 offsets, draft ids in ascending target-id order."""
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size {size}: expected an int in [1, {vocab}] (the target's vocabulary)")
    ids = torch.arange(vocab)
    # sort by id, then stably by count descending: equal counts stay in id order
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    kept = ids[order[:size]].sort().values
    return kept - torch.arange(size)


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[N] the target id of every draft id."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def t2d_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: True on the target ids the draft vocabulary keeps (speculators' ``t2d``)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[target_ids(d2t.cpu())] = True
    return mask


def map_problem(d2t: torch.Tensor, vocab_size: int) -> Optional[str]:
    """Why ``d2t`` is not a draft vocabulary over ``vocab_size`` target tokens (integer offsets to
    strictly increasing target ids in [0, V)), or None."""
    if d2t.dim() != 1 or d2t.is_floating_point() or not len(d2t):
        return f"d2t has shape {list(d2t.shape)} and dtype {d2t.dtype}, expected [N] integers with N >= 1"
    ids = target_ids(d2t.long())
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        return f"d2t maps to target ids {int(ids[0])}..{int(ids[-1])}, expected ids in [0, {vocab_size})"
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        return "d2t's target ids are not strictly increasing (draft ids run in ascending target-id order)"
    return None


def coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    """Share of the counted tokens that the draft vocabulary keeps."""
    total = int(counts.sum())
    return float(counts[target_ids(d2t)].sum()) / total if total else 0.0


def draft_vocab_map(ds: Any, *, size: int, vocab_size: int, rule: str) -> torch.Tensor:
    """``d2t`` of the ``size`` most frequent supervised tokens of ``ds`` (its counts cached), logged
    with the share of the training split's supervised tokens it keeps."""
    counts = cached_token_counts(ds, vocab_size=vocab_size, rule=rule)
    d2t = build_d2t(counts, size)
    log.info(
        "draft vocabulary: %d of %d target tokens, %.2f%% of the %d supervised tokens of %s/%s (%d distinct)",
        size,
        vocab_size,
        100 * coverage(counts, d2t),
        int(counts.sum()),
        ds.directory,
        ds.split,
        int((counts > 0).sum()),
    )
    return d2t
