"""The training recipe: the trainer's parts, built from the config in one place.

:func:`build_trainer` reads the resolved config once and hands :class:`dspark.trainer.Trainer`
what its loop runs on: the batches and validation set (shards or the online stream, as
:mod:`dspark.recipe_data` builds each ``data.mode``), the drafter wrapped with its loss in a
DeepSpeed engine (AdamW, warmup-cosine schedule, the ZeRO preset), the run's state (fresh or
resumed), the checkpointer and the W&B run. Single process
(``python train.py ...``), ``torchrun``/``deepspeed`` launchers and Slurm all go through
:func:`train`.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from dspark.checkpoint import Checkpointer, TrainState
from dspark.config import TORCH_DTYPES, ConfigError, LossSettings, RunConfig, load_config
from dspark.config.wandb_run import init_wandb
from dspark.data.batching import Batch
from dspark.distributed import init_distributed
from dspark.formats.stream import SequenceSource
from dspark.loss import LossOutput, dspark_loss
from dspark.model import DSparkDrafter, resolve_dims
from dspark.optim import build_optimizer
from dspark.precision import Autocast, resolve_autocast
from dspark.recipe_data import attach_target_topk, data_mode
from dspark.target import TargetHeads, load_target_layer
from dspark.trainer import Trainer, TrainParts

log = logging.getLogger(__name__)


def train(cfg: RunConfig, heads: TargetHeads, source: Optional[SequenceSource] = None) -> TrainState:
    """Stage 2: train to ``train.max_steps`` (resuming what the checkpoint directory holds)."""
    return build_trainer(cfg, heads, source).train()


def build_trainer(cfg: RunConfig | DictConfig, heads: TargetHeads, source: Optional[SequenceSource] = None) -> Trainer:
    """The trainer for ``cfg``. ``source``: where ``data.mode=online`` reads sequences from
    (``data_tools.online``); the trainer closes it. Joins the process group and holds
    ``train.checkpoint_dir`` (rank 0) from here on: a build that fails releases both."""
    cfg = load_config(cfg)
    rank, world = init_distributed(cfg.train.dist_timeout_s)
    autocast = resolve_autocast(cfg.train.autocast, _device_kind(), cfg.train.dtype)
    log.info("precision: %s weights, %s (%s)", cfg.train.dtype, autocast.label, autocast.reason)  # the first line
    data_mode(cfg).check(cfg, source, rank)  # before the lock: a run without data writes nothing
    check_window(cfg, heads)
    checkpointer = Checkpointer(cfg, rank=rank, world=world)
    try:
        return Trainer(_build_parts(cfg, heads, source, checkpointer, rank, world, autocast))
    except BaseException:
        checkpointer.close()
        if source is not None:
            source.close()
        raise


def _device_kind() -> torch.device:
    """The kind of device this rank trains on (what autocast needs): a GPU when torch sees one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_window(cfg: RunConfig, heads: TargetHeads) -> None:
    """Refuse a ``drafter.attention_window`` at or past the target's context: a sliding window that
    long is full attention, exported as a window nothing ever reaches."""
    window = cfg.drafter.attention_window
    positions = int(heads.config.get("max_position_embeddings") or 0)
    if window is not None and positions and window >= positions:
        raise ConfigError(
            f"drafter.attention_window={window}: at or past the target's whole context ({positions} positions, "
            "its config's max_position_embeddings), where a sliding window is full attention; set "
            f"drafter.attention_window=null for full attention, or a window below {positions}"
        )


def _build_parts(
    cfg: RunConfig,
    heads: TargetHeads,
    source: Optional[SequenceSource],
    checkpointer: Checkpointer,
    rank: int,
    world: int,
    autocast: Autocast,
) -> TrainParts:
    import deepspeed

    t = cfg.train
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    dtype = TORCH_DTYPES[t.dtype]  # what states reach the drafter in (fp8: on the device)
    mode = data_mode(cfg)
    data = mode.load(cfg, heads, source, dtype, rank=rank, world=world)
    d2t = draft_map(cfg, heads, data.train, checkpointer) if cfg.drafter.draft_vocab_size is not None else None
    drafter, ctx_index, final_index = build_drafter(cfg, heads, d2t)
    if t.final_norm_init == "ones":
        with torch.no_grad():
            drafter.norm.weight.fill_(1.0)
    if t.markov_init == "speculators":  # RunConfig refuses it for a drafter without a Markov head
        drafter.markov_head.init_as_speculators()
    if t.init_from_target_layers is not None:
        init_from_target(drafter, cfg, heads)
    if t.init_from is not None:
        init_from_drafter(drafter, cfg, Path(t.init_from))
    if t.target_topk and data.train is not None:  # online: computed as each sequence arrives
        attach_target_topk(data.train, drafter, cfg, heads, final_index, rank=rank, world=world)
    model = DrafterWithLoss(drafter)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, t)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup=t.warmup_steps, total=t.max_steps, min_ratio=t.min_lr_ratio)
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=sched, model_parameters=params, config=deepspeed_config(cfg)
    )
    anchor_gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    state = checkpointer.resume(engine, anchor_gen) or TrainState()
    batches = mode.batches(
        cfg, data, drafter, ctx_index, final_index, state, checkpointer.directory, rank=rank, world=world
    )
    if t.compile:
        model.compile()  # DeepSpeed's engine calls it: forward and loss in one graph
    logger = init_wandb(cfg, Path(cfg.paths.output_dir), job_type="train") if rank == 0 else None
    log.info(
        "drafter: %.2fM trainable parameters, %s train / %d val sequences, %d rank(s), ZeRO %d, %s, %s",
        drafter.num_trainable_parameters() / 1e6,
        "streamed" if data.train is None else len(data.train),
        len(data.val or []),
        world,
        cfg.deepspeed.zero_optimization.stage,
        t.dtype,
        "Muon + AdamW" if t.optimizer == "muon" else "AdamW",
    )
    return TrainParts(
        cfg=cfg,
        engine=engine,
        loss=loss_settings(cfg),
        batches=batches,
        val=data.val,
        context_index=ctx_index,
        final_index=final_index,
        state=state,
        anchor_gen=anchor_gen,
        checkpointer=checkpointer,
        logger=logger,
        rank=rank,
        world=world,
        source=source,
        autocast=autocast,
    )


