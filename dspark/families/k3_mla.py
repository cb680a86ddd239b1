"""Kimi K3's drafter family (``drafter.family=k3_mla``): what the shared drafter needs to know
to build, size, serve and count the FLOPs of K3's DSpark layers, as vLLM 0.32's
``K3DSparkForCausalLM`` serves them (architecture ``K3DSparkModel``). The layers themselves, and
the math they follow, are :mod:`dspark.families.k3_mla_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from dspark.families.base import (
    DrafterFamily,
    dspark_head_fields,
    linear_flops,
    mlp_flops,
    mlp_fused,
    served_fields,
)
from dspark.families.k3_mla_layers import DEFAULT_ROPE_THETA, MLAConfig, MLADecoderLayer

if TYPE_CHECKING:
    from dspark.families.shared import SharedDims, SharedDrafterFields


@dataclass
class K3MLAFields:
    """``drafter.*`` fields read by ``drafter.family=k3_mla`` only (and, resolved, its sizes in
    :class:`~dspark.families.DrafterDims`). None: the target's value when the drafter is as
    wide as the target and the target has one, else :data:`K3_DSPARK_SIZES` (1536, 512, 128, 64,
    128)."""

    q_lora_rank: Optional[int] = None
    """The query's low rank Rq."""
    kv_lora_rank: Optional[int] = None
    """The latent width R (the cache holds R + qk_rope_head_dim per token and layer)."""
    qk_nope_head_dim: Optional[int] = None
    """Per-head query/key width without RoPE."""
    qk_rope_head_dim: Optional[int] = None
    """Per-head RoPE width (one k_pe shared by all heads)."""
    v_head_dim: Optional[int] = None
    """Per-head value width."""


K3_DSPARK_SIZES = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
"""The MLA sizes a K3 drafter gets when neither ``drafter.*`` nor the target sets them: the
latent and query ranks vLLM's K3 DSpark code states (its context GEMM's row counts, 5 x 576 =
R + Dr and 5 x 2112 = Rq + R + Dr, ``dspark_mla.py:272-273``) and the DeepSeek-V3/Kimi head
dims (nope 128, rope 64, value 128)."""


