"""Training checkpoints: the one place that knows a checkpoint's layout and metadata.

A checkpoint directory (``train.checkpoint_dir``) holds DeepSpeed tags ``stepNNNNNNNN/`` and
DeepSpeed's ``latest`` file naming the newest. Inside a tag, beside DeepSpeed's own files:

* the model-states file's client state: ``step``, the data position, RNG states, ``drafter``
  (:class:`DSparkConfig` as a dict) and ``dims`` (:class:`DrafterDims`);
* ``run.json``: the provenance (:func:`provenance`): resolved config, git SHA, versions, argv.
  It is written inside the tag *before* ``latest`` moves to it.

The trainer's :class:`Checkpointer` saves (with the disk check and the clean-up of a save that did
not finish), resumes and keeps ``validation.jsonl``; export and eval read checkpoints through
:func:`load_training_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.batching import DataPosition
from dspark.core.config import DSparkConfig, RunConfig
from dspark.core.errors import UserError
from dspark.core.files import (
    DiskFullError,
    atomic_write_json,
    atomic_write_text,
    disk_full_message,
    file_sha256,
    free_bytes,
    is_disk_full,
    reporting_disk_full,
)
from dspark.model import DrafterDims, trainable_parameter_shapes

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
LATEST_FILE = "latest"
LOCK_FILE, OWNER_FILE = ".lock", ".owner.json"
SHARED_FROM_TARGET = ("embed_tokens.", "lm_head.", "target_lm_head.", "target_norm.")
"""Frozen, the target's own: never part of the drafter's weights. A reduced draft vocabulary's
``lm_head`` is the target's rows at ``d2t`` (rebuilt from the target and the map, which is kept)."""
DRAFT_MAP = "d2t"
"""The draft vocabulary's map (:mod:`dspark.draft_vocab`): an int64 buffer kept with the weights."""


class CheckpointError(UserError):
    """A checkpoint (or an export made from one) that cannot be read or served; the message says
    which file, field or tensor, and what was expected."""


class CheckpointInUseError(CheckpointError):
    """Another live run holds the checkpoint directory."""


