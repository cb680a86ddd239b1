"""Kimi K3's MLA drafter layers (dspark/families/k3_mla_layers.py) against an independent
implementation of the same math: transformers' ``DeepseekV3Attention`` with the same weights and
the block mask.

How the two are lined up (docs/k3_mla_notes.md has the vLLM side):

* Weights: our parameter names are transformers' (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; ``q_proj`` when
  ``q_lora_rank`` is None) with the same [out, in] layouts, so ``load_state_dict(strict=True)``
  copies them; the rotary tables are non-persistent buffers on both sides.
* Calling convention: ours takes queries from the block only and keys/values from [context ;
  block]. transformers projects q, k and v from one sequence, so it is given [context ; block]
  at positions [context positions ; block positions]; its block rows are compared, its context
  rows (queries we never make) are dropped. Its additive mask is our boolean block mask for the
  block rows (``DSparkDrafter.block_mask``, the training mask: context before the anchor, the
  whole own block, non-causal) and the diagonal for the context rows.
* RoPE: ``DeepseekV3Config(rope_interleave=True)`` is vLLM's ``is_neox_style=False`` (GPT-J
  pairs). transformers returns the rotated pairs de-interleaved ([evens | odds]) for q and k alike,
  so q.k is the same; our k_pe keeps vLLM's in-place interleaved layout (what its latent cache
  stores), checked against transformers' output permuted.
* Norms: transformers builds ``q_a_layernorm``/``kv_a_layernorm`` with eps 1e-6 whatever the
  config says, vLLM with ``rms_norm_eps``: the configs here use 1e-6.
* Scale: ``qk_head_dim ** -0.5``; with DeepSeek YaRN both multiply it by
  ``mscale(factor, mscale_all_dim) ** 2`` and scale cos/sin by ``mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)`` (transformers' ``attention_factor``).
* ``q_lora_rank=None`` (a full-rank ``q_proj``) is checked too, although vLLM's K3 DSpark config
  refuses it.

The negative checks show the comparison can fail: NeoX-style RoPE, a 10% wrong softmax scale, a
causal block and a missing kv_a_layernorm each move the output far beyond the tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark.families.k3_mla_layers import MLAAttention, MLAConfig, MLADecoderLayer
from dspark.model import DSparkDrafter

TOL = 1e-5
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 50000.0}
YARN_ROPE = {  # DeepSeek-style YaRN; a small original length so the ramp bites at these positions
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
S, Q = 14, 4  # context positions; queries per block (gamma, sample_from_anchor)
ANCHORS = torch.tensor([[3, 9], [6, 12]])  # [B, A]: block j sees context < anchor, its own block


def mla_config(rope=DEFAULT_ROPE, q_lora_rank=32) -> MLAConfig:
    return MLAConfig(
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,  # != qk_head_dim (16): a k/v mix-up cannot pass
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        rope_parameters=dict(rope),
    )


def hf_attention(cfg: MLAConfig, *, rope_interleave: bool = True):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    hf_cfg = DeepseekV3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
        rope_interleave=rope_interleave,
        attention_bias=False,
        n_routed_experts=0,
    )
    hf_cfg._attn_implementation = "eager"
    return DeepseekV3Attention(hf_cfg, layer_idx=0).eval(), DeepseekV3RotaryEmbedding(hf_cfg)


def ours(cfg: MLAConfig, seed: int = 0) -> MLAAttention:
    torch.manual_seed(seed)
    attn = MLAAttention(cfg).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)  # not ones: a skipped norm shows
            else:
                p.normal_(0, p.shape[1] ** -0.5 * 1.5)  # O(1) activations, peaked attention
    return attn


def block_mask() -> torch.Tensor:
    """[B, 1, A*Q, S + A*Q] bool, the drafter's training mask (its only input is queries_per_block)."""
    return DSparkDrafter.block_mask(SimpleNamespace(queries_per_block=Q), ANCHORS, S)


