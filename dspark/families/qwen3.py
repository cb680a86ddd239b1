"""The Qwen3-style drafter family: GQA attention with q/k norms and NeoX RoPE, served by vLLM 0.32
as ``Qwen3DSparkModel`` (method ``dspark``) or, in the fill-in layout without a Markov head, as
``DFlashDraftModel`` (method ``dflash``, which vLLM also serves on CPU).

Per layer: the context (``hidden_norm(fc(states))``) becomes extra keys/values through the
layer's ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE at the context position); queries come only
from the block. Our parameter names are vLLM's (it fuses q/k/v into ``qkv_proj`` and gate/up
into ``gate_up_proj`` when it loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dspark.families.base import (
    DrafterFamily,
    dspark_head_fields,
    linear_flops,
    mlp_flops,
    mlp_fused,
    window_fields,
)
from dspark.families.layers import MLP, RMSNorm
from dspark.serving.layouts import ANCHOR_FIELD, LAYER_IDS_FIELD, layout_named

if TYPE_CHECKING:
    from dspark.families.shared import SharedDims, SharedDrafterFields


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding. x: [B, N, L, D]; positions: [B, L]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None, :, None] * inv  # [B, 1, L, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, dims: SharedDims, cfg: SharedDrafterFields):
        super().__init__()
        self.n, self.nkv, self.d, self.theta = dims.num_heads, dims.num_kv_heads, dims.head_dim, cfg.rope_theta
        self.q_proj = nn.Linear(dims.hidden_size, self.n * self.d, bias=False)
        self.k_proj = nn.Linear(dims.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(dims.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, dims.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, length, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.nkv, self.d).transpose(1, 2)
        return rope(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,  # [B, L, H] block tokens (all anchors' blocks, flattened)
        positions: torch.Tensor,  # [B, L]
        context: torch.Tensor,  # [B, S, H] normed context projection
        context_positions: torch.Tensor,  # [B, S]
        mask: torch.Tensor,  # [B, 1, L, S+L] bool, True = may attend
    ) -> torch.Tensor:
        k_ctx, v_ctx = self._kv(context, context_positions)
        return self.attend(x, positions, k_ctx, v_ctx, mask)

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_ctx: torch.Tensor,
        v_ctx: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Block queries over [context K/V ; block K/V]. k_ctx/v_ctx: [B, Nkv, S, D] (RoPE applied);
        mask None = every query sees all of it (one block whose context is exactly k_ctx)."""
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, length, self.n, self.d)).transpose(1, 2)
        q = rope(q, positions, self.theta)
        k_blk, v_blk = self._kv(x, positions)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        if self.nkv != self.n:
            k = k.repeat_interleave(self.n // self.nkv, dim=1)
            v = v.repeat_interleave(self.n // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, self.n * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, dims: SharedDims, cfg: SharedDrafterFields):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(dims, cfg)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(dims.hidden_size, dims.intermediate_size)

    def forward(self, x, positions, context, context_positions, mask):  # shapes as Attention
        x = x + self.self_attn(self.input_layernorm(x), positions, context, context_positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def context_cache(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, Nkv, S, D] of the context at ``positions`` (what vLLM's KV cache holds)."""
        return self.self_attn._kv(context, positions)

    def forward_cached(
        self, x, positions, cache: tuple[torch.Tensor, torch.Tensor], mask=None
    ):  # one block, cached K/V
        x = x + self.self_attn.attend(self.input_layernorm(x), positions, *cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


MODEL_TYPE = "qwen3"
"""The ``model_type`` of the family's config.json: the draft layers are a Qwen3 config."""


class Qwen3Family(DrafterFamily):
    name = "qwen3"
    architectures = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel"}
    served_by_llama_cpp = True  # llama.cpp's converter reads both layouts (conversion/qwen.py)
    speculators_layers = MODEL_TYPE  # speculators' DSpark: Qwen3 draft layers
    cache_seq_dim = 2  # k, v: [B, Nkv, S, D]

    def layer(self, cfg: SharedDrafterFields, dims: SharedDims) -> nn.Module:
        return DecoderLayer(dims, cfg)

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
        """A Qwen3 config plus the drafter fields vLLM reads: :func:`served_fields`'s written out
        one by one, as their order in the pinned bytes has them (tests/dspark/test_export_bytes.py)."""
        base = {
            "model_type": MODEL_TYPE,
            "hidden_size": dims.hidden_size,
            "intermediate_size": dims.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": dims.num_heads,
            "num_key_value_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "max_position_embeddings": max_position_embeddings,
            "vocab_size": dims.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size or dims.vocab_size,  # < vocab_size: served with d2t
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": dtype,
            "target_hidden_size": dims.target_hidden_size,
            "block_size": cfg.block_size,
            "mask_token_id": dims.mask_token_id,
            "sample_from_anchor": cfg.sample_from_anchor,
        }
        lay = layout_named(layout)
        if lay.config_section is not None:  # vLLM's DFlash form: the layout's fields in their own object
            return {
                "architectures": [self.architectures[layout]],
                **base,
                lay.config_section: {
                    LAYER_IDS_FIELD: target_layer_ids,
                    "mask_token_id": dims.mask_token_id,
                    ANCHOR_FIELD: lay.anchor_block,
                    **window_fields(cfg),
                },
            }
        return {
            "architectures": [self.architectures[layout]],
            **base,
            LAYER_IDS_FIELD: target_layer_ids,
            **dspark_head_fields(cfg),
            # a window goes in dflash_config, with the block's ids beside it: llama.cpp's converter
            # reads mask_token_id from dflash_config alone once there is one (conversion/qwen.py,
            # DSparkModel), and without it serves mask id -1 and aborts on the first draft
            **(
                {
                    "dflash_config": {
                        "target_layer_ids": target_layer_ids,
                        "mask_token_id": dims.mask_token_id,
                        **window_fields(cfg),
                    }
                }
                if cfg.attention_window is not None
                else {}
            ),
        }

    def vllm_fused(self, ours: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(num_layers):
            a = f"layers.{i}.self_attn."
            out[f"model.{a}qkv_proj.weight"] = torch.cat(
                [ours[a + "q_proj.weight"], ours[a + "k_proj.weight"], ours[a + "v_proj.weight"]]
            )
            out.update(mlp_fused(ours, i))
        return out

    def layer_flops(
        self,
        cfg: SharedDrafterFields,
        dims: SharedDims,
        *,
        context_rows: int,
        block_rows: int,
        attention: tuple[int, int, int],
    ) -> tuple[int, int, int]:
        h, n, nkv, d = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim
        ctx_kv = 2 * linear_flops(context_rows, h, nkv * d)
        proj = (
            linear_flops(block_rows, h, n * d)
            + 2 * linear_flops(block_rows, h, nkv * d)
            + linear_flops(block_rows, n * d, h)
            + mlp_flops(block_rows, dims)
        )
        b, queries, keys = attention
        return ctx_kv, proj, 2 * 2 * b * n * queries * keys * d  # QK^T and AV

    def cache_values_per_token(self, dims: SharedDims) -> int:
        return 2 * dims.num_kv_heads * dims.head_dim


FAMILY = Qwen3Family()
