"""The recipe's data: what each ``data.mode`` trains on, one entry of :data:`MODES` per mode.

A mode checks, before the checkpoint directory is taken, that there is data to train on (a run
without any writes nothing); loads the training split (checked against the target) and the
validation set; and feeds the trainer its micro-batches, from the resumed position:

* ``offline``: ``data.shards_dir``'s hidden-state shards.
* ``colocated``: the shards' token ids, this rank's own copy of the target computing the states.
* ``online``: the sequences the extraction engine streams (``data_tools.online``), the val split
  generated once and held in memory.

:func:`dspark.recipe.build_trainer` looks the mode up here; ``RunConfig`` refuses any mode the
table does not have (``data.mode``'s choices are :data:`dspark.config.DATA_MODES`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dspark.checkpoint import TrainState
from dspark.config import TORCH_DTYPES, ConfigError, RunConfig, TargetConfig
from dspark.core.file_reads import file_sha256, text_sha256
from dspark.data.batching import RankBatches
from dspark.data.colocated import ColocatedDataset, ColocatedTarget, device_for_rank
from dspark.data.online import (
    OnlineBatches,
    SequenceList,
    check_source,
    row_to_sequence,
    shared_val_rows,
    stream_meta,
)
from dspark.data.shards import ShardDataset, ShardSequence, check_dataset, require_dataset
from dspark.data.target_topk import SequenceTopK, TargetTopK, head_fingerprint, sequence_topk
from dspark.formats.shard_format import DatasetError
from dspark.formats.stream import SequenceSource, StreamMeta
from dspark.model import DSparkDrafter
from dspark.target import TargetHeads

log = logging.getLogger(__name__)


@dataclass
class TrainData:
    """A mode's datasets: ``train`` (None online: the sequences are streamed), ``val`` (None
    without a val split) and, online, the source and its header."""

    train: Optional[Any]
    val: Optional[Any]
    source: Optional[SequenceSource] = None
    meta: Optional[StreamMeta] = None


@dataclass(frozen=True)
class DataMode:
    """One ``data.mode``: three steps, each taking the same arguments whatever the mode."""

    check: Callable[[RunConfig, Optional[SequenceSource], int], None]
    """``(cfg, source, rank)``: refuse a run with nothing to train on, before the lock is taken."""
    load: Callable[..., TrainData]
    """``(cfg, heads, source, dtype, *, rank, world)``: the datasets, checked against the target."""
    batches: Callable[..., Any]
    """``(cfg, data, drafter, context_index, final_index, state, log_dir, *, rank, world)``: the
    micro-batches the trainer draws, from ``state``'s data position."""


def data_mode(cfg: RunConfig) -> DataMode:
    """``cfg.data.mode``'s entry of :data:`MODES`."""
    return MODES[cfg.data.mode]


# --- checks before the lock ----------------------------------------------------------------------
def require_shards(cfg: RunConfig, source: Optional[SequenceSource], rank: int) -> None:
    """``data.shards_dir`` holds a dataset (else the error says to extract first)."""
    require_dataset(cfg.data.shards_dir)


def check_online_ranks(cfg: RunConfig, source: Optional[SequenceSource], rank: int) -> None:
    """``data.mode=online``: rank 0 reads the stream (the engine train.py starts, or the link to
    the producer on other nodes) and hands the other ranks their share."""
    if rank == 0 and source is None:
        raise ConfigError(
            "data.mode=online: no sequence source on rank 0, expected the engine or link that train.py starts "
            "(python train.py data.mode=online stages=[train])"
        )


# --- datasets ------------------------------------------------------------------------------------
def shard_datasets(
    cfg: RunConfig, heads: TargetHeads, source: Optional[SequenceSource], dtype: torch.dtype, *, rank: int, world: int
) -> TrainData:
    """``data.shards_dir``'s train split (checked against the target) and its val split, if any."""
    shards = Path(cfg.data.shards_dir).expanduser()
    train_ds = ShardDataset(shards, "train", states_dtype=dtype, keep_fp8=True, limit=cfg.data.train_sequences)
    check_shards_match_target(train_ds, cfg.target, heads, allow_other_target=cfg.data.allow_other_target)
    has_val = any(s.split == "val" and s.rows for s in train_ds.manifest.shards)
    return TrainData(train_ds, ShardDataset(shards, "val", states_dtype=dtype, keep_fp8=True) if has_val else None)


