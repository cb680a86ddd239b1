"""What every drafter has, whatever its family: the shared ``drafter.*`` fields (the schema
:class:`dspark.config.DSparkConfig` composes with each family's own, and checks) and the
shared resolved sizes (:class:`dspark.families.DrafterDims` adds each family's). Below the
families, so that their signatures name these without importing the composed types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SharedDrafterFields:
    """The drafter fields every family reads (:class:`DSparkConfig` adds each family's own)."""

    family: str = "qwen3"
    """The backbone's layers and the vLLM class that serves them (:mod:`dspark.families`):
    ``qwen3`` (GQA, ``Qwen3DSparkModel``/``DFlashDraftModel``) or ``k3_mla`` (Kimi K3's
    multi-head latent attention, ``K3DSparkModel``; ``drafter=k3_mla``)."""
    num_layers: int = 5
    """Decoder layers in the non-causal block-diffusion backbone."""
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
    draft_vocab_size: Optional[int] = None
    """The draft's own vocabulary: the N target tokens most frequent among the training split's
    supervised next tokens (:mod:`dspark.data.draft_vocab`, as speculators builds its ``d2t``), with its
    own frozen LM head (the target's rows of those tokens) and a Markov output over them; vLLM's
    ``Qwen3DSparkModel`` serves it through ``d2t``. A token outside it is never drafted. None: the
    target's full vocabulary. An int in [1, the target's vocab_size]; ``qwen3`` family only (vLLM's
    K3 class serves the full vocabulary)."""
    attention_window: Optional[int] = None
    """W: sliding-window attention over the context. A block query at position p sees the context
    positions p0 with ``p - p0 < W`` (W keys counting its own position: vLLM's sliding window and
    llama.cpp's ``llama_hparams::is_masked_swa``) and its whole block; None: every context position
    before the anchor (full attention). Applied in training (the block mask), the reference loop,
    the export (``dflash_config.use_swa`` + ``swa_window_size``), the GGUF and speculators' format,
    so a draft step reads at most W context entries at any context length. At least the block's
    query count + 1 (its last query still sees the anchor's context); a family whose vLLM class
    has no window (``k3_mla``) refuses it."""


@dataclass
class SharedDims:
    """The resolved sizes every family has; :class:`dspark.families.DrafterDims` adds each
    family's own fields."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    num_context_layers: int
    mask_token_id: int