# --- model, loss, optimizer ----------------------------------------------------------------------
def draft_map(cfg: RunConfig, heads: TargetHeads, train_ds: Any, checkpointer: Checkpointer) -> torch.Tensor:
    """``drafter.draft_vocab_size``'s ``d2t``: the one of the tag this run resumes (so a resumed run
    drafts over the vocabulary it trained, whatever the data says now), else built from the
    training split's supervised tokens (:mod:`dspark.data.draft_vocab`, counts cached beside the shards)."""
    from dspark.checkpoint_tags import CheckpointError
    from dspark.checkpoint_weights import saved_draft_map
    from dspark.data.draft_vocab import draft_vocab_map

    size = int(cfg.drafter.draft_vocab_size)  # type: ignore[arg-type]
    if size > heads.vocab_size:
        raise ConfigError(
            f"drafter.draft_vocab_size={size}: expected an int in [1, {heads.vocab_size}] (the target's vocabulary), "
            "or null for all of it"
        )
    tag = checkpointer.resume_tag()
    if tag is not None:
        d2t = saved_draft_map(tag)
        if d2t is None or len(d2t) != size:
            has = "no draft vocabulary map (d2t)" if d2t is None else f"a {len(d2t)}-token d2t"
            raise CheckpointError(f"{tag}: its drafter has {has}, expected drafter.draft_vocab_size={size} tokens")
        log.info("draft vocabulary: %d tokens, the map of %s", len(d2t), tag)
        return d2t
    if train_ds is None:  # RunConfig refuses the key with data.mode=online
        raise ConfigError("drafter.draft_vocab_size: expected a training split to count tokens in")
    return draft_vocab_map(train_ds, size=size, vocab_size=heads.vocab_size, rule=cfg.train.supervise)


def build_drafter(
    cfg: RunConfig, heads: TargetHeads, d2t: Optional[torch.Tensor] = None
) -> tuple[DSparkDrafter, list[int], int]:
    """The model plus, for the shard layout, the context-layer indices and the final-state index.
    ``d2t``: the draft vocabulary's map when ``drafter.draft_vocab_size`` is set (:func:`draft_map`)."""
    dcfg = cfg.drafter
    captured = cfg.target.capture_layer_ids(int(heads.config["num_hidden_layers"]))
    ctx_ids = cfg.context_layer_ids()  # a subset of target.layer_ids: load_config checked it
    tok = heads.tokenizer
    mask_id = (
        dcfg.mask_token_id
        if dcfg.mask_token_id is not None
        else (tok.unk_token_id if tok.unk_token_id is not None else tok.eos_token_id)
    )
    dims = resolve_dims(
        dcfg,
        target_config=heads.config,
        vocab_size=heads.vocab_size,
        num_context_layers=len(ctx_ids),
        mask_token_id=int(mask_id),
    )
    model = DSparkDrafter(
        dcfg,
        dims,
        embed_tokens=heads.embed_tokens,
        lm_head=heads.lm_head,
        target_norm=heads.final_norm,
        target_norm_eps=heads.rms_norm_eps,
        d2t=d2t,
    )
    return model, [captured.index(i) for i in ctx_ids], len(captured) - 1


