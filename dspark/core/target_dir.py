"""A target directory's ``config.json``: which architecture it is, where that architecture keeps
the tensors the drafter shares, and the text model's fields (hidden size, layer count...).

Both the config loader (:func:`dspark.config.load_config` reads the values a generic target
leaves open) and the target loader (:mod:`dspark.target`) use it, so it imports neither.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dspark.core.errors import UserError


class TargetError(UserError):
    """A target spec or directory is not what the drafter needs. The message names the path."""


@dataclass(frozen=True)
class ArchLayout:
    """Where an architecture keeps the tensors the drafter shares with it.

    Each entry lists candidate tensor names, first match wins: HF checkpoints and vLLM's
    module tree name the same weight differently for multimodal wrappers (Kimi K3 stores
    ``language_model.layers.*`` that vLLM maps to ``language_model.model.layers.*``).
    """

    embed: tuple[str, ...]
    norm: tuple[str, ...]
    lm_head: tuple[str, ...]
    text_config_key: Optional[str] = None
    """Sub-dict of config.json holding the text model's fields, for wrapper configs."""


_DECODER = ArchLayout(
    embed=("model.embed_tokens.weight",),
    norm=("model.norm.weight",),
    lm_head=("lm_head.weight",),
)
_KIMI_WRAPPED = ArchLayout(
    embed=("language_model.model.embed_tokens.weight", "language_model.embed_tokens.weight"),
    norm=("language_model.model.norm.weight", "language_model.norm.weight"),
    lm_head=("language_model.lm_head.weight",),
    text_config_key="text_config",
)
ARCHITECTURES: dict[str, ArchLayout] = {
    "LlamaForCausalLM": _DECODER,
    "MistralForCausalLM": _DECODER,
    "Qwen2ForCausalLM": _DECODER,
    "Qwen3ForCausalLM": _DECODER,
    "Qwen3MoeForCausalLM": _DECODER,
    "DeepseekV3ForCausalLM": _DECODER,
    "KimiLinearForCausalLM": _DECODER,
    "KimiK3ForConditionalGeneration": _KIMI_WRAPPED,
}


def read_config(path: Path) -> tuple[str, ArchLayout, dict[str, Any], dict[str, Any]]:
    """Return (architecture, layout, full config, text config) of a target directory."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TargetError(f"{cfg_file}: missing file; a target directory needs config.json")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise TargetError(f"{cfg_file}: not valid JSON ({e})") from e
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise TargetError(
            f"{cfg_file}: unknown architecture {archs!r} in field 'architectures'; "
            f"expected one of {sorted(ARCHITECTURES)} (add its tensor names to dspark.core.target_dir.ARCHITECTURES)"
        )
    layout = ARCHITECTURES[arch]
    text = config.get(layout.text_config_key, {}) if layout.text_config_key else config
    if layout.text_config_key and not text:
        raise TargetError(
            f"{cfg_file}: field {layout.text_config_key!r} missing; {arch} keeps its text model config there"
        )
    return arch, layout, config, text


def read_text_config(path: Path) -> dict[str, Any]:
    """The text model's fields of a target directory's config.json (its ``text_config`` for
    wrapper architectures such as Kimi K3): the one parser of that nesting."""
    return read_config(Path(path))[3]


def hf_target_dir(path: Any) -> Path:
    """``target.path`` of an ``hf_dir`` target as a directory that holds a config.json."""
    directory = Path(os.path.expanduser(str(path)))
    if not directory.is_dir():
        raise TargetError(f"{directory}: target.path is not a directory; expected a local HF model directory")
    if not (directory / "config.json").is_file():
        raise TargetError(f"{directory / 'config.json'}: missing file; a target directory needs config.json")
    return directory


def check_field(cfg_file: Path, key: str, expected: Any, found: Any) -> None:
    """A ``target.<key>`` that was given must be config.json's value (None: nothing given)."""
    if expected is not None and found != expected:
        raise TargetError(
            f"{cfg_file}: field {key!r} is {found}, but target.{key} expects {expected}; set target.{key}={found} "
            f"(or null to read it), or point target.path at the model you meant"
        )