def lock_checkpoint_dir(checkpoint_dir: Path) -> Any:
    """Hold ``checkpoint_dir`` for this run (an OS file lock, released when the process ends, so
    a killed run leaves no stale lock). A second run pointed at it (a requeued job and a manual
    rerun) is refused with the holder's host and pid instead of writing into the same tags."""
    from filelock import FileLock, Timeout

    checkpoint_dir = Path(checkpoint_dir).expanduser()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(checkpoint_dir / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            owner = json.loads((checkpoint_dir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            owner = {}
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["since"])) if "since" in owner else "?"
        raise CheckpointInUseError(
            f"{checkpoint_dir}: in use by another training run (host {owner.get('host', '?')}, pid "
            f"{owner.get('pid', '?')}, since {since}); two runs writing one checkpoint directory would "
            "interleave their tags. Wait for it or stop it, or give this run its own train.checkpoint_dir"
        ) from None
    atomic_write_json(
        checkpoint_dir / OWNER_FILE, {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    )
    return lock


def publish_tag(checkpoint_dir: Path, tag: str, run_config: dict[str, Any]) -> None:
    """Finish a tag DeepSpeed saved with ``save_latest=False``: write its ``run.json``, then move
    ``latest`` to it. A kill in between leaves ``latest`` on the previous, complete tag."""
    checkpoint_dir = Path(checkpoint_dir).expanduser()
    atomic_write_json(checkpoint_dir / tag / RUN_FILE, run_config, indent=2, default=str)
    atomic_write_text(checkpoint_dir / LATEST_FILE, tag)


def tag_bytes(tag: Path) -> int:
    """Bytes the files of a tag directory hold (every rank's), 0 when there is none."""
    return sum(f.stat().st_size for f in Path(tag).rglob("*") if f.is_file())


def remove_unpublished_tag(checkpoint_dir: Path, tag: str) -> int:
    """Remove tag directory ``tag`` unless ``latest`` names it: the files of a save that was killed
    or ran out of space, never resumed (``latest`` did not move), about to be written again. A
    save into it would overwrite DeepSpeed's files one by one and keep any it no longer writes.
    Returns the bytes given back."""
    checkpoint_dir = Path(checkpoint_dir).expanduser()
    latest = latest_tag(checkpoint_dir)
    path = checkpoint_dir / tag
    if not path.is_dir() or (latest is not None and latest.name == tag):
        return 0
    size = tag_bytes(path)
    shutil.rmtree(path)
    return size


def tag_name(step: int) -> str:
    return f"step{step:08d}"


def tag_step(tag: Path) -> int:
    """The step of a ``stepNNNNNNNN`` tag directory, -1 for any other name."""
    name = Path(tag).name
    return int(name.removeprefix("step")) if name.startswith("step") and name[4:].isdigit() else -1


def latest_tag(checkpoint_dir: Path) -> Optional[Path]:
    """The tag DeepSpeed's ``latest`` names, or None when there is none yet."""
    latest = Path(checkpoint_dir).expanduser() / LATEST_FILE
    return latest.parent / latest.read_text().strip() if latest.is_file() else None


def _tag_dir(path: Path) -> Path:
    """A tag directory from either the tag itself or the checkpoint root (its ``latest``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    tag = latest_tag(path)
    if tag is not None:
        if not tag.is_dir():
            raise CheckpointError(f"{path / LATEST_FILE} names tag {tag.name!r}, but {tag} does not exist")
        return tag
    return path


def _model_states_file(tag: Path) -> Path:
    files = sorted(tag.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{tag}: not a DeepSpeed checkpoint tag (no *mp_rank_00_model_states.pt); "
            "pass the checkpoint directory (with 'latest') or one of its stepNNNNNNNN tags"
        )
    return files[0]


def checkpoint_model_file(path: Path) -> Path:
    """The DeepSpeed model-states file of a checkpoint tag, or of the checkpoint directory's
    ``latest`` tag: what an export reads, so what a report that depends on it should hash."""
    return _model_states_file(_tag_dir(path))


def read_run_config(tag: Path) -> Optional[dict[str, Any]]:
    """The resolved Hydra config a tag was trained with (``run.json``), None if it has none."""
    run_file = Path(tag) / RUN_FILE
    return json.loads(run_file.read_text())["config"] if run_file.is_file() else None


@dataclass
class TrainingCheckpoint:
    """The drafter part of one DeepSpeed checkpoint tag, in fp32."""

    path: Path  # the tag directory
    step: int
    drafter: DSparkConfig
    dims: DrafterDims
    weights: dict[str, torch.Tensor]  # trainable drafter tensors, no "drafter." prefix
    run_config: dict[str, Any]  # resolved Hydra config of the run (run.json)
    zero_stage: int
    context_layer_ids: list[int]  # target layer ids (our convention) the drafter reads, in fc input order


def load_training_checkpoint(path: Path) -> TrainingCheckpoint:
    """Read the drafter weights from a DeepSpeed checkpoint (ZeRO 0-3).

    ZeRO 1-3 keep the fp32 master weights partitioned in the optimizer shards; DeepSpeed's own
    ``zero_to_fp32`` reassembles them, so an export never depends on the world size it trained on.
    """
    tag = _tag_dir(path)
    states_file = _model_states_file(tag)
    try:
        states = torch.load(states_file, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(
            f"{states_file}: cannot be read as a DeepSpeed model-states file ({type(e).__name__}: {e})"
        ) from e
    for key in ("drafter", "dims", "step"):
        if key not in states:
            raise CheckpointError(
                f"{states_file}: field {key!r} missing; expected a checkpoint written by dspark.trainer"
            )
    stage = int((states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    if stage == 0:
        raw = states["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            raw = get_fp32_state_dict_from_zero_checkpoint(
                str(tag.parent), tag=tag.name, exclude_frozen_parameters=True
            )
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises bare ValueError/FileNotFoundError
            raise CheckpointError(f"{tag}: ZeRO-{stage} shards could not be merged ({type(e).__name__}: {e})") from e
    weights = {}
    for name, t in raw.items():
        if not name.startswith("drafter."):
            raise CheckpointError(
                f"{states_file}: tensor {name!r} is not under 'drafter.'; expected a dspark.trainer checkpoint"
            )
        name = name[len("drafter.") :]
        if not name.startswith(SHARED_FROM_TARGET):
            weights[name] = (t.detach().float() if t.is_floating_point() else t.detach()).contiguous()
    run_config = read_run_config(tag)
    if run_config is None:
        raise CheckpointError(
            f"{tag / RUN_FILE}: missing; the checkpoint's run config (target, layer ids) is needed to export"
        )
    dims = DrafterDims(**states["dims"])
    drafter = DSparkConfig(**states["drafter"])
    # recorded by the trainer; checkpoints from before it did: the drafter's ids, else the target's
    ctx_ids = states.get("context_layer_ids") or drafter.target_layer_ids or run_config["target"]["layer_ids"]
    ckpt = TrainingCheckpoint(
        tag, int(states["step"]), drafter, dims, weights, run_config, stage, [int(i) for i in ctx_ids]
    )
    check_weights(ckpt.weights, ckpt.drafter, dims, where=str(tag))
    return ckpt


def saved_draft_map(tag: Path) -> Optional[torch.Tensor]:
    """The draft vocabulary's ``d2t`` a checkpoint tag was trained with (the drafter's buffer in its
    model states, read memory-mapped), None when the drafter has the full vocabulary."""
    states_file = _model_states_file(Path(tag))
    try:
        states = torch.load(states_file, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(
            f"{states_file}: cannot be read as a DeepSpeed model-states file ({type(e).__name__}: {e})"
        ) from e
    d2t = (states.get("module") or {}).get(f"drafter.{DRAFT_MAP}")
    return None if d2t is None else d2t.clone()


def check_weights(weights: dict[str, torch.Tensor], cfg: DSparkConfig, dims: DrafterDims, *, where: str) -> None:
    """Names, shapes and finiteness against the drafter's own parameter tree; every problem in one message."""
    want = trainable_parameter_shapes(cfg, dims)
    problems = [f"missing tensor {k!r} (expected shape {list(s)})" for k, s in want.items() if k not in weights]
    problems += [f"unexpected tensor {k!r}" for k in weights if k not in want]
    problems += [
        f"tensor {k!r} has shape {list(weights[k].shape)}, expected {list(s)}"
        for k, s in want.items()
        if k in weights and tuple(weights[k].shape) != s
    ]
    problems += [
        f"tensor {k!r} has non-finite values"
        for k, t in weights.items()
        if k in want and t.is_floating_point() and not torch.isfinite(t).all()
    ]
    if DRAFT_MAP in want and DRAFT_MAP in weights and tuple(weights[DRAFT_MAP].shape) == want[DRAFT_MAP]:
        from dspark.draft_vocab import map_problem

        problem = map_problem(weights[DRAFT_MAP], dims.vocab_size)
        if problem:
            problems.append(f"tensor {DRAFT_MAP!r}: {problem}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def checkpoint_config_differences(tag_dir: Path, cfg: RunConfig) -> list[str]:
    """The drafter fields (and target layer ids) in which the checkpoint's run.json differs from
    ``cfg``, as "field: checkpoint X, now Y"; empty when equal or when the tag has no run.json."""
    saved = read_run_config(tag_dir)
    if saved is None:
        return []
    now = cfg.to_dict()
    # a field the checkpoint predates (drafter.family, the MLA sizes) had its default then
    old = {**asdict(DSparkConfig()), **saved.get("drafter", {})}
    keys = list(dict.fromkeys([*old, *now["drafter"]]))
    diffs = [
        f"drafter.{k}: checkpoint {old.get(k)!r}, now {now['drafter'].get(k)!r}"
        for k in keys
        if old.get(k) != now["drafter"].get(k)
    ]
    if saved.get("target", {}).get("layer_ids") != now["target"]["layer_ids"]:
        diffs.append(
            f"target.layer_ids: checkpoint {saved.get('target', {}).get('layer_ids')}, now {now['target']['layer_ids']}"
        )
    return diffs


RUN_CONTROL = {
    "train": (
        "max_steps",  # a longer run resumes this one
        "log_every",
        "eval_every",
        "eval_at_steps",
        "save_every",
        "resume",
        "dist_timeout_s",
        "run_name",
        "checkpoint_dir",
        "fused_optimizer",  # the same AdamW, one kernel or per tensor
        "recompute_vocab_chunks",  # memory, not numbers
    ),
}
"""``train`` fields that say how a run is driven, not what it trains: they may change between a
run and its rerun. Every other ``train`` field shapes the result."""
ADDED_LATER = {("train", "kl_weight"): 0.0, ("train", "markov_init"): "zeros"}
"""What a run recorded before a shaping field existed trained with (a missing key is otherwise
taken as unchanged): a run of the old loss is not resumed as a KL run."""
SHAPING_DATA = ("mode", "train_sequences", "val_fraction")
"""``data`` fields that shape training in every mode (the offline dataset itself is its manifest)."""
SHAPING_ONLINE = ("source", "hf_split", "num_prompts", "temperature", "seed", "max_new_tokens", "max_seq_len")
"""``data`` fields that make an online run's sequences (an offline run's are in its manifest)."""


def dataset_identity(cfg: RunConfig) -> dict[str, Any]:
    """The offline dataset a run trains on, as ``run.json`` records it: its manifest's SHA-256
    (every shard's name, rows and sha), so another dataset under any path is told apart."""
    if cfg.data.mode != "offline":
        return {}
    manifest = Path(cfg.data.shards_dir).expanduser() / "manifest.json"
    return {"manifest_sha256": file_sha256(manifest) if manifest.is_file() else None}


def run_differences(tag_dir: Path, cfg: RunConfig) -> list[str]:
    """What shapes a run (every ``train`` field but :data:`RUN_CONTROL`'s, the data fields, the
    seed, the target, the dataset's manifest) where the tag's ``run.json`` differs from ``cfg``, as
    "key: checkpoint X, now Y"; empty when equal or when the tag has no run.json. The drafter's
    own fields are :func:`checkpoint_config_differences`'."""
    run_file = Path(tag_dir) / RUN_FILE
    if not run_file.is_file():
        return []
    record = json.loads(run_file.read_text())
    saved, now = record["config"], cfg.to_dict()
    keys = [("train", k) for k in now["train"] if k not in RUN_CONTROL["train"]]
    keys += [("data", k) for k in SHAPING_DATA + (SHAPING_ONLINE if now["data"]["mode"] != "offline" else ())]
    keys += [("target", "name"), ("seed", None)]
    diffs = []
    for group, k in keys:
        absent = ADDED_LATER.get((group, k), now[group][k] if k is not None else None)
        old = saved.get(group) if k is None else (saved.get(group) or {}).get(k, absent)
        new = now[group] if k is None else now[group][k]
        if old != new:
            diffs.append(f"{group if k is None else f'{group}.{k}'}: checkpoint {old!r}, now {new!r}")
    if "dataset" in record:  # tags written before it was recorded are judged by their config alone
        old, new = record["dataset"].get("manifest_sha256"), dataset_identity(cfg).get("manifest_sha256")
        if old != new:
            diffs.append(
                f"the dataset ({Path(cfg.data.shards_dir) / 'manifest.json'}): checkpoint's manifest sha256 "
                f"{str(old)[:12]}, now {str(new)[:12]}"
            )
    return diffs


def changed_run_error(tag: Path, diffs: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{tag}: this run was trained with other settings ({'; '.join(diffs)}); it is neither skipped nor "
        "resumed as if it were this one. Train this one under its own name (train.run_name=...), continue that "
        f"checkpoint with the new settings anyway (train.resume={tag}), or start over (train.resume=never)"
    )


def finished_checkpoint(cfg: RunConfig) -> Optional[Path]:
    """The newest checkpoint when it already is at ``train.max_steps`` for this very drafter
    config (so the stage can be skipped without starting DeepSpeed); None otherwise. A finished
    run whose settings or dataset changed (:func:`run_differences`) is refused, not skipped."""
    tag = latest_tag(Path(cfg.train.checkpoint_dir))
    if str(cfg.train.resume) != "auto" or tag is None:
        return None
    if not (tag / RUN_FILE).is_file() or checkpoint_config_differences(tag, cfg):
        return None
    if tag_step(tag) < cfg.train.max_steps:
        return None
    diffs = run_differences(tag, cfg)
    if diffs:
        raise changed_run_error(tag, diffs)
    return tag


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


def provenance(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint was made by (its ``run.json``): resolved config, git SHA, versions, argv."""
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
        "dataset": dataset_identity(cfg),
        "git_sha": sha,
        "argv": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
        },
    }


_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


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


def check_resume_tag(tag_dir: Path, named_by: str) -> None:
    """A tag fit to resume, before DeepSpeed reads it: a directory, with DeepSpeed's model states
    and the trainer's ``run.json`` (written last: without it the save did not finish, and its
    drafter could not be checked). One error each, naming the tag and ``named_by``."""
    if not tag_dir.is_dir():
        raise CheckpointError(
            f"{named_by}={tag_dir}: no such checkpoint tag directory; expected a stepNNNNNNNN directory the trainer "
            "wrote (train.resume=auto resumes the one 'latest' names, train.resume=never starts over)"
        )
    if not any(tag_dir.glob("*mp_rank_00_model_states.pt")):
        raise CheckpointError(
            f"{named_by}={tag_dir}: not a DeepSpeed checkpoint tag (no *mp_rank_00_model_states.pt); expected a "
            "stepNNNNNNNN directory the trainer wrote"
        )
    if not (tag_dir / RUN_FILE).is_file():
        raise CheckpointError(
            f"{named_by}={tag_dir}: no {RUN_FILE}, so its save did not finish (the trainer writes it last) and its "
            "drafter cannot be checked against this config; resume a complete tag (train.resume=auto: the one "
            "'latest' names) or start over (train.resume=never)"
        )


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
            engine.save_checkpoint(str(self.directory), tag=tag, client_state=client, save_latest=False)
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
        module's tensors plus AdamW's two moments (a lower bound: ZeRO adds fp32 master copies)."""
        last = latest_tag(self.directory)
        if last is not None and last.is_dir():
            return tag_bytes(last)
        module = {t.data_ptr(): t.numel() * t.element_size() for t in engine.module.state_dict().values()}
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
            loaded, client = engine.load_checkpoint(str(path), tag=tag)
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
