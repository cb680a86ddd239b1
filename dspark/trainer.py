"""Stage 2: train the DSpark drafter on hidden-state shards with DeepSpeed.

Single process (``python train.py ...``), ``torchrun``/``deepspeed`` launchers and Slurm all go
through :func:`train`. DeepSpeed owns data parallelism, ZeRO, precision, gradient accumulation
and clipping; this module owns the cadence: step, log, validate, checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from dspark.batching import Batch, DataPosition, RankBatches, collate
from dspark.calibration import calibration_sums, expected_calibration_error
from dspark.checkpoint import (
    CheckpointError,
    checkpoint_config_differences,
    latest_tag,
    lock_checkpoint_dir,
    publish_tag,
    remove_unpublished_tag,
    tag_bytes,
    tag_name,
)
from dspark.core.config import TORCH_DTYPES, ConfigError, RunConfig, TargetConfig, load_config
from dspark.core.files import (
    DiskFullError,
    atomic_write_text,
    disk_full_message,
    file_sha256,
    free_bytes,
    free_port,
    is_disk_full,
    reporting_disk_full,
)
from dspark.core.shard_format import DatasetError
from dspark.core.stream import SequenceSource
from dspark.core.target import TargetHeads, load_target_layer
from dspark.core.wandb_run import init_wandb
from dspark.loss import LossConfig, LossOutput, dspark_loss
from dspark.model import DSparkDrafter, resolve_dims, sample_anchors
from dspark.online import (
    OnlineBatches,
    SequenceList,
    StreamMeta,
    check_source,
    row_to_sequence,
    shared_val_rows,
    stream_meta,
)
from dspark.shards import ShardDataset, ShardSequence, check_dataset, require_dataset
from dspark.target_topk import SequenceTopK, TargetTopK, head_fingerprint, sequence_topk

log = logging.getLogger(__name__)


#: A JIT build of DeepSpeed's shared-memory op takes about a minute here; a build lock older
#: than this was left by a killed build (torch's lock file records no owner to ask).
STALE_BUILD_LOCK_S = 600.0


def prepare_deepspeed_cpu_ops(
    world_size: int, *, stale_after_s: float = STALE_BUILD_LOCK_S, poll_s: float = 2.0
) -> None:
    """Keep DeepSpeed's CPU start-up from waiting forever on a build lock.

    On CPU, ``deepspeed.init_distributed`` JIT-builds its shared-memory all-reduce op under
    torch's lock file ``<torch_extensions>/<py>_cpu/deepspeed_shm_comm/lock``. A process killed
    during that build (Ctrl-C, a timeout, a preemption) leaves the file behind, and torch then
    waits on it forever, printing nothing. Here:

    * one process (``python train.py``) has nobody to talk to: the op is marked unavailable, so
      nothing is built or waited for;
    * several ranks need the op: a lock is waited for at most until it is ``stale_after_s`` old
      (no build takes that long), then removed with a warning that names it.
    """
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    if world_size <= 1:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # read by deepspeed.comm.torch.build_shm_op
        return
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(builder.name, verbose=False)) / "lock"
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after_s:
            lock.unlink(missing_ok=True)
            log.warning(
                "removed %s: a build lock %.0f s old, left by a build that was killed (no build takes %.0f s)",
                lock,
                age,
                stale_after_s,
            )
            return
        if not told:
            log.info(
                "waiting for %s (another process is building DeepSpeed's %s op); it is removed once %.0f s old",
                lock,
                builder.name,
                stale_after_s,
            )
            told = True
        time.sleep(min(poll_s, stale_after_s - age))


def init_distributed(timeout_s: float = 1800) -> tuple[int, int]:
    """Join the launcher's process group (torchrun/deepspeed/srun set RANK etc.), or create a
    one-process group for a plain ``python train.py`` on a free port, which is not exported:
    child processes must not inherit a port this process holds.

    Bounded (``train.dist_timeout_s``): joining waits at most ``timeout_s`` for every rank, then
    :class:`~dspark.core.waits.WaitTimedOut` names the rendezvous (MASTER_ADDR:MASTER_PORT,
    WORLD_SIZE, this RANK) and what to check; each collective afterwards has the same bound (a
    rank that died or hangs ends the others with torch's timeout error instead of a hang)."""
    import datetime

    import deepspeed
    import torch.distributed as dist

    from dspark.core.waits import WaitTimedOut

    prepare_deepspeed_cpu_ops(int(os.environ.get("WORLD_SIZE", "1")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:  # one process: DeepSpeed insists on LOCAL_RANK; harmless for children
        os.environ.setdefault("LOCAL_RANK", "0")  # also when a group exists already (vLLM's, of an earlier job)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            try:
                deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
                if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                    raise
                env = {k: os.environ.get(k, "?") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
                raise WaitTimedOut(
                    f"rank {env['RANK']}: the {env['WORLD_SIZE']} ranks did not all meet at {env['MASTER_ADDR']}:"
                    f"{env['MASTER_PORT']} within train.dist_timeout_s={timeout_s:g} s: "
                    "check that every rank was started (all nodes of the job), that MASTER_ADDR is reachable "
                    "from this node and MASTER_PORT free and open there, then rerun the same command"
                ) from err
        else:
            port = free_port()
            deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size()


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


HISTORY_WINDOW = 1000
"""Steps of per-step history (loss, sequence ids) a checkpoint keeps: an audit trail of bounded
size (the K3 preset consumes about 1.9M sequences); the whole data order is in ``data_digest``."""


@dataclass
class TrainState:
    step: int = 0
    data: DataPosition = field(default_factory=DataPosition)
    history: list[dict] = field(default_factory=list)
    """The last HISTORY_WINDOW steps: {"step", "loss", "seq_ids"}."""
    data_digest: str = ""
    """Hash chain over every consumed sequence id in order: equal digests, equal data order."""
    predictions: int = 0
    """Supervised predictions consumed so far, all ranks (the x axis of a scaling curve)."""
    tokens: int = 0
    """Sequence tokens consumed by training steps so far, all ranks (padding excluded)."""
    train_seconds: float = 0.0
    """Wall-clock seconds spent in training steps (validation and checkpoints excluded)."""
    validations: list[dict] = field(default_factory=list)
    """Every validation: {"step", "predictions", "train_seconds", **metrics}; also written to
    ``<checkpoint_dir>/validation.jsonl`` for plots without W&B."""

    def record(self, loss: float, seq_ids: list[str]) -> None:
        self.history = [*self.history[-(HISTORY_WINDOW - 1) :], {"step": self.step, "loss": loss, "seq_ids": seq_ids}]
        self.data_digest = hashlib.sha256((self.data_digest + "|" + ",".join(seq_ids)).encode()).hexdigest()


def check_shards_match_target(ds: ShardDataset, target: TargetConfig, heads: TargetHeads) -> None:
    """Refuse shards made for another target before the first step."""
    m, where = ds.manifest, ds.directory / "manifest.json"
    expected = target.capture_layer_ids(int(heads.config["num_hidden_layers"]))
    check_dataset(ds, expect_layer_ids=expected, expect_hidden_size=heads.hidden_size)
    tok = heads.path / "tokenizer.json"
    tok_sha = file_sha256(tok) if tok.is_file() else None
    if tok_sha is not None and m.tokenizer_sha256 != tok_sha:
        raise DatasetError(
            f"{where}: field 'tokenizer_sha256' is {m.tokenizer_sha256[:12]}..., the target's tokenizer.json hashes "
            f"to {tok_sha[:12]}..., expected the same tokenizer; extract with this target into a new data.shards_dir "
            "(stages=[extract,train])"
        )


def build_drafter(cfg: RunConfig, heads: TargetHeads) -> tuple[DSparkDrafter, list[int], int]:
    """The model plus, for the shard layout, the context-layer indices and the final-state index."""
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


def loss_config(cfg: RunConfig) -> LossConfig:
    t = cfg.train
    zero3 = cfg.deepspeed.zero_optimization.stage == 3
    return LossConfig(
        ce_weight=t.ce_weight,
        tv_weight=t.tv_weight,
        confidence_weight=t.confidence_weight,
        position_decay=t.position_decay,
        recompute_chunks=t.recompute_vocab_chunks and not zero3,
    )


def ce_weight_at(t, step: int) -> float:  # noqa: ANN001 - TrainConfig
    """The CE weight at ``step`` (0-based) under ``train.ce_weight_start``'s linear schedule."""
    if t.ce_weight_start is None:
        return t.ce_weight
    span = max(1, round(t.ce_anneal_frac * t.max_steps))
    frac = min(1.0, step / span)
    return t.ce_weight_start + (t.ce_weight - t.ce_weight_start) * frac


class DrafterWithLoss(torch.nn.Module):
    """What DeepSpeed wraps: drafter forward and loss in one ``forward``, so every parameter
    use (LM head and Markov head inside the loss included) happens inside the engine's forward,
    where ZeRO-3 gathers partitioned weights."""

    def __init__(self, drafter: DSparkDrafter, lcfg: LossConfig):
        super().__init__()
        self.drafter, self.lcfg = drafter, lcfg

    def forward(self, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor) -> LossOutput:
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
            cfg=self.lcfg,
            topk_ids=batch.topk_ids,
            topk_probs=batch.topk_probs,
        )


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def clock(seconds: float) -> str:
    """``h:mm:ss`` for a log line."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress(step: int, max_steps: int, *, start_step: int, elapsed: float) -> str:
    """``step N/M | elapsed h:mm:ss | eta h:mm:ss``: the ETA from this process's own pace (steps
    since it started or resumed, validation and checkpoints included)."""
    done = step - start_step
    eta = clock(elapsed / done * (max_steps - step)) if done > 0 else "?"
    return f"step {step}/{max_steps} | elapsed {clock(elapsed)} | eta {eta}"


def provenance(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint was made by: resolved config, git SHA, versions, argv."""
    import deepspeed
    import transformers

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        sha = ""
    return {
        "config": cfg.to_dict(),
        "git_sha": sha,
        "argv": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },
    }


class Preempted(SystemExit):
    """Training stopped on SIGTERM/SIGUSR1 (a Slurm preemption or time limit, ``scancel``, a
    launcher passing on Ctrl-C) after saving a checkpoint; the same command resumes it. A
    SystemExit with the shell's code for that signal (128 + signum), so the later stages of the
    main job do not run and Slurm's ``afterok`` dependents keep waiting."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.message = (
            f"{signal.Signals(signum).name} at step {step}: checkpoint {checkpoint} saved; "
            f"rerun the same command to resume from it"
        )
        super().__init__(128 + signum)


#: The signals that mean "save and stop": Slurm sends SIGTERM before killing a job step (and
#: to a requeued job), ``#SBATCH --signal=USR1@...`` warns of the time limit.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Trainer:
    def __init__(self, cfg: RunConfig | DictConfig, heads: TargetHeads, source: Optional[SequenceSource] = None):
        """``source``: where ``data.mode=online`` reads sequences from (``data_tools.online``)."""
        cfg = load_config(cfg)
        self.cfg, self.t = cfg, cfg.train
        self.source, self.batches = source, None
        self.rank, self.world = init_distributed(self.t.dist_timeout_s)
        self.ckpt_dir = Path(self.t.checkpoint_dir).expanduser()
        if cfg.data.mode == "online":
            check_online_ranks(source, self.rank)
        else:
            require_dataset(cfg.data.shards_dir)  # before the lock: a run without data writes nothing
        self._lock = lock_checkpoint_dir(self.ckpt_dir) if self.rank == 0 else None
        try:
            self._build(cfg, heads)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: RunConfig, heads: TargetHeads) -> None:
        import deepspeed

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        target = cfg.target
        states_dtype = TORCH_DTYPES[self.t.dtype]  # what states reach the drafter in (fp8: on the device)
        online = cfg.data.mode == "online"
        if online:
            self.stream = stream_meta(self.source, self.rank, self.world)
            check_source(
                self.stream,
                expect_layer_ids=target.capture_layer_ids(int(heads.config["num_hidden_layers"])),
                expect_hidden_size=heads.hidden_size,
            )
            self.train_ds, self.val_ds = None, online_val(self.source, self.stream, self.rank, self.world, states_dtype)
        else:
            shards = Path(cfg.data.shards_dir).expanduser()
            self.train_ds = ShardDataset(shards, "train", states_dtype=states_dtype, keep_fp8=True)
            check_shards_match_target(self.train_ds, target, heads)
            self.val_ds = (
                ShardDataset(shards, "val", states_dtype=states_dtype, keep_fp8=True)
                if any(s.split == "val" and s.rows for s in self.train_ds.manifest.shards)
                else None
            )
        model, self.ctx_index, self.final_index = build_drafter(cfg, heads)
        if self.t.init_from_target_layers is not None:
            init_from_target(model, cfg, heads)
        if self.t.target_topk and not online:
            self._attach_target_topk(model, heads)
        self.dtype = TORCH_DTYPES[self.t.dtype]
        self.lcfg = loss_config(cfg)
        model = DrafterWithLoss(model, self.lcfg)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=self.t.lr,
            weight_decay=self.t.weight_decay,
            betas=(0.9, 0.95),
            fused=self.t.fused_optimizer or None,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_lambda(s, warmup=self.t.warmup_steps, total=self.t.max_steps, min_ratio=self.t.min_lr_ratio),
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=sched, model_parameters=params, config=deepspeed_config(cfg)
        )
        self.state = TrainState()
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.rank)
        self._maybe_resume()
        self.batches = (
            self._online_batches(model.drafter, states_dtype)
            if online
            else RankBatches(
                self.train_ds,
                rank=self.rank,
                world_size=self.world,
                micro_batch=self.t.micro_batch_size,
                seed=cfg.seed,
                context_index=self.ctx_index,
                final_index=self.final_index,
                max_len=self.t.max_seq_len,
                position=self.state.data,
            )
        )
        self.wandb = self._init_wandb() if self.rank == 0 else None
        log.info(
            "drafter: %.2fM trainable parameters, %s train / %d val sequences, %d rank(s), ZeRO %d, %s",
            self.model.num_trainable_parameters() / 1e6,
            "streamed" if online else len(self.train_ds),
            len(self.val_ds or []),
            self.world,
            cfg.deepspeed.zero_optimization.stage,
            self.t.dtype,
        )

    @property
    def model(self) -> DSparkDrafter:
        return self.engine.module.drafter

    def _online_batches(self, drafter: DSparkDrafter, states_dtype: torch.dtype) -> OnlineBatches:
        """``data.mode=online``: micro-batches from the source's rolling window, from the resumed
        position's prompt cursor; ``train.target_topk`` is computed as each sequence arrives."""
        topk = None
        if self.t.target_topk:
            device = drafter.lm_head.weight.device

            def topk(seq: ShardSequence) -> SequenceTopK:
                return sequence_topk(
                    seq.loss_mask,
                    seq.hidden_states,
                    scales=seq.scales,
                    k=self.t.target_topk,
                    rule=self.t.supervise,
                    target_logits=lambda rows: drafter.target_logits(rows.to(device)).cpu(),
                    final_index=self.final_index,
                )

        return OnlineBatches(
            self.source,
            meta=self.stream,
            micro_batch=self.t.micro_batch_size,
            new_per_batch=self.cfg.new_per_micro_batch(),
            window_size=self.cfg.data.online.window_size,
            seed=self.cfg.seed,
            context_index=self.ctx_index,
            final_index=self.final_index,
            max_len=self.t.max_seq_len,
            dtype=states_dtype,
            position=self.state.data,
            log_dir=self.ckpt_dir,
            target_topk=topk,
            rank=self.rank,
            world_size=self.world,
        )

    def _attach_target_topk(self, model: DSparkDrafter, heads: TargetHeads) -> None:
        """``train.target_topk``: the training split's target distributions, computed once (each
        rank a share of the missing shards) and attached to every sequence the dataset reads."""
        import torch.distributed as dist

        if torch.cuda.is_available():  # the frozen head on the GPU (DeepSpeed puts the model there anyway)
            model.to(torch.device("cuda", torch.cuda.current_device()))
        device = model.lm_head.weight.device

        def target_logits(rows: torch.Tensor) -> torch.Tensor:
            return model.target_logits(rows.to(device)).cpu()

        cache = TargetTopK(
            self.train_ds,
            k=self.t.target_topk,
            rule=self.t.supervise,
            target_logits=target_logits,
            head_id=head_fingerprint(heads.lm_head, heads.final_norm),
            final_index=self.final_index,
            rank=self.rank,
            world_size=self.world,
        )
        dist.barrier()
        self.train_ds.target_topk = cache.load()

    # --- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> tuple[dict[str, float], list[str]]:
        """One optimizer step over grad_accum_steps micro batches; returns the step's scalars (loss
        terms averaged over its micro batches) and the ids of the sequences it consumed."""
        t0 = time.perf_counter()
        timing = {"data_s": 0.0, "tokens": 0.0}
        per_micro: list[dict[str, float]] = []
        seq_ids: list[str] = []
        predictions = 0
        norm = None
        for _ in range(self.t.grad_accum_steps):
            td = time.perf_counter()
            batch = self.batches.next()
            seq_ids += batch.seq_ids
            if self.t.supervise == "all":  # every token after the first (padding excluded)
                batch.loss_mask = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
                batch.loss_mask[:, 0] = False
            anchors, valid = sample_anchors(
                batch.loss_mask,
                batch.lengths,
                self.t.anchors_per_seq,
                self.anchor_gen,
                input_ids=batch.input_ids,
                copy_boost=self.t.copy_anchor_boost,
            )
            batch = batch.to(self.engine.device, self.dtype)
            self.engine.module.lcfg = replace(self.lcfg, ce_weight=ce_weight_at(self.t, self.state.step))
            timing["data_s"] += time.perf_counter() - td
            out = self.engine(batch, anchors.to(self.engine.device), valid.to(self.engine.device))
            if not torch.isfinite(out.loss):
                raise FloatingPointError(
                    f"non-finite loss {out.loss.item()} at step {self.state.step + 1}, sequences {batch.seq_ids}"
                )
            self.engine.backward(out.loss)
            norm = self._grad_norm_before_step()
            self.engine.step()
            timing["tokens"] += batch.num_tokens
            per_micro.append(self._scalars(out))
            predictions += out.num_positions
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        metrics = {k: sum(m[k] for m in per_micro) / len(per_micro) for k in per_micro[0]}
        metrics.update(
            timing,
            ce_weight=self.engine.module.lcfg.ce_weight,
            lr=self.engine.get_lr()[0],
            grad_norm=float(norm) if norm is not None else float("nan"),
        )
        metrics["step_s"] = time.perf_counter() - t0
        metrics["predictions"] = predictions
        return metrics, seq_ids

    def _grad_norm_before_step(self) -> Optional[float]:
        """DeepSpeed reports the global grad norm from its ZeRO/mixed-precision optimizers only;
        with ZeRO 0 in fp32 the gradients are whole on every rank, so measure them here."""
        if (
            self.engine.zero_optimization()
            or self.t.dtype != "float32"
            or not self.engine.is_gradient_accumulation_boundary()
        ):
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    @staticmethod
    def _scalars(out: LossOutput) -> dict[str, float]:
        """Loss terms and acceptance per position. ``accept_pos_k``: the first k drafts all match
        (unconditional, as vLLM counts acceptance; tau = 1 + their sum); ``accept_cond_pos_k``:
        draft k matches given a correct prefix (teacher-forced); ``accept_prob_pos_k``: 1 - TV."""
        d = {
            "loss": out.loss.item(),
            "ce": float(out.ce),
            "tv": float(out.tv),
            "confidence_bce": float(out.confidence_bce),
            "tau": out.tau,
        }
        for k in range(len(out.accept_per_position)):
            d[f"accept_pos_{k + 1}"] = float(out.accept_per_position[k])
            d[f"accept_cond_pos_{k + 1}"] = float(out.accept_cond_per_position[k])
            d[f"accept_prob_pos_{k + 1}"] = float(out.accept_prob_per_position[k])
        return d

    # --- the loop -----------------------------------------------------------------------------
    def train(self, *, until: Optional[int] = None) -> TrainState:
        """Train to ``train.max_steps`` (or stop early at step ``until``, as a preempted job would);
        the checkpoint directory is released at the end."""
        previous = self._catch_preemption()
        try:
            return self._train(until)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def _catch_preemption(self) -> dict[int, Any]:
        """Note SIGTERM/SIGUSR1 instead of dying mid-step; the loop saves and stops at the next
        step boundary. Only the main thread can install handlers (tests may train elsewhere)."""
        self._signal = 0
        if threading.current_thread() is not threading.main_thread():
            return {}

        def note(signum: int, _frame: Any) -> None:
            self._signal = signum

        return {sig: signal.signal(sig, note) for sig in PREEMPT_SIGNALS}

    def _preempted(self) -> int:
        """The signal that stops the run (0 = none), agreed by every rank: a rank that got none
        must still stop with the others, at the same step."""
        sig = getattr(self, "_signal", 0)
        if self.world == 1:
            return sig
        import torch.distributed as dist

        flag = torch.tensor([sig], dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def close(self) -> None:
        """Stop an online source; release the checkpoint directory (the OS would at process exit anyway)."""
        if self.source is not None:
            self.source.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _progress_bar(self) -> Any:
        """A tqdm bar on an interactive terminal (rank 0); logs and batch jobs get the log lines."""
        if self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.t.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True)

    def _train(self, until: Optional[int]) -> TrainState:
        bar = self._progress_bar()
        try:
            return self._train_loop(until, bar)
        finally:
            if bar is not None:
                bar.close()

    def _train_loop(self, until: Optional[int], bar: Any) -> TrainState:
        max_steps, t_start = self.t.max_steps, time.perf_counter()
        self._start_step = self.state.step  # the ETA's pace counts this process's steps only
        while self.state.step < min(max_steps, until or max_steps):
            m, seq_ids = self.train_step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", pred_s=f"{m['predictions'] * self.world / m['step_s']:.0f}")
            self.state.step += 1
            self.state.data = self.batches.pos
            self.state.record(m["loss"], seq_ids)
            self.state.predictions += int(m["predictions"]) * self.world
            self.state.tokens += int(m["tokens"]) * self.world
            self.state.train_seconds += m["step_s"]
            if self.state.step % self.t.log_every == 0 or self.state.step == max_steps:
                self._log_train(m, time.perf_counter() - t_start)
            step = self.state.step
            if self.val_ds is not None and (
                step % self.t.eval_every == 0 or step == max_steps or step in self.t.eval_at_steps
            ):
                self._record_validation(self.evaluate())
            saved = self.state.step % self.t.save_every == 0 or self.state.step == max_steps
            if saved:
                self.save()
            sig = self._preempted()
            if sig:
                path = self.ckpt_dir / tag_name(step) if saved else self.save()
                if self.wandb is not None:
                    self.wandb.finish(exit_code=128 + sig)
                stop = Preempted(sig, step, path)
                log.warning("%s", stop.message)
                raise stop
        if self.wandb is not None and self.state.step >= max_steps:
            self.wandb.finish()
        return self.state

    def _log_train(self, m: dict[str, float], elapsed: float) -> None:
        tok_s = m["tokens"] / m["step_s"]
        log.info(
            "%s | loss %.4f (ce %.3f tv %.3f conf %.3f) | tau %.2f | lr %.2e | grad %.3f | %.0f tok/s "
            "%.0f pred/s | data %.1f%% | mem %.2f GB",
            progress(self.state.step, self.t.max_steps, start_step=getattr(self, "_start_step", 0), elapsed=elapsed),
            m["loss"],
            m["ce"],
            m["tv"],
            m["confidence_bce"],
            m["tau"],
            m["lr"],
            m["grad_norm"],
            tok_s * self.world,
            m["predictions"] * self.world / m["step_s"],
            100 * m["data_s"] / m["step_s"],
            peak_memory_gb(),
        )
        scalars = {k: v for k, v in m.items() if k not in ("tokens", "data_s", "step_s", "predictions")}
        scalars.update(
            tokens_per_s=tok_s * self.world,
            predictions_per_s=m["predictions"] * self.world / m["step_s"],
            predictions=self.state.predictions,
            data_wait_frac=m["data_s"] / m["step_s"],
            peak_mem_gb=peak_memory_gb(),
            elapsed_s=elapsed,
        )
        online = self.batches.stats() if isinstance(self.batches, OnlineBatches) else None
        if online is not None:  # the engine's side of the stream (rank 0)
            log.info(
                "online: %d sequences from the engine, %.0f tok/s extracted, producer blocked %.1f s on a full buffer",
                online["sequences"],
                online["tokens_per_s"],
                online["blocked_s"],
            )
            scalars.update({f"online_{k}": v for k, v in online.items()})
        self._log({f"train/{k}": v for k, v in scalars.items()})

    def _record_validation(self, res: dict[str, float]) -> None:
        s = self.state
        s.validations.append({"step": s.step, "predictions": s.predictions, "train_seconds": s.train_seconds, **res})
        self._log({f"val/{k}": v for k, v in res.items()} | {"val/predictions": s.predictions})
        if self.rank == 0:  # the whole list each time: a resumed run rewrites what its checkpoint knows
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(v) + "\n" for v in s.validations)
            with reporting_disk_full(
                self.ckpt_dir, what="validation.jsonl", needed=len(text), todo=self._disk_full_todo()
            ):
                atomic_write_text(self.ckpt_dir / "validation.jsonl", text)

    def _log(self, metrics: dict[str, float]) -> None:
        if self.wandb is not None:
            self.wandb.log(metrics, step=self.state.step)

    @torch.no_grad()
    def evaluate(self, ds: Optional[ShardDataset] = None) -> dict[str, float]:
        """Every sequence of ``ds`` (default: validation) with fixed anchors: loss terms,
        per-position acceptance, tau estimate and confidence calibration (ECE). Each rank takes
        every world_size-th sequence; the sums are all-reduced, so every rank gets the result."""
        import torch.distributed as dist

        ds = ds or self.val_ds
        assert ds is not None
        self.engine.eval()
        self.engine.module.lcfg = self.lcfg  # the recipe's weights, whatever the schedule is at
        gen = torch.Generator().manual_seed(12345 + self.rank)
        mine = list(range(self.rank, len(ds), self.world))
        names = self._scalar_names()
        sums, n, blocks = torch.zeros(len(names), dtype=torch.float64), 0.0, 0.0
        calib = calibration_sums(torch.empty(0), torch.empty(0))
        for i in range(0, len(mine), self.t.micro_batch_size):
            seqs = [ds[j] for j in mine[i : i + self.t.micro_batch_size]]
            batch = collate(
                seqs, context_index=self.ctx_index, final_index=self.final_index, max_len=self.t.max_seq_len
            )
            anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, self.t.anchors_per_seq, gen)
            out = self.engine(
                batch.to(self.engine.device, self.dtype), anchors.to(self.engine.device), valid.to(self.engine.device)
            )
            scalars = self._scalars(out)
            sums += torch.tensor([scalars[k] * out.num_positions for k in names], dtype=torch.float64)
            n += out.num_positions
            blocks += float(valid.sum())  # drafted blocks: valid anchors (their first label is an answer token)
            calib += calibration_sums(out.confidence, out.confidence_target)
        self.engine.train()
        flat = torch.cat([sums, torch.tensor([n, blocks], dtype=torch.float64), calib.flatten()]).to(self.engine.device)
        if self.world > 1:
            dist.all_reduce(flat)
        flat = flat.cpu()
        total = float(flat[len(names)])
        res = {k: float(v) / max(total, 1) for k, v in zip(names, flat[: len(names)])}
        res["tau"] = 1.0 + sum(res[f"accept_pos_{k}"] for k in range(1, self.cfg.drafter.block_size + 1))
        res["confidence_ece"] = expected_calibration_error(flat[len(names) + 2 :].view(-1, 3))
        # How many drafted blocks (anchors) the acceptance shares are counted over (``total`` above
        # counts supervised predictions, up to block_size per block): the n of their standard errors.
        res["blocks"] = int(flat[len(names) + 1])
        log.info(
            "val step %d | loss %.4f | tau %.3f | acceptance %s | confidence ECE %.3f",
            self.state.step,
            res["loss"],
            res["tau"],
            " ".join(f"{res[f'accept_pos_{k}']:.2f}" for k in range(1, self.cfg.drafter.block_size + 1)),
            res["confidence_ece"],
        )
        return res

    def _scalar_names(self) -> list[str]:
        """The keys of :meth:`_scalars`, in the order ranks all-reduce them."""
        ks = range(1, self.cfg.drafter.block_size + 1)
        return [
            "loss",
            "ce",
            "tv",
            "confidence_bce",
            "tau",
            *(f"accept_{w}pos_{k}" for k in ks for w in ("", "cond_", "prob_")),
        ]

    # --- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        import torch.distributed as dist

        tag = tag_name(self.state.step)
        if isinstance(self.batches, OnlineBatches) and self.rank == 0:
            self.batches.flush_log()  # before the tag: a resume cuts what a later tag did not keep
        client = {
            "context_layer_ids": self.cfg.context_layer_ids(),
            "step": self.state.step,
            "data": asdict(self.state.data),
            "anchor_rng": self.anchor_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "history": self.state.history,
            "data_digest": self.state.data_digest,
            "predictions": self.state.predictions,
            "tokens": self.state.tokens,
            "train_seconds": self.state.train_seconds,
            "validations": self.state.validations,
            "drafter": asdict(self.model.cfg),
            "dims": asdict(self.model.dims),
        }
        self._write_tag(tag, client, needed=self._make_room_for(tag))
        dist.barrier()  # every rank's shards are written
        if self.rank == 0:
            self._publish(tag)
        dist.barrier()
        log.info("saved checkpoint %s", self.ckpt_dir / tag)
        return self.ckpt_dir / tag

    def _write_tag(self, tag: str, client: dict[str, Any], *, needed: int) -> None:
        """DeepSpeed's save of ``tag`` (not yet named by ``latest``); when it fails, what it wrote
        is removed, and a full disk is said so (DeepSpeed's torch.save reports only
        ``unexpected pos ...``)."""
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client, save_latest=False)
        except Exception as e:
            full = is_disk_full(e, self.ckpt_dir)  # before the half tag, which filled the disk, is removed
            written = tag_bytes(self.ckpt_dir / tag)
            if self.rank == 0:
                remove_unpublished_tag(self.ckpt_dir, tag)
            if full:
                raise DiskFullError(self._disk_full(tag, max(needed, written))) from e
            raise

    def _publish(self, tag: str) -> None:
        run = provenance(self.cfg)
        size = len(json.dumps(run, indent=2, default=str))
        with reporting_disk_full(self.ckpt_dir, what=f"{tag}/run.json", needed=size, todo=self._disk_full_todo()):
            publish_tag(self.ckpt_dir, tag, run)

    def _make_room_for(self, tag: str) -> int:
        """Before DeepSpeed writes ``tag``: remove what a killed or failed save of it left, and
        refuse the save (every rank, on rank 0's numbers) when the checkpoint directory has less
        room than the tag needs. Returns that estimate, in bytes."""
        import torch.distributed as dist

        if self.rank == 0:
            freed = remove_unpublished_tag(self.ckpt_dir, tag)
            if freed:
                log.warning("removed %s: %d bytes left by a save that did not finish", self.ckpt_dir / tag, freed)
        numbers = torch.tensor([self._checkpoint_bytes(), free_bytes(self.ckpt_dir)], dtype=torch.int64)
        if self.world > 1:
            numbers = numbers.to(self.engine.device)
            dist.broadcast(numbers, src=0)
        needed, free = (int(n) for n in numbers.cpu())
        if free < needed:
            raise DiskFullError(self._disk_full(tag, needed))
        return needed

    def _checkpoint_bytes(self) -> int:
        """About what a tag takes: the last complete one's size, or before there is one the
        module's tensors plus AdamW's two moments (a lower bound: ZeRO adds fp32 master copies)."""
        last = latest_tag(self.ckpt_dir)
        if last is not None and last.is_dir():
            return tag_bytes(last)
        module = {t.data_ptr(): t.numel() * t.element_size() for t in self.engine.module.state_dict().values()}
        trainable = sum(p.numel() for p in self.engine.module.parameters() if p.requires_grad)
        return sum(module.values()) + 2 * 4 * trainable

    def _disk_full(self, tag: str, needed: int) -> str:
        return disk_full_message(self.ckpt_dir, f"checkpoint {tag}", needed, self._disk_full_todo())

    def _disk_full_todo(self) -> str:
        last = latest_tag(self.ckpt_dir)
        resume = f"resume from {last.name}, the last complete tag" if last else "start (no tag is complete yet)"
        return (
            f"free space there (tags older than the one 'latest' names can go) or set train.checkpoint_dir "
            f"elsewhere, then rerun the same command to {resume}"
        )

    def _maybe_resume(self) -> None:
        mode = self.t.resume
        if mode == "never":
            return
        if mode == "auto":
            tag_dir = latest_tag(self.ckpt_dir)
            if tag_dir is None:
                return
            path, tag = self.ckpt_dir, None  # DeepSpeed reads latest itself
        else:
            tag_dir = Path(mode)
            path, tag = tag_dir.parent, tag_dir.name
        self._check_resume_config(tag_dir)
        loaded, client = self.engine.load_checkpoint(str(path), tag=tag)
        if loaded is None:
            raise CheckpointError(
                f"{path}: no DeepSpeed checkpoint {'(latest)' if tag is None else tag} to resume from, expected a "
                "tag directory written by the trainer; pass train.resume=never to start over"
            )
        self.state = TrainState(
            step=client["step"],
            data=DataPosition(**client["data"]),
            history=client["history"],
            data_digest=client.get("data_digest", ""),
            predictions=client.get("predictions", 0),
            tokens=client.get("tokens", 0),
            train_seconds=client.get("train_seconds", 0.0),
            validations=client.get("validations", []),
        )
        self.anchor_gen.set_state(client["anchor_rng"])
        torch.set_rng_state(client["torch_rng"])
        random.setstate(client["python_rng"])
        log.info(
            "resumed from %s at step %d (epoch %d, position %d)",
            loaded,
            self.state.step,
            self.state.data.epoch,
            self.state.data.index,
        )

    def _check_resume_config(self, tag_dir: Path) -> None:
        """Refuse to resume a checkpoint of a different drafter (DeepSpeed would fail later on a
        tensor shape, or not at all): name the fields and the way out."""
        diffs = checkpoint_config_differences(tag_dir, self.cfg)
        if diffs:
            raise CheckpointError(
                f"{tag_dir}: this checkpoint is of another drafter ({'; '.join(diffs)}). Train this one "
                f"under its own name (train.run_name=...), start over with train.resume=never, or "
                f"point train.checkpoint_dir elsewhere"
            )

    def _init_wandb(self):  # noqa: ANN202
        return init_wandb(self.cfg, Path(self.cfg.paths.output_dir), job_type="train")


def train(cfg: RunConfig, heads: TargetHeads, source: Optional[SequenceSource] = None) -> TrainState:
    trainer = Trainer(cfg, heads, source)
    return trainer.train()


def check_online_ranks(source: Optional[SequenceSource], rank: int) -> None:
    """``data.mode=online``: rank 0 reads the stream (the engine train.py starts, or the link to
    the producer on other nodes) and hands the other ranks their share."""
    if rank == 0 and source is None:
        raise ConfigError(
            "data.mode=online: no sequence source on rank 0, expected the engine or link that train.py starts "
            "(python train.py data.mode=online stages=[train])"
        )


def online_val(
    source: Optional[SequenceSource], meta: StreamMeta, rank: int, world: int, dtype: torch.dtype
) -> Optional[SequenceList]:
    """The online run's validation set: the val split's sequences, generated once, in memory on
    every rank (validation shards them)."""
    kw = dict(store_dtype=meta.store_dtype, n_layers=len(meta.layer_ids), hidden=meta.hidden_size, dtype=dtype)
    seqs = [row_to_sequence(r, **kw) for r in shared_val_rows(source, rank, world)]
    return SequenceList(seqs) if seqs else None