class K3MLAFamily(DrafterFamily):
    """Kimi K3's drafter as vLLM's ``K3DSparkForCausalLM`` serves it (architecture
    ``K3DSparkModel``, method ``dspark``; GPU only: its attention is Triton/CUDA). Our shared
    context projection and final norm are its ``context_proj``/``context_norm``/``final_norm``."""

    name = "k3_mla"
    architectures = {"dspark": "K3DSparkModel"}
    serving_prefixes = (("fc.", "context_proj."), ("hidden_norm.", "context_norm."), ("norm.", "final_norm."))
    fields = K3MLAFields
    tag_names = {
        "q_lora_rank": "qr",
        "kv_lora_rank": "kvr",
        "qk_nope_head_dim": "nope",
        "qk_rope_head_dim": "ropehd",
        "v_head_dim": "vhd",
    }
    tag_defaults = {"rope_theta": DEFAULT_ROPE_THETA}  # conf/drafter/k3_mla.yaml sets it
    serves_draft_vocab = False  # K3DSparkForCausalLM takes the full vocabulary, with no d2t
    serves_window = False  # K3DSparkModel's layers are full attention: no window key in its config
    served_by_llama_cpp = False  # llama.cpp's converter has no class for K3DSparkModel
    speculators_layers = None  # speculators' DSpark has Qwen3-style draft layers only
    inits_from_target_layers = False  # MLA layers: no target decoder layer has their shape
    cache_seq_dim = 1  # c [B, S, R], k_pe [B, S, Dr]
    context_proj_param = "model.context_proj.weight"

    def resolve_dims(self, cfg: SharedDrafterFields, dims: SharedDims, target_config: dict[str, Any]) -> SharedDims:
        """Each MLA size: ``drafter.<key>``, else the target's own (a drafter as wide as an MLA
        target copies its attention layout, as the Qwen3 family copies a GQA target's heads),
        else :data:`K3_DSPARK_SIZES`."""
        as_wide = dims.hidden_size == int(target_config["hidden_size"])
        sizes = {}
        for key, default in K3_DSPARK_SIZES.items():
            own = getattr(cfg, key)
            theirs = target_config.get(key) if as_wide else None
            sizes[key] = int(own if own is not None else theirs if theirs is not None else default)
        return replace(
            dims,
            num_kv_heads=dims.num_heads,  # one latent shared by every head; written for config readers
            head_dim=sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
            **sizes,
        )

    def mla_config(self, cfg: SharedDrafterFields, dims: SharedDims) -> MLAConfig:
        return MLAConfig(
            hidden_size=dims.hidden_size,
            intermediate_size=dims.intermediate_size,
            num_heads=dims.num_heads,
            q_lora_rank=dims.q_lora_rank,
            kv_lora_rank=dims.kv_lora_rank,
            qk_nope_head_dim=dims.qk_nope_head_dim,
            qk_rope_head_dim=dims.qk_rope_head_dim,
            v_head_dim=dims.v_head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        )

    def layer(self, cfg: SharedDrafterFields, dims: SharedDims) -> nn.Module:
        return MLADecoderLayer(self.mla_config(cfg, dims))

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
        """``K3DSparkConfig`` (a ``DeepseekV3Config``): every key its classes read written out
        (docs/k3_mla_notes.md, "Config keys"), dense (no experts), default RoPE (vLLM's K3 draft
        has no YaRN), the served context length as the RoPE table's rows."""
        mla = replace(self.mla_config(cfg, dims), max_position_embeddings=int(max_position_embeddings))
        return {
            "architectures": [self.architectures[layout]],
            "model_type": "k3_dspark",
            **mla.hf_fields(),
            "num_hidden_layers": cfg.num_layers,
            "num_key_value_heads": dims.num_heads,
            "rope_theta": float(cfg.rope_theta),
            "n_routed_experts": 0,
            "n_shared_experts": 0,
            "num_experts_per_tok": 0,
            "num_target_layers": len(target_layer_ids),
            "target_layer_ids": target_layer_ids,
            **served_fields(cfg, dims, dtype=dtype),
            **dspark_head_fields(cfg),
        }

    def vllm_fused(self, ours: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
        """What ``K3DSparkForCausalLM.load_weights`` builds: each layer's ``fused_qkv_a_proj``
        (q_a_proj, kv_a_proj_with_mqa) and ``gate_up_proj``, and ``context_kv_proj``, every
        layer's ``kv_a_proj_with_mqa`` stacked (``_duplicate_context_kv_weights``)."""
        out = {}
        for i in range(num_layers):
            a = f"layers.{i}.self_attn."
            out[f"model.{a}fused_qkv_a_proj.weight"] = torch.cat(
                [ours[a + "q_a_proj.weight"], ours[a + "kv_a_proj_with_mqa.weight"]]
            )
            out.update(mlp_fused(ours, i))
        out["model.context_kv_proj.weight"] = torch.cat(
            [ours[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in range(num_layers)]
        )
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
        """The training pass's matmuls: the latent of every context and block row
        (``kv_a_proj_with_mqa``), its expansion by ``kv_b_proj`` (the prefill form: per context
        row too), queries and ``o_proj`` on block rows, dense attention with Dn+Dr-wide scores
        and Dv-wide values."""
        h, n = dims.hidden_size, dims.num_heads
        rq, r, dn, dr, dv = (
            dims.q_lora_rank,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
        )
        ctx = linear_flops(context_rows, h, r + dr) + linear_flops(context_rows, r, n * (dn + dv))
        proj = (
            linear_flops(block_rows, h, rq)
            + linear_flops(block_rows, rq, n * (dn + dr))
            + linear_flops(block_rows, h, r + dr)
            + linear_flops(block_rows, r, n * (dn + dv))
            + linear_flops(block_rows, n * dv, h)
            + mlp_flops(block_rows, dims)
        )
        b, queries, keys = attention
        return ctx, proj, 2 * b * n * queries * keys * ((dn + dr) + dv)

    def cache_values_per_token(self, dims: SharedDims) -> int:
        return dims.kv_lora_rank + dims.qk_rope_head_dim


FAMILY = K3MLAFamily()