def colocated_datasets(
    cfg: RunConfig, heads: TargetHeads, source: Optional[SequenceSource], dtype: torch.dtype, *, rank: int, world: int
) -> TrainData:
    """``data.mode=colocated``: ``data.shards_dir``'s token ids (its states, if any, unread) with
    this rank's own copy of the target computing the captured layers' states, on its device."""
    shards = Path(cfg.data.shards_dir).expanduser()
    base = ShardDataset(shards, "train", states_dtype=dtype, keep_fp8=True, limit=cfg.data.train_sequences)
    check_shards_match_target(base, cfg.target, heads, states=False, allow_other_target=cfg.data.allow_other_target)
    device = device_for_rank()
    target = ColocatedTarget(
        heads.path,
        cfg.target.capture_layer_ids(int(heads.config["num_hidden_layers"])),
        dtype=dtype,
        device=device,
        trust_remote_code=cfg.target.trust_remote_code,
    )
    log.info("colocated: the target (%s, %s) computes every batch's states on %s", heads.architecture, dtype, device)
    has_val = any(s.split == "val" and s.rows for s in base.manifest.shards)
    val = ShardDataset(shards, "val", states_dtype=dtype, keep_fp8=True) if has_val else None
    return TrainData(ColocatedDataset(base, target), ColocatedDataset(val, target) if val is not None else None)


def online_data(
    cfg: RunConfig, heads: TargetHeads, source: Optional[SequenceSource], dtype: torch.dtype, *, rank: int, world: int
) -> TrainData:
    """``data.mode=online``: the stream's header (checked against the target) and the validation
    set: the val split's sequences, generated once, in memory on every rank (validation shards them)."""
    meta = stream_meta(source, rank, world)
    check_source(
        meta,
        expect_layer_ids=cfg.target.capture_layer_ids(int(heads.config["num_hidden_layers"])),
        expect_hidden_size=heads.hidden_size,
    )
    seqs = [row_to_sequence(r, meta, dtype) for r in shared_val_rows(source, rank, world)]
    return TrainData(None, SequenceList(seqs) if seqs else None, source=source, meta=meta)


def check_shards_match_target(
    ds: ShardDataset, target: TargetConfig, heads: TargetHeads, *, states: bool = True, allow_other_target: bool = False
) -> None:
    """Refuse shards made for another target before the first step (``states=False``: only the
    token ids are read, so any captured layers will do)."""
    m, where = ds.manifest, ds.directory / "manifest.json"
    expected = target.capture_layer_ids(int(heads.config["num_hidden_layers"]))
    if states and not m.layer_ids:
        raise DatasetError(
            f"{where}: field 'layer_ids' is [] (token-id shards: ids and loss mask, no states), expected the "
            f"captured layers {expected}; train on them with data.mode=colocated, or extract states with "
            "data.engine=vllm into a new data.shards_dir"
        )
    check_dataset(ds, expect_layer_ids=expected if states else None, expect_hidden_size=heads.hidden_size)
    differences = dataset_target_differences(m, target, heads)
    if differences and allow_other_target:
        log.warning("%s: made for another target (%s); data.allow_other_target=true: trained anyway", where,
                    "; ".join(differences))  # fmt: skip
    elif differences:
        raise DatasetError(
            f"{where}: made for another target: {'; '.join(differences)}. Extract with this target into a new "
            "data.shards_dir (stages=[extract,train]), or, if the states fit (the same weights under another name), "
            "set data.allow_other_target=true"
        )


def dataset_target_differences(m: Any, target: TargetConfig, heads: TargetHeads) -> list[str]:
    """Each identity field the manifest records that differs from the target being trained for,
    as "field 'F' is X, the target has Y": its name, architecture, depth, tokenizer (tokenizer.json,
    or the vocabulary where there is none, as the extractor hashes it) and chat template."""
    tok = heads.path / "tokenizer.json"
    tok_sha = file_sha256(tok) if tok.is_file() else text_sha256(str(sorted(heads.tokenizer.get_vocab().items())))
    ours = {
        "target": target.name,
        "architecture": heads.architecture,
        "num_hidden_layers": int(heads.config["num_hidden_layers"]),
        "tokenizer_sha256": tok_sha,
        "chat_template_sha256": text_sha256(getattr(heads.tokenizer, "chat_template", None)),
    }
    out = []
    for key, value in ours.items():
        theirs = getattr(m, key)
        if theirs != value:
            short = (lambda v: f"{v[:12]}...") if key.endswith("sha256") else repr
            out.append(f"field '{key}' is {short(theirs)}, the target has {short(value)}")
    return out


