"""Stage 2's loop: step, log, validate, checkpoint, over the parts it is given.

:class:`Trainer` runs on a :class:`TrainParts`: batches, the DeepSpeed engine around the drafter
and its loss, the run's state, the checkpointer and a logger. :func:`dspark.recipe.build_trainer`
builds them from the config; a test or a benchmark can hand in its own. DeepSpeed owns data
parallelism, ZeRO, precision, gradient accumulation and clipping; this module owns the cadence.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from dspark.calibration import calibration_sums, expected_calibration_error
from dspark.checkpoint import Checkpointer, TrainState
from dspark.checkpoint_tags import tag_name
from dspark.config import TORCH_DTYPES, LossSettings, RunConfig
from dspark.data.batching import Batch, DataPosition, collate
from dspark.data.colocated import ColocatedDataset
from dspark.data.online import OnlineBatches
from dspark.data.shards import ShardSequence
from dspark.data.target_topk import supervised_tokens
from dspark.flops import StepFlops, TargetShape, peak_flops, step_flops
from dspark.formats.stream import SequenceSource
from dspark.loss import scalar_names
from dspark.model import DSparkDrafter, sample_anchors
from dspark.precision import Autocast

log = logging.getLogger(__name__)


class Batches(Protocol):
    """Where training batches come from (:class:`~dspark.data.batching.RankBatches` over shards,
    :class:`~dspark.data.online.OnlineBatches` over the stream): the next micro batch of this rank,
    and the position a resumed run continues from."""

    pos: DataPosition

    def next(self) -> Batch: ...


class Sequences(Protocol):
    """A validation set: ``len``, ``ds[i]`` and ``ds.many(indices)`` (a shard split, the online run's
    in-memory list, or a colocated split whose states the target computes per call)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> ShardSequence: ...

    def many(self, indices: list[int]) -> list[ShardSequence]: ...


class Logger(Protocol):
    """Where metrics go (a W&B run)."""

    def log(self, data: dict[str, float], step: int) -> None: ...

    def finish(self, exit_code: Optional[int] = None) -> None: ...


