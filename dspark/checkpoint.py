"""The trainer's checkpoints: :class:`Checkpointer` saves, resumes and keeps ``validation.jsonl``.

A save writes DeepSpeed tag ``stepNNNNNNNN/`` (with the disk check and the clean-up of a save that
did not finish) whose model-states file's client state holds ``step``, the data position, RNG
states (:class:`TrainState`), ``drafter`` (:class:`DSparkConfig` as a dict) and ``dims``
(:class:`DrafterDims`), then its ``run.json`` (:func:`~dspark.checkpoint_run.provenance`), then
moves ``latest`` to it. A resume checks the tag first: complete, of this drafter, of this run's
settings (:mod:`dspark.checkpoint_run`).

Beside it: a checkpoint directory's layout (tags, ``latest``, ``run.json``, the lock) is
:mod:`dspark.checkpoint_tags`; export and eval read a tag's drafter through
:func:`dspark.checkpoint_weights.load_training_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.checkpoint_run import changed_run_error, checkpoint_config_differences, provenance, run_differences
from dspark.checkpoint_tags import (
    LATEST_FILE,
    RUN_FILE,
    CheckpointError,
    check_resume_tag,
    latest_tag,
    lock_checkpoint_dir,
    publish_tag,
    remove_unpublished_tag,
    tag_bytes,
    tag_name,
)
from dspark.config import RunConfig
from dspark.core.atomic_files import atomic_write_text
from dspark.core.disk_space import DiskFullError, disk_full_message, free_bytes, is_disk_full, reporting_disk_full
from dspark.data.batching import DataPosition

log = logging.getLogger(__name__)

HISTORY_WINDOW = 1000
"""Steps of per-step history (loss, sequence ids) a checkpoint keeps: an audit trail of bounded
size (the K3 preset consumes about 1.9M sequences); the whole data order is in ``data_digest``."""

VALIDATION_FILE = "validation.jsonl"


@dataclass
class TrainState:
    """What a run has done so far; everything here goes into the checkpoint's client state."""

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

    def to_client(self) -> dict[str, Any]:
        """The checkpoint's client-state entries of this state (:meth:`from_client` reads them back)."""
        return {
            "step": self.step,
            "data": asdict(self.data),
            "history": self.history,
            "data_digest": self.data_digest,
            "predictions": self.predictions,
            "tokens": self.tokens,
            "train_seconds": self.train_seconds,
            "validations": self.validations,
        }

    @classmethod
    def from_client(cls, client: dict[str, Any]) -> TrainState:
        """The state a checkpoint's client state holds (fields added later default)."""
        return cls(
            step=client["step"],
            data=DataPosition(**client["data"]),
            history=client["history"],
            data_digest=client.get("data_digest", ""),
            predictions=client.get("predictions", 0),
            tokens=client.get("tokens", 0),
            train_seconds=client.get("train_seconds", 0.0),
            validations=client.get("validations", []),
        )


_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