def attach_target_topk(
    train_ds: ShardDataset,
    drafter: DSparkDrafter,
    cfg: RunConfig,
    heads: TargetHeads,
    final_index: int,
    *,
    rank: int,
    world: int,
) -> None:
    """``train.target_topk``: the training split's target distributions, computed once (each
    rank a share of the missing shards) and attached to every sequence the dataset reads."""
    import torch.distributed as dist

    if torch.cuda.is_available():  # the frozen head on the GPU (DeepSpeed puts the model there anyway)
        drafter.to(torch.device("cuda", torch.cuda.current_device()))
    device = drafter.lm_head.weight.device

    def target_logits(rows: torch.Tensor) -> torch.Tensor:
        return drafter.target_logits(rows.to(device)).cpu()

    cache = TargetTopK(
        train_ds,
        k=cfg.train.target_topk,
        rule=cfg.train.supervise,
        target_logits=target_logits,
        head_id=head_fingerprint(heads.lm_head, heads.final_norm),
        final_index=final_index,
        rank=rank,
        world_size=world,
    )
    dist.barrier()
    train_ds.target_topk = cache.load()


# --- batches -------------------------------------------------------------------------------------
def rank_batches(
    cfg: RunConfig,
    data: TrainData,
    drafter: DSparkDrafter,
    context_index: list[int],
    final_index: int,
    state: TrainState,
    log_dir: Path,
    *,
    rank: int,
    world: int,
) -> RankBatches:
    """Offline and colocated: this rank's micro-batches of the training split, epoch by epoch."""
    t = cfg.train
    return RankBatches(
        data.train,
        rank=rank,
        world_size=world,
        micro_batch=t.micro_batch_size,
        seed=cfg.seed,
        context_index=context_index,
        final_index=final_index,
        max_len=t.max_seq_len,
        position=state.data,
    )


def online_batches(
    cfg: RunConfig,
    data: TrainData,
    drafter: DSparkDrafter,
    context_index: list[int],
    final_index: int,
    state: TrainState,
    log_dir: Path,
    *,
    rank: int,
    world: int,
) -> OnlineBatches:
    """``data.mode=online``: micro-batches from the source's rolling window, from the resumed
    position's prompt cursor; ``train.target_topk`` is computed as each sequence arrives."""
    t = cfg.train
    topk = None
    if t.target_topk:
        device = drafter.lm_head.weight.device

        def topk(seq: ShardSequence) -> SequenceTopK:
            return sequence_topk(
                seq.loss_mask,
                seq.hidden_states,
                scales=seq.scales,
                k=t.target_topk,
                rule=t.supervise,
                target_logits=lambda rows: drafter.target_logits(rows.to(device)).cpu(),
                final_index=final_index,
            )

    return OnlineBatches(
        data.source,
        meta=data.meta,
        micro_batch=t.micro_batch_size,
        new_per_batch=cfg.new_per_micro_batch(),
        window_size=cfg.data.online.window_size,
        seed=cfg.seed,
        context_index=context_index,
        final_index=final_index,
        max_len=t.max_seq_len,
        dtype=TORCH_DTYPES[t.dtype],
        position=state.data,
        log_dir=log_dir,
        target_topk=topk,
        rank=rank,
        world_size=world,
    )


MODES: dict[str, DataMode] = {
    "offline": DataMode(check=require_shards, load=shard_datasets, batches=rank_batches),
    "colocated": DataMode(check=require_shards, load=colocated_datasets, batches=rank_batches),
    "online": DataMode(check=check_online_ranks, load=online_data, batches=online_batches),
}
"""``data.mode`` -> how it trains: every one of :data:`dspark.config.DATA_MODES`, nothing else."""
