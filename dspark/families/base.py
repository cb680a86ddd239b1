"""What a drafter family is: the contract between one served architecture's layers and the rest
of the project (docs/architecture.md, "Adding a drafter family").

Everything around the backbone layers is shared by every family and knows nothing of them:
the block layout and its mask, the context projection (``fc`` + ``hidden_norm``), the final
norm, the Markov and confidence heads, the loss, the trainer (DeepSpeed ZeRO 0-3, offline,
online and colocated data) and the reference loop. A family supplies:

* **its decoder layer** (:meth:`DrafterFamily.layer`), a module with
  ``forward(x, positions, context, context_positions, mask)`` (the training pass: block tokens
  over the normed context projection and the block mask), ``context_cache(context, positions)``
  (one layer's per-token context cache, what vLLM precomputes and stores: a tuple of tensors that
  grows along :attr:`cache_seq_dim`) and ``forward_cached(x, positions, cache, mask)`` (one
  block over that cache, as vLLM serves it; ``mask`` [B, 1, Q, S + Q] or None for all of it);
* **its own settings** (:attr:`fields`): a dataclass of the ``drafter.*`` fields only it reads,
  each ``Optional`` with default ``None`` and a docstring. The config schema
  (:class:`dspark.config.DSparkConfig`) and the resolved sizes (:class:`DrafterDims`) are
  composed from the shared fields and every registered family's, flat (``drafter.q_lora_rank``);
  another family refuses them when set. With them: their short names in a run name
  (:attr:`tag_names`), what its ``conf/drafter/NAME.yaml`` sets (:attr:`tag_defaults`), and
  whether its vLLM class serves a draft vocabulary map (:attr:`serves_draft_vocab`) and a sliding
  attention window (:attr:`serves_window`), whether llama.cpp serves it (:attr:`served_by_llama_cpp`)
  and which draft layers of speculators' DSpark it is (:attr:`speculators_layers`);
  A family's methods get the composed ``DSparkConfig`` and ``DrafterDims``; they are annotated
  with the shared parts (:mod:`dspark.families.shared`), which the composed types extend;
* **its sizes** (:meth:`resolve_dims`): its own fields filled into :class:`DrafterDims` from
  ``drafter.*`` or the target;
* **its export layout**: the architecture vLLM's registry maps to its class, per export layout
  (:attr:`architectures`); the ``config.json`` that class reads (:meth:`config_json`); the
  checkpoint names its ``load_weights`` reads (:attr:`serving_prefixes`: our module names that
  differ, by prefix); and the tensors vLLM fuses when it loads (:meth:`vllm_fused`), which the
  export check compares with ours;
* **its costs**: the matmul FLOPs of its layers (:meth:`layer_flops`, for :mod:`dspark.flops`)
  and the context cache per token and layer (:meth:`cache_values_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from dspark.families.shared import SharedDims, SharedDrafterFields


@dataclass
class NoFields:
    """A family with no ``drafter.*`` fields of its own."""


class DrafterFamily:
    name: str = ""
    architectures: dict[str, str] = {}
    """Export layout (:data:`dspark.serving.methods.LAYOUTS`) -> ``architectures[0]`` of its
    config.json. A layout a family lacks cannot be exported for it."""
    serving_prefixes: tuple[tuple[str, str], ...] = ()
    """(our name prefix, the served checkpoint's name prefix) for the shared modules a family's
    vLLM class names otherwise; every other name is the same on both sides."""
    fields: ClassVar[type] = NoFields
    """A dataclass of the ``drafter.*`` fields only this family reads (each ``Optional``, default
    ``None``: derived from the target or the family's defaults by :meth:`resolve_dims`). Composed
    into ``DSparkConfig`` and ``DrafterDims`` under the same names; another family refuses them."""
    tag_names: dict[str, str] = {}
    """Each of :attr:`fields` -> its short name in a run name (``qr1536``)."""
    tag_defaults: dict[str, Any] = {}
    """What ``conf/drafter/NAME.yaml`` sets besides ``family``: a run name spells a field only where
    it differs from these (``k3_mla-markov256``, not ``...-rope50000.0``); tests/test_configs.py
    keeps the two equal."""
    serves_draft_vocab: bool = True
    """Whether the family's vLLM class serves a reduced draft vocabulary (``draft_vocab_size``
    below the target's, with ``d2t``); False refuses ``drafter.draft_vocab_size``."""
    serves_window: bool = True
    """Whether the family's vLLM class serves a sliding attention window (``dflash_config.use_swa``);
    False refuses ``drafter.attention_window``."""
    served_by_llama_cpp: bool = False
    """Whether the pinned llama.cpp build (:mod:`dspark.serving.llama_cpp`) converts and serves the
    family's export (its converter has a class for the family's architectures); False: the GGUF
    export and the eval's llama.cpp rows refuse it (:func:`dspark.export.gguf.llama_cpp_problem`)."""
    speculators_layers: Optional[str] = None
    """The ``transformer_layer_config.model_type`` of speculators' DSpark whose draft layers are this
    family's (:mod:`dspark.export.speculators_format` converts the family's ``dspark`` export to it and
    reads such a checkpoint back as this family); None: speculators' DSpark cannot hold the family."""
    inits_from_target_layers: bool = True
    """Whether the family's decoder layers have a target decoder layer's shape (GQA attention and
    MLP), so that ``train.init_from_target_layers`` can copy target layers into them
    (:meth:`dspark.model.DSparkDrafter.init_layers_from`); False refuses that key."""
    cache_seq_dim: int = 2
    """The dimension of each ``context_cache`` tensor that runs along the context positions."""
    context_proj_param: str = "model.fc.weight"
    """vLLM's name for the context projection's weight (the export check reports its width)."""

    @property
    def config_fields(self) -> tuple[str, ...]:
        """The names of :attr:`fields`."""
        return tuple(f.name for f in fields(self.fields))

    def resolve_dims(self, cfg: SharedDrafterFields, dims: SharedDims, target_config: dict[str, Any]) -> SharedDims:
        """``dims`` with the family's own sizes filled in (default: nothing of its own)."""
        return dims

    def layer(self, cfg: SharedDrafterFields, dims: SharedDims) -> nn.Module:
        raise NotImplementedError

    def config_json(
        self,
        cfg: SharedDrafterFields,
        dims: SharedDims,
        layout: str,
        *,
        target_layer_ids: list[int],
        max_position_embeddings: int,
        dtype: str,
    ) -> dict[str, Any]:
        """config.json for ``layout``: ``target_layer_ids`` in vLLM's convention
        (:mod:`dspark.core.layer_ids`), the served context length, the weights' dtype."""
        raise NotImplementedError

    def vllm_fused(self, ours: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        """vLLM parameter name -> the tensor its loader must build from our served tensors."""
        raise NotImplementedError

    def layer_flops(
        self,
        cfg: SharedDrafterFields,
        dims: SharedDims,
        *,
        context_rows: int,
        block_rows: int,
        attention: tuple[int, int, int],
    ) -> tuple[int, int, int]:
        """One layer's matmul FLOPs (forward): (context cache, block projections + MLP,
        attention). ``attention`` is (B, queries per row, keys per row), counted dense."""
        raise NotImplementedError

    def cache_values_per_token(self, dims: SharedDims) -> int:
        """Values one layer's context cache holds per token (vLLM's KV or latent cache)."""
        raise NotImplementedError

    # --- names -----------------------------------------------------------------------------
    def to_serving(self, name: str) -> str:
        for ours, served in self.serving_prefixes:
            if name.startswith(ours):
                return served + name[len(ours) :]
        return name

    def from_serving(self, name: str) -> str:
        for ours, served in self.serving_prefixes:
            if name.startswith(served):
                return ours + name[len(served) :]
        return name


MARKOV_HEAD_PREFIX = "markov_head."
"""Our (and the served) name prefix of the Markov head's tensors."""


def served_markov_rank(cfg: SharedDrafterFields) -> int:
    """The Markov rank a ``dspark``-layout export serves: the drafter's own, except that a drafter
    without a Markov head (``markov_rank`` 0, the Markov-off ablation) is served with a zero rank-1
    head (:func:`zero_markov_head`): vLLM's DSpark classes always build one, and a zero head adds
    nothing to the logits, in vLLM and in llama.cpp alike. The one home of that rule: the config
    (:func:`dspark_head_fields`), the weights and their read-back (:func:`zero_markov_head`,
    :func:`without_zero_markov_head`) and the confidence head's columns
    (:func:`confidence_zero_columns`) follow it."""
    return max(cfg.markov_rank, 1)


def serves_zero_markov_head(cfg: SharedDrafterFields) -> bool:
    """Whether a ``dspark``-layout export serves a zero Markov head the drafter does not have."""
    return served_markov_rank(cfg) != cfg.markov_rank


def zero_markov_head(cfg: SharedDrafterFields, dims: SharedDims, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The served tensors of the zero Markov head (:func:`served_markov_rank`) of a drafter without
    one, by their served names: ``markov_w1`` over the target vocabulary, ``markov_w2`` over the
    draft's; nothing for a drafter with its own head."""
    if not serves_zero_markov_head(cfg):
        return {}
    rank, v = served_markov_rank(cfg), dims.vocab_size
    return {
        f"{MARKOV_HEAD_PREFIX}markov_w1.weight": torch.zeros(v, rank, dtype=dtype),
        f"{MARKOV_HEAD_PREFIX}markov_w2.weight": torch.zeros(cfg.draft_vocab_size or v, rank, dtype=dtype),
    }


def without_zero_markov_head(weights: dict[str, torch.Tensor], cfg: SharedDrafterFields) -> dict[str, torch.Tensor]:
    """A ``dspark``-layout export's weights read back: the zero Markov head it serves for a drafter
    without one (:func:`zero_markov_head`) left out; the weights as they are otherwise."""
    if not serves_zero_markov_head(cfg):
        return weights
    return {k: v for k, v in weights.items() if not k.startswith(MARKOV_HEAD_PREFIX)}


def confidence_zero_columns(cfg: SharedDrafterFields) -> int:
    """How many zero input columns the served confidence head gets (0: none). Every DSpark export
    serves its confidence head over [state; Markov embedding], the one form llama.cpp reads: a head
    trained on the state alone gets zero weights for the Markov part (the zero head's when
    markov_rank is 0: :func:`served_markov_rank`), which leaves its logit as it was, in vLLM and in
    llama.cpp alike."""
    if not cfg.enable_confidence_head or (cfg.markov_rank > 0 and cfg.confidence_head_with_markov):
        return 0
    return served_markov_rank(cfg)


def served_fields(cfg: SharedDrafterFields, dims: SharedDims, *, dtype: str) -> dict[str, Any]:
    """The config.json keys every DSpark-family vLLM class reads about the draft whatever its
    layers (the vocabulary and its map, the block, the mask token, the context width, the dtype),
    with their values. A family writes them, ``**served_fields(...)`` where its key order is free;
    the export checks that every family's config.json carries them with these values
    (:func:`missing_served_fields`)."""
    return {
        "vocab_size": dims.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size or dims.vocab_size,  # < vocab_size: served with d2t
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "target_hidden_size": dims.target_hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": dims.mask_token_id,
        "sample_from_anchor": cfg.sample_from_anchor,
    }


def missing_served_fields(config: dict[str, Any], cfg: SharedDrafterFields, dims: SharedDims, dtype: str) -> list[str]:
    """The :func:`served_fields` keys a family's config.json lacks or writes otherwise."""
    return [
        f"{k}: expected {v!r}, got {config.get(k, '<missing>')!r}"
        for k, v in served_fields(cfg, dims, dtype=dtype).items()
        if config.get(k, object()) != v
    ]


def dspark_head_fields(cfg: SharedDrafterFields) -> dict[str, Any]:
    """The Markov and confidence heads' config.json fields, as vLLM's ``DSparkMarkovHead`` /
    ``DSparkConfidenceHead`` read them (shared by every family's DSpark class)."""
    return {
        "markov_rank": served_markov_rank(cfg),  # rank 0 is served as a zero head (same logits)
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.enable_confidence_head,  # see confidence_zero_columns
    }


def window_fields(cfg: SharedDrafterFields) -> dict[str, Any]:
    """``drafter.attention_window`` as vLLM's DFlash/DSpark classes (``_resolve_layer_attention``:
    every layer sliding and non-causal) and llama.cpp's converter (``add_sliding_window`` with an
    all-sliding pattern) read it, inside ``dflash_config``; nothing for full attention."""
    if cfg.attention_window is None:
        return {}
    return {"use_swa": True, "swa_window_size": int(cfg.attention_window)}


def served_window(config: dict[str, Any]) -> Optional[int]:
    """The attention window a config.json serves (:func:`window_fields` read back, as vLLM reads
    it: ``dflash_config.swa_window_size``, else the top-level ``sliding_window``, when
    ``dflash_config.use_swa`` is true), or None for full attention."""
    dflash = config.get("dflash_config") or {}
    if not dflash.get("use_swa", False):
        return None
    window = dflash.get("swa_window_size", config.get("sliding_window"))
    return None if window is None else int(window)


def linear_flops(rows: int, n_in: int, n_out: int) -> int:
    """A matmul [rows, n_in] x [n_in, n_out]: 2 * rows * n_in * n_out (multiply and add)."""
    return 2 * rows * n_in * n_out


def mlp_flops(rows: int, dims: SharedDims) -> int:
    """The shared SwiGLU MLP (:class:`dspark.families.layers.MLP`) over ``rows``: gate, up and down."""
    return 3 * linear_flops(rows, dims.hidden_size, dims.intermediate_size)


def mlp_fused(ours: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """What vLLM fuses of the shared MLP when it loads a layer: ``gate_up_proj`` = [gate; up]
    (Qwen3's MLP and K3's ``KimiMLP`` alike)."""
    m = f"layers.{layer}.mlp."
    return {f"model.{m}gate_up_proj.weight": torch.cat([ours[m + "gate_proj.weight"], ours[m + "up_proj.weight"]])}