def init_from_target(model: DSparkDrafter, cfg: RunConfig, heads: TargetHeads) -> None:
    """``train.init_from_target_layers``: copy those target layers into the drafter, after
    checking that the drafter has the target's layer shape and RoPE base."""
    ids = cfg.train.init_from_target_layers
    assert ids is not None
    tc, d = heads.config, model.dims
    n_layers = int(tc["num_hidden_layers"])
    if max(ids) >= n_layers:
        raise ConfigError(f"train.init_from_target_layers={ids}: expected ids < the target's {n_layers} layers")
    theta = tc.get("rope_theta", (tc.get("rope_parameters") or {}).get("rope_theta"))
    for key, ours, theirs in (
        ("drafter.intermediate_size", d.intermediate_size, tc.get("intermediate_size")),
        ("drafter.rope_theta", cfg.drafter.rope_theta, theta),
        ("drafter.num_attention_heads", d.num_heads, tc.get("num_attention_heads")),
        ("drafter.num_key_value_heads", d.num_kv_heads, tc.get("num_key_value_heads", tc.get("num_attention_heads"))),
    ):
        if theirs is not None and float(ours) != float(theirs):
            raise ConfigError(
                f"{key}={ours}: expected the target's {theirs} to initialise from its layers "
                f"(train.init_from_target_layers={ids}); set {key}={theirs}"
            )
    model.init_layers_from([load_target_layer(heads.path, i) for i in ids])
    log.info("drafter layers initialised from target layers %s", ids)


def init_from_drafter(model: DSparkDrafter, cfg: RunConfig, path: Path) -> None:
    """``train.init_from``: the weights of a trained drafter (our export, or a speculators DSpark
    checkpoint), after checking that it is this config's drafter: sizes, context layers, block and
    heads. One :class:`ConfigError` naming the first difference."""
    from dspark.export.speculators_format import read_drafter_dir
    from dspark.export.vllm_format import CONFIG_FILE, load_weights_problem

    path = path.expanduser()
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"train.init_from={path}: {path / CONFIG_FILE} missing; expected an export or a speculators "
            "DSpark checkpoint directory"
        )
    theirs = read_drafter_dir(path)
    d, ours = cfg.drafter, model.dims
    for key, want, got in (
        ("drafter dims", ours, theirs.dims),
        ("context layer ids", cfg.context_layer_ids(), theirs.context_layer_ids),
        ("drafter.family", d.family, theirs.drafter.family),
        ("drafter.num_layers", d.num_layers, theirs.drafter.num_layers),
        ("drafter.block_size", d.block_size, theirs.drafter.block_size),
        ("drafter.sample_from_anchor", d.sample_from_anchor, theirs.drafter.sample_from_anchor),
        ("drafter.markov_rank", d.markov_rank, theirs.drafter.markov_rank),
        ("drafter.enable_confidence_head", d.enable_confidence_head, theirs.drafter.enable_confidence_head),
    ):
        if want != got:
            raise ConfigError(
                f"train.init_from={path}: its {key} is {got}, this run's is {want}; expected the same drafter"
            )
    problem = load_weights_problem(model, theirs.weights)
    if problem:
        raise ConfigError(f"train.init_from={path}: {problem}")
    log.info("drafter initialised from %s (%s)", path, theirs.provenance.get("format", "export"))


def loss_settings(cfg: RunConfig) -> LossSettings:
    """``train``'s loss fields (:class:`LossSettings`' own, none named here). ZeRO-3 turns off
    ``recompute_vocab_chunks``: its parameters are re-partitioned between forward and recompute,
    which torch's checkpoint rejects."""
    s = LossSettings(**{f.name: getattr(cfg.train, f.name) for f in fields(LossSettings)})
    return replace(s, recompute_vocab_chunks=False) if cfg.deepspeed.zero_optimization.stage == 3 else s


class DrafterWithLoss(torch.nn.Module):
    """What DeepSpeed wraps: drafter forward and loss in one ``forward``, so every parameter
    use (LM head and Markov head inside the loss included) happens inside the engine's forward,
    where ZeRO-3 gathers partitioned weights. ``loss``: this step's loss settings, handed in by
    the trainer with every call (:meth:`LossSettings.weights_at`: the CE schedule)."""

    def __init__(self, drafter: DSparkDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, loss: LossSettings) -> LossOutput:
        out = self.drafter(batch.input_ids, batch.context_states, anchors)
        return dspark_loss(
            self.drafter,
            out,
            input_ids=batch.input_ids,
            final_states=batch.final_states,
            anchor_positions=anchors,
            valid_anchors=valid,
            loss_mask=batch.loss_mask,
            lengths=batch.lengths,
            cfg=loss,
            topk_ids=batch.topk_ids,
            topk_probs=batch.topk_probs,
        )


def deepspeed_config(cfg: RunConfig) -> dict[str, Any]:
    """The dict for ``deepspeed.initialize``: ZeRO preset + batch, clipping and precision."""
    ds = cfg.deepspeed.to_dict()
    t = cfg.train
    ds.update(
        {
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": t.grad_accum_steps,
            "gradient_clipping": t.grad_clip,
            "bf16": {"enabled": t.dtype == "bfloat16"},
            "fp16": {"enabled": t.dtype == "float16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
    )
    return ds


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup then cosine decay to ``min_ratio`` of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