@dataclass
class TrainParts:
    """What the loop runs on."""

    cfg: RunConfig
    engine: Any
    """A DeepSpeed engine whose module maps ``(batch, anchors, valid, loss)`` to a
    :class:`~dspark.loss.LossOutput` (``loss``: the step's :class:`LossSettings`), with the drafter
    at ``module.drafter`` (:class:`dspark.recipe.DrafterWithLoss`)."""
    loss: LossSettings
    """The recipe's loss settings; each training step hands the engine its own
    (:meth:`LossSettings.weights_at`: the CE schedule varies ``ce_weight``), validation these."""
    batches: Batches
    val: Optional[Sequences]
    context_index: list[int]
    """Which captured layers the drafter reads as context (indices into a row's state layers)."""
    final_index: int
    """The captured layer holding the target's final hidden state."""
    state: TrainState
    anchor_gen: torch.Generator
    checkpointer: Checkpointer
    logger: Optional[Logger] = None
    rank: int = 0
    world: int = 1
    source: Optional[SequenceSource] = None
    """An online run's stream, closed with the trainer."""
    autocast: Optional[Autocast] = None
    """``train.autocast`` resolved on the device (:func:`dspark.precision.resolve_autocast`): what
    training steps run their forward and loss under; validation runs without it. None: none."""


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def device_peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """The device's dense peak FLOP/s in ``dtype`` (:func:`dspark.flops.peak_flops`); None on a
    CPU or a GPU the table does not know, so that no MFU is logged."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


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
    def __init__(self, parts: TrainParts):
        self.parts = parts
        self.cfg, self.t = parts.cfg, parts.cfg.train
        self.engine, self.batches, self.state = parts.engine, parts.batches, parts.state
        self.checkpointer, self.logger = parts.checkpointer, parts.logger
        self.rank, self.world = parts.rank, parts.world
        self.dtype = TORCH_DTYPES[self.t.dtype]
        self._signal, self._start_step = 0, self.state.step
        self.step_flops = self._step_flops_counter()
        self.peak_flops = device_peak_flops(torch.device(self.engine.device), self.t.dtype)

    def _step_flops_counter(self) -> Optional[Callable[..., StepFlops]]:
        """:func:`dspark.flops.step_flops` for this drafter (and the colocated target, whose forward
        is part of the step), to call with a micro batch's shape; None for a module that is no
        :class:`~dspark.recipe.DrafterWithLoss` (a test's stand-in)."""
        drafter = getattr(self.engine.module, "drafter", None)
        if not isinstance(drafter, DSparkDrafter):
            return None
        ds = getattr(self.batches, "ds", None)
        target = TargetShape.of(ds.target.decoder.config.to_dict()) if isinstance(ds, ColocatedDataset) else None
        return partial(step_flops, drafter.cfg, drafter.dims, colocated_target=target)

    @property
    def model(self) -> DSparkDrafter:
        return self.engine.module.drafter

    # --- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> tuple[dict[str, float], list[str]]:
        """One optimizer step over grad_accum_steps micro batches; returns the step's scalars (loss
        terms averaged over its micro batches) and the ids of the sequences it consumed."""
        t0 = time.perf_counter()
        timing = {"data_s": 0.0, "tokens": 0.0}
        per_micro: list[dict[str, float]] = []
        seq_ids: list[str] = []
        predictions, flops = 0, 0
        norm = None
        loss = self.parts.loss.weights_at(self.state.step, self.t.max_steps)
        for _ in range(self.t.grad_accum_steps):
            td = time.perf_counter()
            batch = self.batches.next()
            seq_ids += batch.seq_ids
            batch.loss_mask = supervised_tokens(batch.loss_mask, batch.lengths, self.t.supervise)
            anchors, valid = sample_anchors(
                batch.loss_mask,
                batch.lengths,
                self.t.anchors_per_seq,
                self.parts.anchor_gen,
                input_ids=batch.input_ids,
                copy_boost=self.t.copy_anchor_boost,
            )
            batch = batch.to(self.engine.device, self.dtype)
            timing["data_s"] += time.perf_counter() - td
            with self.parts.autocast.context() if self.parts.autocast else contextlib.nullcontext():
                out = self.engine(batch, anchors.to(self.engine.device), valid.to(self.engine.device), loss)
            if not torch.isfinite(out.loss):
                raise FloatingPointError(
                    f"non-finite loss {out.loss.item()} at step {self.state.step + 1}, sequences {batch.seq_ids}"
                )
            self.engine.backward(out.loss)
            norm = self._grad_norm_before_step()
            self.engine.step()
            timing["tokens"] += batch.num_tokens
            per_micro.append(out.scalars())
            predictions += out.num_positions
            if self.step_flops is not None:  # host-side shapes and counts: no device sync
                flops += self.step_flops(
                    sequences=batch.input_ids.shape[0],
                    tokens=batch.input_ids.shape[1],
                    anchors=anchors.shape[1],
                    predictions=out.num_positions,
                    target_topk=batch.topk_ids is not None,
                ).model
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        metrics = {k: sum(m[k] for m in per_micro) / len(per_micro) for k in per_micro[0]}
        metrics.update(
            timing,
            ce_weight=loss.ce_weight,
            lr=self.engine.get_lr()[0],
            grad_norm=float(norm) if norm is not None else float("nan"),
        )
        metrics["step_s"] = time.perf_counter() - t0
        metrics["predictions"] = predictions
        if self.step_flops is not None:
            metrics["flops"] = flops  # this rank's model FLOPs (dspark.flops), for FLOP/s and MFU
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

    # --- the loop -----------------------------------------------------------------------------
    def train(self, *, until: Optional[int] = None) -> TrainState:
        """Train to ``train.max_steps`` (or stop early at step ``until``, as a preempted job would);
        the checkpoint directory is released at the end."""
        previous, bar = self._catch_preemption(), None
        try:
            bar = self._progress_bar()
            return self._train_loop(until, bar)
        finally:
            if bar is not None:
                bar.close()
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
        if self.world == 1:
            return self._signal
        import torch.distributed as dist

        flag = torch.tensor([self._signal], dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def close(self) -> None:
        """Stop an online source; release the checkpoint directory."""
        if self.parts.source is not None:
            self.parts.source.close()
        self.checkpointer.close()

    def _progress_bar(self) -> Any:
        """A tqdm bar on an interactive terminal (rank 0); logs and batch jobs get the log lines."""
        if self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.t.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True)

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
            if self.parts.val is not None and (
                step % self.t.eval_every == 0 or step == max_steps or step in self.t.eval_at_steps
            ):
                self._record_validation(self.evaluate())
            saved = self.state.step % self.t.save_every == 0 or self.state.step == max_steps
            if saved:
                self.save()
            sig = self._preempted()
            if sig:
                path = self.checkpointer.directory / tag_name(step) if saved else self.save()
                if self.logger is not None:
                    self.logger.finish(exit_code=128 + sig)
                stop = Preempted(sig, step, path)
                log.warning("%s", stop.message)
                raise stop
        if self.logger is not None and self.state.step >= max_steps:
            self.logger.finish()
        return self.state

    def save(self) -> Path:
        if isinstance(self.batches, OnlineBatches) and self.rank == 0:
            self.batches.flush_log()  # before the tag: a resume cuts what a later tag did not keep
        return self.checkpointer.save(self.engine, self.state, self.parts.anchor_gen)

    # --- logging ------------------------------------------------------------------------------
    def _log_train(self, m: dict[str, float], elapsed: float) -> None:
        tok_s = m["tokens"] / m["step_s"]
        compute = {}  # model FLOP/s per device (this rank's step), and over the device's peak
        if "flops" in m:
            compute["tflops_per_s"] = m["flops"] / m["step_s"] / 1e12
            compute["flops_per_prediction"] = m["flops"] / max(m["predictions"], 1)
            if self.peak_flops:
                compute["mfu"] = m["flops"] / m["step_s"] / self.peak_flops
        flops_note = f" | {compute['tflops_per_s']:.3g} TFLOP/s" if compute else ""
        flops_note += f" MFU {100 * compute['mfu']:.1f}%" if "mfu" in compute else ""
        log.info(
            "%s | loss %.4f (ce %.3f tv %.3f kl %.3f conf %.3f) | tau %.2f | lr %.2e | grad %.3f | %.0f tok/s "
            "%.0f pred/s%s | data %.1f%% | mem %.2f GB",
            progress(self.state.step, self.t.max_steps, start_step=self._start_step, elapsed=elapsed),
            m["loss"],
            m["ce"],
            m["tv"],
            m["kl"],
            m["confidence_bce"],
            m["tau"],
            m["lr"],
            m["grad_norm"],
            tok_s * self.world,
            m["predictions"] * self.world / m["step_s"],
            flops_note,
            100 * m["data_s"] / m["step_s"],
            peak_memory_gb(),
        )
        scalars = {k: v for k, v in m.items() if k not in ("tokens", "data_s", "step_s", "predictions", "flops")}
        scalars.update(
            tokens_per_s=tok_s * self.world,
            predictions_per_s=m["predictions"] * self.world / m["step_s"],
            predictions=self.state.predictions,
            data_wait_frac=m["data_s"] / m["step_s"],
            peak_mem_gb=peak_memory_gb(),
            elapsed_s=elapsed,
            **compute,
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
        self.checkpointer.write_validations(s.validations)

    def _log(self, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(metrics, step=self.state.step)

    # --- validation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, ds: Optional[Sequences] = None) -> dict[str, float]:
        """Every sequence of ``ds`` (default: validation) with fixed anchors: loss terms,
        per-position acceptance, tau estimate and confidence calibration (ECE). Each rank takes
        every world_size-th sequence; the sums are all-reduced, so every rank gets the result."""
        import torch.distributed as dist

        ds = ds or self.parts.val
        assert ds is not None
        block = self.cfg.drafter.block_size
        self.engine.eval()
        gen = torch.Generator().manual_seed(12345 + self.rank)
        mine = list(range(self.rank, len(ds), self.world))
        names = scalar_names(block)
        sums, n, blocks = torch.zeros(len(names), dtype=torch.float64), 0.0, 0.0
        calib = calibration_sums(torch.empty(0), torch.empty(0))
        for i in range(0, len(mine), self.t.micro_batch_size):
            seqs = ds.many(mine[i : i + self.t.micro_batch_size])
            batch = collate(
                seqs,
                context_index=self.parts.context_index,
                final_index=self.parts.final_index,
                max_len=self.t.max_seq_len,
            )
            anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, self.t.anchors_per_seq, gen)
            out = self.engine(  # the recipe's loss settings, whatever step the CE schedule is at
                batch.to(self.engine.device, self.dtype),
                anchors.to(self.engine.device),
                valid.to(self.engine.device),
                self.parts.loss,
            )
            scalars = out.scalars()
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
        res["tau"] = 1.0 + sum(res[f"accept_pos_{k}"] for k in range(1, block + 1))
        res["confidence_ece"] = expected_calibration_error(flat[len(names) + 2 :].view(-1, 3))
        # How many drafted blocks (anchors) the acceptance shares are counted over (``total`` above
        # counts supervised predictions, up to block_size per block): the n of their standard errors.
        res["blocks"] = int(flat[len(names) + 1])
        log.info(
            "val step %d | loss %.4f | tau %.3f | acceptance %s | confidence ECE %.3f",
            self.state.step,
            res["loss"],
            res["tau"],
            " ".join(f"{res[f'accept_pos_{k}']:.2f}" for k in range(1, block + 1)),
            res["confidence_ece"],
        )
        return res
