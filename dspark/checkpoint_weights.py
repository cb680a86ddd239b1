"""A training checkpoint's drafter, read for export and eval: :func:`load_training_checkpoint`.

The model-states file of a tag (:mod:`dspark.checkpoint_tags`) holds, in its client state,
``step``, ``drafter`` (:class:`DSparkConfig` as a dict) and ``dims`` (:class:`DrafterDims`);
its module (ZeRO 0) or the optimizer shards (ZeRO 1-3) hold the weights. What is read is checked
against the drafter's own parameter tree (:func:`check_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.checkpoint_tags import RUN_FILE, CheckpointError, model_states_file, read_run_config, resolve_tag
from dspark.config import DSparkConfig
from dspark.model import DrafterDims, trainable_parameter_shapes

SHARED_FROM_TARGET = ("embed_tokens.", "lm_head.", "target_lm_head.", "target_norm.")
"""Frozen, the target's own: never part of the drafter's weights. A reduced draft vocabulary's
``lm_head`` is the target's rows at ``d2t`` (rebuilt from the target and the map, which is kept)."""
DRAFT_MAP = "d2t"
"""The draft vocabulary's map (:mod:`dspark.data.draft_vocab`): an int64 buffer kept with the weights."""


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
    tag = resolve_tag(path)
    states_file = model_states_file(tag)
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
    states_file = model_states_file(Path(tag))
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
        from dspark.data.draft_vocab import map_problem

        problem = map_problem(weights[DRAFT_MAP], dims.vocab_size)
        if problem:
            problems.append(f"tensor {DRAFT_MAP!r}: {problem}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