def inputs(cfg: MLAConfig, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    b, a = ANCHORS.shape
    ctx = torch.randn(b, S, cfg.hidden_size, generator=g)  # stands for context_norm(context_proj(states))
    x = torch.randn(b, a * Q, cfg.hidden_size, generator=g)  # normed block inputs
    ctx_pos = torch.arange(S).expand(b, S)
    pos = (ANCHORS[:, :, None] + torch.arange(Q)).reshape(b, a * Q)
    return x, pos, ctx, ctx_pos


def run_ours(attn: MLAAttention, cfg: MLAConfig, mask: torch.Tensor) -> torch.Tensor:
    x, pos, ctx, ctx_pos = inputs(cfg)
    with torch.no_grad():
        return attn(x, pos, ctx, ctx_pos, mask)


def run_hf(attn: MLAAttention, cfg: MLAConfig, mask: torch.Tensor, **hf_kwargs) -> torch.Tensor:
    """transformers over [context ; block], block rows only."""
    hf, rotary = hf_attention(cfg, **hf_kwargs)
    hf.load_state_dict(attn.state_dict(), strict=True)
    x, pos, ctx, ctx_pos = inputs(cfg)
    seq, seq_pos = torch.cat([ctx, x], dim=1), torch.cat([ctx_pos, pos], dim=1)
    b, n = seq.shape[:2]
    sees = torch.eye(n, dtype=torch.bool).expand(b, 1, n, n).clone()  # context rows: themselves only (dropped)
    sees[:, :, S:, :] = mask
    additive = torch.zeros(sees.shape).masked_fill(~sees, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out, _ = hf(seq, rotary(seq, seq_pos), additive)
    return out[:, S:]


@pytest.mark.parametrize(
    "rope,q_lora_rank", [(DEFAULT_ROPE, 32), (YARN_ROPE, 32), (DEFAULT_ROPE, None)], ids=["default", "yarn", "q_proj"]
)
def test_mla_attention_matches_transformers_deepseek_v3(rope, q_lora_rank):
    cfg = mla_config(rope, q_lora_rank)
    attn = ours(cfg)
    mask = block_mask()
    got, want = run_ours(attn, cfg, mask), run_hf(attn, cfg, mask)
    assert want.abs().max() > 0.3  # not a vanishing output that would pass any tolerance
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"max abs diff {diff:.3g} vs transformers' DeepseekV3Attention"


def test_parity_check_can_fail():
    """The comparison notices each way of getting the math wrong."""
    cfg = mla_config(YARN_ROPE)
    attn = ours(cfg)
    mask = block_mask()
    want = run_hf(attn, cfg, mask)

    def off(got: torch.Tensor) -> float:
        return (got - want).abs().max().item()

    assert off(run_hf(attn, cfg, mask, rope_interleave=False)) > 1e-2  # NeoX-style rope
    good_scale = attn.scale
    attn.scale = good_scale * 1.1
    assert off(run_ours(attn, cfg, mask)) > 1e-2  # wrong softmax scale
    attn.scale = good_scale
    causal = mask.clone()
    causal[:, :, :, S:] &= torch.ones(mask.shape[-2], mask.shape[-2], dtype=torch.bool).tril()
    assert off(run_ours(attn, cfg, causal)) > 1e-2  # causal inside the block
    no_yarn = ours(mla_config(DEFAULT_ROPE))
    no_yarn.load_state_dict(attn.state_dict())
    assert off(run_ours(no_yarn, mla_config(DEFAULT_ROPE), mask)) > 1e-2  # scaling ignored
    with torch.no_grad():
        attn.kv_a_layernorm.weight.fill_(1.0)  # the latent norm's weight dropped
    assert off(run_ours(attn, cfg, mask)) > 1e-2


def test_context_latent_is_vllms_cache_row():
    """k_pe keeps vLLM's in-place GPT-J layout (transformers' is [evens | odds]); c is normed."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    cfg = mla_config(YARN_ROPE)
    attn = ours(cfg)
    hf, rotary = hf_attention(cfg)
    hf.load_state_dict(attn.state_dict())
    _, _, ctx, ctx_pos = inputs(cfg)
    with torch.no_grad():
        c, k_pe = attn.latent(ctx, ctx_pos)
        raw_c, raw_pe = hf.kv_a_proj_with_mqa(ctx).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = rotary(ctx, ctx_pos)
        hf_pe, _ = apply_rotary_pos_emb_interleave(raw_pe[:, None], raw_pe[:, None], cos, sin)
    deinterleave = torch.cat([torch.arange(0, cfg.qk_rope_head_dim, 2), torch.arange(1, cfg.qk_rope_head_dim, 2)])
    assert (k_pe[..., deinterleave] - hf_pe[:, 0]).abs().max() < TOL
    assert (c - hf.kv_a_layernorm(raw_c)).abs().max() < TOL
    assert c.shape[-1] + k_pe.shape[-1] == cfg.latent_width


def test_cached_context_latents_equal_the_training_pass():
    """Two decoder layers: context_cache + forward_cached (serving: one block over the cached
    context latents) = forward with the block mask (training: every block at once), per anchor,
    with YaRN RoPE (the drafter-level check with the shared context projection and heads, default
    RoPE, is tests/eval/test_reference.py's k3_mla case)."""
    cfg = mla_config(YARN_ROPE)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(MLADecoderLayer(cfg) for _ in range(2)).eval()
    with torch.no_grad():
        for p in layers.parameters():
            p.normal_(0, p.shape[-1] ** -0.5) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    b, a = ANCHORS.shape
    x, pos, ctx, ctx_pos = inputs(cfg)
    with torch.no_grad():
        full = x
        for layer in layers:
            full = layer(full, pos, ctx, ctx_pos, block_mask())
        full = full.view(b, a, Q, -1)
        for i in range(b):
            for j in range(a):
                n = int(ANCHORS[i, j])
                blk = slice(j * Q, (j + 1) * Q)
                one = x[i : i + 1, blk]
                for layer in layers:
                    cache = layer.context_cache(ctx[i : i + 1, :n], ctx_pos[i : i + 1, :n])
                    one = layer.forward_cached(one, pos[i : i + 1, blk], cache)
                assert (one[0] - full[i, j]).abs().max() < TOL


def test_config_round_trip_and_vllm_defaults():
    cfg = mla_config(YARN_ROPE)
    assert MLAConfig.from_hf(cfg.hf_fields()) == cfg
    bare = {k: v for k, v in cfg.hf_fields().items() if k != "rope_parameters"}
    assert MLAConfig.from_hf(bare).rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert MLAConfig.from_hf({**bare, "rope_theta": 1e6}).rope_parameters["rope_theta"] == 1e6
    # vLLM: an attention_factor of exactly 1.0 selects deepseek_llama_scaling (no softmax mscale^2)
    llama = MLAAttention(mla_config({**YARN_ROPE, "attention_factor": 1.0}))
    assert llama.rotary_emb.kind == "deepseek_llama_scaling" and llama.scale == 16**-0.5
    assert MLAAttention(cfg).scale > 16**-0.5
