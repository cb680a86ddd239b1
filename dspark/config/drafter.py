"""The ``drafter`` group (``conf/drafter/``): the DSpark drafter's fields, composed from the fields
every family reads (:mod:`dspark.families.shared`) and each family's own, declared in its
module (docs/architecture.md, "Adding a drafter family"); and the run name that tells drafters
apart (:func:`drafter_tag`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dspark.config.checks import ConfigError, _at_least, _check, _choice, _unresolved
from dspark.families import FAMILIES, FIELD_CLASSES, FIELD_FAMILY
from dspark.families.shared import SharedDrafterFields

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(*FIELD_CLASSES, SharedDrafterFields):
    """The DSpark drafter (arXiv 2607.05147; serving contract of vLLM 0.32): the shared fields
    (:class:`SharedDrafterFields`), then each registered family's own (``DrafterFamily.fields``
    in its module: ``k3_mla``'s MLA sizes), flat under ``drafter.``."""

    def __post_init__(self) -> None:
        _choice("drafter.family", self.family, tuple(FAMILIES))
        if self.draft_vocab_size is not None and not _unresolved(self.draft_vocab_size):
            _at_least("drafter.draft_vocab_size", self.draft_vocab_size, 1)
            _check(
                FAMILIES[self.family].serves_draft_vocab,
                "drafter.draft_vocab_size",
                self.draft_vocab_size,
                f"vLLM's class for drafter.family={self.family} serves the target's full vocabulary only (no d2t); "
                "expected null",
            )
        if self.attention_window is not None and not _unresolved(self.attention_window):
            queries = self.block_size if self.sample_from_anchor else self.block_size + 1
            _check(
                isinstance(self.attention_window, int) and self.attention_window > queries,
                "drafter.attention_window",
                self.attention_window,
                f"expected null (full attention) or an int >= {queries + 1}: the block's {queries} queries + 1, so "
                "that its last query still sees the anchor's context",
            )
            _check(
                FAMILIES[self.family].serves_window,
                "drafter.attention_window",
                self.attention_window,
                f"vLLM's class for drafter.family={self.family} has full-attention layers only (no sliding window "
                "in its config); expected null. K3 keeps acceptance over long context by training on windows as "
                'long as the served context (docs/guide.md, "Long context")',
            )
        for key, fam in FIELD_FAMILY.items():
            value = getattr(self, key)
            if value is not None and not _unresolved(value):
                if self.family != fam:
                    raise ConfigError(
                        f"drafter.{key}={value}: read by drafter.family={fam} only, this drafter is "
                        f"{self.family!r}; expected null (or drafter={fam})"
                    )
                if isinstance(value, int) and not isinstance(value, bool):  # a family's sizes
                    _at_least(f"drafter.{key}", value, 1)
        if self.num_layers < 1:
            raise ConfigError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.markov_rank < 0:
            raise ConfigError(f"drafter.markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"drafter.markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        for key in ("num_attention_heads", "num_key_value_heads"):
            _at_least(f"drafter.{key}", getattr(self, key), 1)
        for key in ("hidden_size", "intermediate_size", "head_dim"):
            if getattr(self, key) is not None:
                _at_least(f"drafter.{key}", getattr(self, key), 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


# short names for the run name, one per drafter field besides the ones spelled out
_TAG_NAMES = {
    "num_layers": "L",
    "block_size": "b",
    "hidden_size": "h",
    "intermediate_size": "i",
    "num_attention_heads": "nh",
    "num_key_value_heads": "kv",
    "head_dim": "hd",
    "rope_theta": "rope",
    "rms_norm_eps": "eps",
    "target_layer_ids": "ctx",
    "mask_token_id": "mask",
    "confidence_head_with_markov": "confmarkov",
    "draft_vocab_size": "dv",
    "attention_window": "win",
    **{k: v for fam in FAMILIES.values() for k, v in fam.tag_names.items()},  # each family's own
}
_TAG_SPELLED = ("family", "markov_rank", "markov_head_type", "sample_from_anchor", "enable_confidence_head")


def drafter_tag(drafter: Any) -> str:
    """A run name that tells drafters apart: ``markov256`` for the default, ``markov0`` for its
    Markov-off ablation, ``markov0-fillin-noconf`` for DFlash, ``k3_mla-markov256`` for another
    drafter family, then every other field that
    differs from the default (``markov16-L1-i256`` for the tiny test drafter)."""
    d = (
        drafter
        if isinstance(drafter, dict)
        else (OmegaConf.to_container(drafter, resolve=True) if isinstance(drafter, DictConfig) else asdict(drafter))
    )
    default = asdict(DSparkConfig())
    family = d.get("family", default["family"])
    named_family = [family] if family != default["family"] else []
    default.update(FAMILIES[family].tag_defaults if family in FAMILIES else {})
    head = f"markov{d['markov_rank']}" + (
        d["markov_head_type"] if d["markov_rank"] and d["markov_head_type"] != "vanilla" else ""
    )
    parts = (
        named_family
        + [head]
        + (["fillin"] if not d["sample_from_anchor"] else [])
        + (["noconf"] if not d["enable_confidence_head"] else [])
    )
    for k, v in d.items():
        if k in _TAG_SPELLED or v == default.get(k):
            continue
        v = "_".join(map(str, v)) if isinstance(v, list) else str(v).lower()
        parts.append(f"{_TAG_NAMES[k]}{v}")
    return "-".join(parts)
