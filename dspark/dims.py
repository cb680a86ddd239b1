"""The drafter's resolved sizes, shared by the model, its drafter families, the checkpoint and
the export (a module of its own so that the families can name it without importing the model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DrafterDims:
    """DSparkConfig with every derived size filled in from the target."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    num_context_layers: int
    mask_token_id: int
    # multi-head latent attention sizes (family k3_mla; None for the others)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
