"""Training checkpoints: the one place that knows a checkpoint's layout and metadata.

A checkpoint directory (``train.checkpoint_dir``) holds DeepSpeed tags ``stepNNNNNNNN/`` and
DeepSpeed's ``latest`` file naming the newest. Inside a tag, beside DeepSpeed's own files:

* the model-states file's client state: ``step``, the data position, RNG states, ``drafter``
  (:class:`DSparkConfig` as a dict) and ``dims`` (:class:`DrafterDims`);
* ``run.json``: the provenance (:func:`dspark.trainer.provenance`): resolved config, git SHA,
  versions, argv. It is written inside the tag *before* ``latest`` moves to it.

The trainer writes and resumes checkpoints; export and eval read them through this module.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.core.config import DSparkConfig, RunConfig
from dspark.core.errors import UserError
from dspark.core.files import atomic_write_json, atomic_write_text
from dspark.model import DrafterDims, trainable_parameter_shapes

RUN_FILE = "run.json"
LATEST_FILE = "latest"
LOCK_FILE, OWNER_FILE = ".lock", ".owner.json"
SHARED_FROM_TARGET = ("embed_tokens.", "lm_head.", "target_norm.")  # frozen, the target's own


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
            weights[name] = t.detach().float().contiguous()
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
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def checkpoint_config_differences(tag_dir: Path, cfg: RunConfig) -> list[str]:
    """The drafter fields (and target layer ids) in which the checkpoint's run.json differs from
    ``cfg``, as "field: checkpoint X, now Y"; empty when equal or when the tag has no run.json."""
    saved = read_run_config(tag_dir)
    if saved is None:
        return []
    now = cfg.to_dict()
    keys = list(dict.fromkeys([*saved.get("drafter", {}), *now["drafter"]]))
    diffs = [
        f"drafter.{k}: checkpoint {saved.get('drafter', {}).get(k)!r}, now {now['drafter'].get(k)!r}"
        for k in keys
        if saved.get("drafter", {}).get(k) != now["drafter"].get(k)
    ]
    if saved.get("target", {}).get("layer_ids") != now["target"]["layer_ids"]:
        diffs.append(
            f"target.layer_ids: checkpoint {saved.get('target', {}).get('layer_ids')}, now {now['target']['layer_ids']}"
        )
    return diffs


def finished_checkpoint(cfg: RunConfig) -> Optional[Path]:
    """The newest checkpoint when it already is at ``train.max_steps`` for this very drafter
    config (so the stage can be skipped without starting DeepSpeed); None otherwise."""
    tag = latest_tag(Path(cfg.train.checkpoint_dir))
    if str(cfg.train.resume) != "auto" or tag is None:
        return None
    if not (tag / RUN_FILE).is_file() or checkpoint_config_differences(tag, cfg):
        return None
    return tag if tag_step(tag) >= cfg.train.max_steps else None