def load_with_frozen_from_the_target(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn`` for a tag saved with ``exclude_frozen_parameters``: the tag
    holds the trainable tensors and the buffers; the frozen ones (the target's embedding, norm and
    LM head, which the drafter is built from) keep what the drafter was built with. The load stays
    strict: a trainable tensor missing from the tag, one of another shape or one the drafter lacks
    raises torch's ``Error(s) in loading state_dict`` (:func:`state_dict_mismatch`). Tags from before
    hold the frozen tensors too and load the same way."""
    frozen = {n: p for n, p in dst.named_parameters() if not p.requires_grad and n not in src}
    dst.load_state_dict({**frozen, **src}, strict=True)


def state_dict_mismatch(err: BaseException) -> Optional[str]:
    """torch's ``Error(s) in loading state_dict`` (what DeepSpeed's load of a tag into another
    drafter raises) summarized in one line: how many tensors differ in shape, are missing or are
    unexpected, each with its first example; None for any other error."""
    text = str(err)
    if "Error(s) in loading state_dict" not in text:
        return None
    parts = []
    sizes = _SIZE_MISMATCH.findall(text)
    if sizes:
        name, saved, built = sizes[0]
        parts.append(f"{len(sizes)} tensor(s) of another shape, e.g. {name}: {saved} saved, {built} built")
    for label, what in (("Missing", "missing from the tag"), ("Unexpected", "in the tag, not in the drafter")):
        keys = re.search(rf"{label} key\(s\) in state_dict: ([^\n]*)", text)
        names = re.findall(r'"([^"]+)"', keys[1]) if keys else []
        if names:
            parts.append(f"{len(names)} tensor(s) {what}, e.g. {names[0]}")
    return "; ".join(parts) or text.splitlines()[0]


class Checkpointer:
    """One run's ``train.checkpoint_dir``: held for the run (rank 0 takes the directory's lock,
    :func:`lock_checkpoint_dir`), saved to, resumed from, and the home of ``validation.jsonl``.

    ``engine`` below is the DeepSpeed engine wrapping the drafter (``engine.module.drafter``);
    collectives (the disk check's numbers, the barriers around a save) run on every rank."""

    def __init__(self, cfg: RunConfig, *, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.directory = Path(cfg.train.checkpoint_dir).expanduser()
        self._lock = lock_checkpoint_dir(self.directory) if rank == 0 else None

    def close(self) -> None:
        """Release the directory (the OS would at process exit anyway)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- save ---------------------------------------------------------------------------------
    def save(self, engine: Any, state: TrainState, anchor_gen: torch.Generator) -> Path:
        """Save tag ``stepNNNNNNNN`` of ``state.step`` and move ``latest`` to it once complete."""
        import torch.distributed as dist

        tag = tag_name(state.step)
        drafter = engine.module.drafter
        client = {
            "context_layer_ids": self.cfg.context_layer_ids(),
            **state.to_client(),
            "anchor_rng": anchor_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "drafter": asdict(drafter.cfg),
            "dims": asdict(drafter.dims),
        }
        self._write_tag(engine, tag, client, needed=self._make_room_for(engine, tag))
        dist.barrier()  # every rank's shards are written
        if self.rank == 0:
            self._publish(tag)
        dist.barrier()
        log.info("saved checkpoint %s", self.directory / tag)
        return self.directory / tag

    def _write_tag(self, engine: Any, tag: str, client: dict[str, Any], *, needed: int) -> None:
        """DeepSpeed's save of ``tag`` (not yet named by ``latest``); when it fails, what it wrote
        is removed, and a full disk is said so (DeepSpeed's torch.save reports only
        ``unexpected pos ...``)."""
        try:
            engine.save_checkpoint(
                str(self.directory), tag=tag, client_state=client, save_latest=False, exclude_frozen_parameters=True
            )
        except Exception as e:
            full = is_disk_full(e, self.directory)  # before the half tag, which filled the disk, is removed
            written = tag_bytes(self.directory / tag)
            if self.rank == 0:
                remove_unpublished_tag(self.directory, tag)
            if full:
                raise DiskFullError(self._disk_full(tag, max(needed, written))) from e
            raise

    def _publish(self, tag: str) -> None:
        run = provenance(self.cfg)
        size = len(json.dumps(run, indent=2, default=str))
        with reporting_disk_full(self.directory, what=f"{tag}/{RUN_FILE}", needed=size, todo=self.disk_full_todo()):
            publish_tag(self.directory, tag, run)

    def _make_room_for(self, engine: Any, tag: str) -> int:
        """Before DeepSpeed writes ``tag``: remove what a killed or failed save of it left, and
        refuse the save (every rank, on rank 0's numbers) when the checkpoint directory has less
        room than the tag needs. Returns that estimate, in bytes."""
        import torch.distributed as dist

        if self.rank == 0:
            freed = remove_unpublished_tag(self.directory, tag)
            if freed:
                log.warning("removed %s: %d bytes left by a save that did not finish", self.directory / tag, freed)
        numbers = torch.tensor([self._checkpoint_bytes(engine), free_bytes(self.directory)], dtype=torch.int64)
        if self.world > 1:
            numbers = numbers.to(engine.device)
            dist.broadcast(numbers, src=0)
        needed, free = (int(n) for n in numbers.cpu())
        if free < needed:
            raise DiskFullError(self._disk_full(tag, needed))
        return needed

    def _checkpoint_bytes(self, engine: Any) -> int:
        """About what a tag takes: the last complete one's size, or before there is one the
        module's saved tensors (the frozen ones are not: :meth:`save`) plus AdamW's two moments (a
        lower bound: ZeRO adds fp32 master copies)."""
        last = latest_tag(self.directory)
        if last is not None and last.is_dir():
            return tag_bytes(last)
        saved = engine.module_state_dict(exclude_frozen_parameters=True).values()
        module = {t.data_ptr(): t.numel() * t.element_size() for t in saved}
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        return sum(module.values()) + 2 * 4 * trainable

    def _disk_full(self, tag: str, needed: int) -> str:
        return disk_full_message(self.directory, f"checkpoint {tag}", needed, self.disk_full_todo())

    def disk_full_todo(self) -> str:
        """What to do when this directory's disk is full (said by every disk-full error here)."""
        last = latest_tag(self.directory)
        resume = f"resume from {last.name}, the last complete tag" if last else "start (no tag is complete yet)"
        return (
            f"free space there (tags older than the one 'latest' names can go) or set train.checkpoint_dir "
            f"elsewhere, then rerun the same command to {resume}"
        )

    # --- resume -------------------------------------------------------------------------------
    def resume_tag(self) -> Optional[Path]:
        """The tag :meth:`resume` will load (``train.resume``; ``auto``: the one ``latest`` names),
        checked (:func:`check_resume_tag`, the drafter and run settings), or None when there is
        nothing to resume. What the drafter is built from before it is resumed (the draft
        vocabulary's map) is read from this tag."""
        mode = self.cfg.train.resume
        if mode == "never":
            return None
        tag_dir = latest_tag(self.directory) if mode == "auto" else Path(mode).expanduser()
        if tag_dir is None:
            return None
        check_resume_tag(tag_dir, "train.resume" if mode != "auto" else f"{self.directory / LATEST_FILE}")
        self._check_resume_config(tag_dir)
        return tag_dir

    def resume(self, engine: Any, anchor_gen: torch.Generator) -> Optional[TrainState]:
        """Load the tag ``train.resume`` names (``auto``: the one ``latest`` names, if any) into
        ``engine`` and restore the RNGs (``anchor_gen``, torch's, Python's); the run's state, or
        None when there is nothing to resume."""
        tag_dir = self.resume_tag()
        if tag_dir is None:
            return None
        if self.cfg.train.resume == "auto":
            path, tag = self.directory, None  # DeepSpeed reads latest itself
        else:
            path, tag = tag_dir.parent, tag_dir.name
        try:
            loaded, client = engine.load_checkpoint(str(path), tag=tag, custom_load_fn=load_with_frozen_from_the_target)
        except RuntimeError as e:
            differs = state_dict_mismatch(e)
            if differs is None:
                raise
            raise CheckpointError(
                f"{tag_dir}: its weights are not those of the drafter its {RUN_FILE} describes ({differs}); was "
                f"{RUN_FILE} copied from another tag? Resume a tag whose {RUN_FILE} is its own "
                "(train.resume=<tag directory>), or start over with train.resume=never"
            ) from e
        if loaded is None:
            raise CheckpointError(
                f"{path}: no DeepSpeed checkpoint {'(latest)' if tag is None else tag} to resume from, expected a "
                "tag directory written by the trainer; pass train.resume=never to start over"
            )
        state = TrainState.from_client(client)
        anchor_gen.set_state(client["anchor_rng"])
        torch.set_rng_state(client["torch_rng"])
        random.setstate(client["python_rng"])
        log.info(
            "resumed from %s at step %d (epoch %d, position %d)", loaded, state.step, state.data.epoch, state.data.index
        )
        return state

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
        if str(self.cfg.train.resume) == "auto":  # a tag named explicitly is continued with the new settings
            diffs = run_differences(tag_dir, self.cfg)
            if diffs:
                raise changed_run_error(tag_dir, diffs)

    # --- validation record --------------------------------------------------------------------
    def write_validations(self, validations: list[dict]) -> None:
        """Rank 0 writes ``validation.jsonl``: the whole list each time, so a resumed run rewrites
        what its checkpoint knows."""
        if self.rank != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(v) + "\n" for v in validations)
        with reporting_disk_full(self.directory, what=VALIDATION_FILE, needed=len(text), todo=self.disk_full_todo()):
            atomic_write_text(self.directory / VALIDATION_FILE, text)
