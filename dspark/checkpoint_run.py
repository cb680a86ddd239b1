"""The run a checkpoint records in its tags' ``run.json``, and whether it is this run.

:func:`provenance` is what ``run.json`` holds (resolved config, the dataset's identity, git SHA,
versions, argv); beside it, what reads it back: :func:`checkpoint_config_differences` (another
drafter: never resumed), :func:`run_differences` (other settings that shape training, or
another dataset: not resumed as if it were this run) and :func:`finished_checkpoint` (a run
already at ``train.max_steps``, whose stage is skipped).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.checkpoint_tags import RUN_FILE, CheckpointError, latest_tag, read_run_config, tag_step
from dspark.config import DSparkConfig, RunConfig
from dspark.core.file_reads import file_sha256


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
        "compile",  # the same graph, compiled
    ),
}
"""``train`` fields that say how a run is driven, not what it trains: they may change between a
run and its rerun. Every other ``train`` field shapes the result."""
ADDED_LATER = {
    ("train", "kl_weight"): 0.0,
    ("train", "markov_init"): "zeros",
    ("train", "autocast"): "off",
    ("train", "optimizer"): "adamw",
}
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
    stage = (((saved.get("deepspeed") or {}).get("zero_optimization")) or {}).get("stage")
    stage_now = now["deepspeed"]["zero_optimization"]["stage"]
    if stage is not None and stage != stage_now:
        # DeepSpeed writes each ZeRO stage's optimizer state in its own files (ZeRO 0 one, ZeRO 1-3
        # one per rank): another stage cannot read them
        diffs.append(f"deepspeed.zero_optimization.stage: checkpoint {stage!r}, now {stage_now!r}")
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
