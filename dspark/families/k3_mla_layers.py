"""Kimi K3's DSpark drafter layers: dense multi-head latent attention (MLA), as vLLM 0.32 serves them.

The serving class is ``vllm.models.kimi_k3.nvidia.dspark_mla.K3DSparkForCausalLM`` (architecture
``K3DSparkModel``); its attention is ``vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention``
built with ``use_rope=True, non_causal_multi_token_decode=True``. docs/k3_mla_notes.md walks
through that code with file:line references; this module is the same math in PyTorch, in the
calling convention of :mod:`dspark.model` (queries from the block only; keys/values from the
context before each anchor and from the block itself; RoPE at each token's position; a boolean
mask, True = may attend).

Per layer, for a token with normed input x (width H):

* query: ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` -> N heads of ``[q_nope (Dn) | q_pe (Dr)]``
  (``q_lora_rank`` None: ``q = q_proj(x)``; vLLM's K3 DSpark config refuses that, the layer
  keeps it only because ``MultiHeadLatentAttention`` has it).
* latent: ``[c | k_pe] = kv_a_proj_with_mqa(x)``, ``c = kv_a_layernorm(c)`` (width R), ``k_pe``
  (width Dr, one head shared by all N) -- this pair is what vLLM's latent cache stores per token.
* RoPE on ``q_pe`` and ``k_pe`` only: GPT-J style (interleaved pairs (0,1), (2,3), ...; vLLM
  builds it with ``is_neox_style=False``), fp32 cos/sin, theta and scaling from the config's
  ``rope_parameters``.
* keys/values: ``[k_nope | v] = kv_b_proj(c)`` per head; ``k = [k_nope | k_pe]``.
* ``softmax(q k^T * scale) v`` with ``scale = (Dn + Dr) ** -0.5`` (times ``mscale**2`` for
  DeepSeek-YaRN), then ``o_proj`` over the N heads' ``v`` (width Dv each).

The context enters every layer as latents: ``ctx = context_norm(context_proj(states))`` once,
then each layer's own ``kv_a_proj_with_mqa`` + ``kv_a_layernorm`` + RoPE at the context position
(vLLM fuses the layers' ``kv_a_proj_with_mqa`` into ``context_kv_proj`` and writes the result into
each layer's cache: ``K3DSparkModel.precompute_and_store_context_kv``). The layer reads no
other context weight, so :meth:`MLAAttention.latent` is the whole per-layer context path.

Parameter names are the ones vLLM's ``K3DSparkForCausalLM.load_weights`` reads (before its
``WeightsMapper`` fuses ``q_a_proj``/``kv_a_proj_with_mqa`` and ``gate_proj``/``up_proj``).
Shape symbols as in :mod:`dspark.model`, plus R = kv_lora_rank, Dn/Dr/Dv the nope/rope/value
head dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dspark.families.layers import MLP, RMSNorm

DEFAULT_ROPE_THETA = 50_000.0
"""``K3DSparkConfig``'s ``rope_theta`` default (vllm/transformers_utils/configs/k3_dspark.py:18)."""
MLA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope_parameters",
)
"""The config.json keys the K3 layers read (docs/k3_mla_notes.md, "Config keys")."""


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as ``K3DSparkConfig.__init__`` fills it: ``rope_theta`` (default
    50000) folded in, ``rope_type`` default ``"default"``."""
    params = dict(hf.get("rope_parameters") or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", float(hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    return params


@dataclass(frozen=True)
class MLAConfig:
    """The sizes and settings of the K3 DSpark layers (the config.json fields in :data:`MLA_FIELDS`)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA}
    )

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MLA {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_nope_head_dim < 0 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ValueError(f"MLA qk_nope_head_dim >= 0 and q_lora_rank >= 1 (or None), got {self}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"MLA hidden_act {self.hidden_act!r}: only 'silu' is implemented (KimiMLP also has situ)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Per-token, per-layer width of vLLM's latent cache: R + Dr."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MLAConfig":
        """From a K3 DSpark config.json dict, reading the keys vLLM reads (missing ones: the
        defaults ``K3DSparkConfig``/``DeepseekV3Config`` would give are *not* guessed here, except
        ``rope_parameters``/``rope_theta`` and ``hidden_act``)."""
        return cls(
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
            rope_parameters=_rope_parameters(hf),
        )

    def hf_fields(self) -> dict[str, Any]:
        """The :data:`MLA_FIELDS` of a config.json (``from_hf(cfg.hf_fields()) == cfg``)."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": dict(self.rope_parameters),
        }


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class MLARope(nn.Module):
    """vLLM's rotary embedding for the K3 MLA layer, in PyTorch.

    ``rope_type == "default"``: ``RotaryEmbedding`` (inv_freq = theta^(-2i/Dr)), GPT-J style.
    Any other ``rope_type``: vLLM renames it ``deepseek_llama_scaling`` when
    ``attention_factor == 1.0`` and ``deepseek_yarn`` otherwise; both build
    ``DeepseekScalingRotaryEmbedding`` (YaRN frequencies over ``original_max_position_embeddings``,
    cos/sin times ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``), and only
    ``deepseek_yarn`` multiplies the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
    (``attention_factor`` itself is not applied). Buffers are not persistent: nothing of this is
    exported.
    """

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        p = cfg.rope_parameters
        if p.get("rope_dim") not in (None, cfg.qk_rope_head_dim) or p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"MLA rope_parameters {p}: a partial rotary dimension is not implemented")
        d, base = cfg.qk_rope_head_dim, float(p["rope_theta"])
        self.kind = p["rope_type"]
        self.softmax_mscale2 = 1.0
        self.cos_sin_scale = 1.0
        pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
        if self.kind == "default":
            inv_freq = 1.0 / pos_freqs
        else:
            self.kind = "deepseek_llama_scaling" if p.get("attention_factor") == 1.0 else "deepseek_yarn"
            factor = float(p["factor"])
            orig = int(p["original_max_position_embeddings"])
            beta_fast, beta_slow = p.get("beta_fast", 32), p.get("beta_slow", 1)

            def corr_dim(rot: float) -> float:
                return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

            low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), d - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
            extrapolation_mask = 1 - ramp
            inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_mask) + (1.0 / pos_freqs) * extrapolation_mask
            self.cos_sin_scale = _yarn_get_mscale(factor, float(p.get("mscale", 1))) / _yarn_get_mscale(
                factor, float(p.get("mscale_all_dim", 0))
            )
            if self.kind == "deepseek_yarn":
                m = _yarn_get_mscale(factor, float(p.get("mscale_all_dim", False)))
                self.softmax_mscale2 = m * m
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, L, ..., Dr] (any head dims between L and Dr); positions: [B, L]. Rotates the
        interleaved pairs in fp32 and returns x's dtype."""
        ang = positions.float()[..., None] * self.inv_freq.float()  # [B, L, Dr/2]
        cos, sin = ang.cos() * self.cos_sin_scale, ang.sin() * self.cos_sin_scale
        for _ in range(x.dim() - 3):
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


Latent = tuple[torch.Tensor, torch.Tensor]
"""(c [B, S, R] after kv_a_layernorm, k_pe [B, S, Dr] after RoPE): one layer's latent cache rows."""


class MLAAttention(nn.Module):
    """One layer's multi-head latent attention (vLLM ``MultiHeadLatentAttention``, no output
    gate, RoPE on, non-causal within the block through the mask)."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        n, h = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, h, bias=False)
        self.rotary_emb = MLARope(cfg)
        self.scale = cfg.qk_head_dim**-0.5 * self.rotary_emb.softmax_mscale2

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> Latent:
        """x [B, S, H] at positions [B, S] -> this layer's latent cache rows (c, k_pe). Each
        position's rows depend on that position only, so appending along S is exact."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c), self.rotary_emb(k_pe, positions)

    def _queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.cfg.q_lora_rank is not None else self.q_proj(x)
        q_nope, q_pe = q.view(b, length, self.cfg.num_heads, self.cfg.qk_head_dim).split(
            [self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], dim=-1
        )
        return torch.cat([q_nope, self.rotary_emb(q_pe, positions)], dim=-1).transpose(1, 2)  # [B, N, L, Dq]

    def _keys_values(self, latent: Latent) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows (c [B, S, R], k_pe [B, S, Dr]) -> k [B, N, S, Dn+Dr], v [B, N, S, Dv]."""
        c, k_pe = latent
        b, s, _ = c.shape
        n, dn = self.cfg.num_heads, self.cfg.qk_nope_head_dim
        k_nope, v = self.kv_b_proj(c).view(b, s, n, dn + self.cfg.v_head_dim).split([dn, self.cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(b, s, n, -1)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # [B, L, H] block tokens (all anchors' blocks, flattened)
        positions: torch.Tensor,  # [B, L]
        context: torch.Tensor,  # [B, S, H] context_norm(context_proj(states))
        context_positions: torch.Tensor,  # [B, S]
        mask: Optional[torch.Tensor],  # [B, 1, L, S+L] bool, True = may attend
    ) -> torch.Tensor:
        return self.attend(x, positions, self.latent(context, context_positions), mask)

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor, context: Latent, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Block queries over [context latents ; block latents]; mask None = every query sees
        all of it (one block whose context is exactly ``context``)."""
        b, length, _ = x.shape
        q = self._queries(x, positions)
        blk_c, blk_pe = self.latent(x, positions)
        k, v = self._keys_values((torch.cat([context[0], blk_c], dim=1), torch.cat([context[1], blk_pe], dim=1)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, N, L, Dv]
        return self.o_proj(out.transpose(1, 2).reshape(b, length, self.cfg.num_heads * self.cfg.v_head_dim))


class MLADecoderLayer(nn.Module):
    """``K3DSparkDecoderLayer``: pre-norm residual MLA + KimiMLP (vLLM fuses each residual add
    into the next RMSNorm; the sums are the same)."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # vLLM's KimiMLP with hidden_act="silu" is our SwiGLU MLP: down(silu(gate(x)) * up(x)), the same
        # names (vLLM fuses gate_proj/up_proj into gate_up_proj, shards 0 and 1, when it loads)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, context, context_positions, mask):  # shapes as MLAAttention.forward
        x = x + self.self_attn(self.input_layernorm(x), positions, context, context_positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def context_cache(self, context: torch.Tensor, positions: torch.Tensor) -> Latent:
        """This layer's latent cache rows for the context (vLLM ``precompute_and_store_context_kv``):
        the normed context projection goes through ``kv_a_proj_with_mqa`` only, no
        ``input_layernorm`` and no query."""
        return self.self_attn.latent(context, positions)

    def forward_cached(
        self, x: torch.Tensor, positions: torch.Tensor, cache: Latent, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """One block over this layer's cached context latents (mask None: all of them)."""
        x = x + self.self_attn.attend(self.input_layernorm(x), positions, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
