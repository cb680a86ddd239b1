"""The step's FLOPs (dspark/flops.py) against torch's own counter, FlopCounterMode, on a tiny
drafter running forward + loss + backward, and on a tiny target's forward (the colocated term).

The counter counts matmuls only (mm, addmm, bmm, attention kernels) as 2mkn, as the formula
does; norms, RoPE, softmaxes, the loss's elementwise terms and gathers are no FLOPs to either.
Attention runs on SDPA's math backend here: the default CPU kernel is not registered with the
counter (it would count no attention at all), and the math backend's bmms are what a dense
masked kernel computes, so the two counts agree exactly, not within a tolerance."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dspark.config import LossSettings
from dspark.flops import PARTS, TargetShape, peak_flops, step_flops, target_forward_flops
from dspark.loss import dspark_loss
from dspark.model import sample_anchors
from tests.toy import tiny_drafter, tiny_drafter_config, tiny_llama_target

VOCAB, HIDDEN, CTX_LAYERS = 64, 32, 2


def counted_step(cfg, *, recompute: bool, topk: bool, batch: int = 2, tokens: int = 24, anchors: int = 3):
    """(FLOPs FlopCounterMode counts in one forward + loss + backward, the formula's count)."""
    from dspark.data.draft_vocab import build_d2t

    d2t = build_d2t(torch.arange(VOCAB) % 5, cfg.draft_vocab_size) if cfg.draft_vocab_size else None
    model = tiny_drafter(cfg, vocab_size=VOCAB, num_context_layers=CTX_LAYERS, d2t=d2t)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    mask = torch.zeros(batch, tokens, dtype=torch.bool)
    mask[:, 6:] = True
    lengths = torch.tensor([tokens, tokens - 3])  # a shorter row: some labels fall outside it
    anchor_pos, valid = sample_anchors(mask, lengths, anchors, g)
    ctx = torch.randn(batch, tokens - 1, CTX_LAYERS * HIDDEN, generator=g)
    final = torch.randn(batch, tokens - 1, HIDDEN, generator=g)
    weights = dict(ce_weight=0.1, tv_weight=0.9, confidence_weight=1.0, position_decay=4.0)
    lcfg = LossSettings(**weights, recompute_vocab_chunks=recompute)
    cached = {}
    if topk:
        with torch.no_grad():  # what the dataset's cache holds, computed outside the step
            top = torch.softmax(model.target_logits(final), -1).topk(5, -1)
        cached = dict(topk_ids=top.indices, topk_probs=top.values)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(ids, ctx, anchor_pos)
        res = dspark_loss(
            model,
            out,
            input_ids=ids,
            final_states=final,
            anchor_positions=anchor_pos,
            valid_anchors=valid,
            loss_mask=mask,
            lengths=lengths,
            cfg=lcfg,
            chunk_rows=8,  # several chunks
            **cached,
        )
        res.loss.backward()
    assert 0 < res.num_positions < batch * anchors * cfg.block_size  # the heads run on valid predictions only
    formula = step_flops(
        cfg,
        model.dims,
        sequences=batch,
        tokens=tokens,
        anchors=anchors,
        predictions=res.num_positions,
        target_topk=topk,
        recompute_vocab_chunks=recompute,
    )
    return counter.get_total_flops(), formula


@pytest.mark.parametrize(
    "fields, recompute, topk",
    [
        ({}, True, False),  # the GPU preset's loss: full target distribution, chunks recomputed
        ({}, False, True),  # the CPU demo's: cached top k, chunks kept
        ({}, True, True),
        ({"markov_head_type": "gated", "sample_from_anchor": False}, True, False),  # DFlash layout: 1+gamma queries
        ({"markov_head_type": "rnn", "enable_confidence_head": False}, False, False),
        ({"markov_rank": 0, "confidence_head_with_markov": False}, True, False),
        ({"draft_vocab_size": 24}, True, False),  # a reduced draft vocabulary: draft head and Markov output 24 wide
        ({"draft_vocab_size": 24}, False, True),
        (  # Kimi K3's family: MLA layers (latent, its expansion, Dn+Dr-wide scores, Dv-wide values)
            dict(
                family="k3_mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
            ),
            True,
            False,
        ),
    ],
)
def test_step_flops_equal_what_torchs_counter_counts(fields, recompute, topk):
    cfg = tiny_drafter_config(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, **fields)
    counted, formula = counted_step(cfg, recompute=recompute, topk=topk)
    assert formula.executed == counted, {k: v for k, v in formula.parts.items() if any(v)}
    assert (formula.recompute > 0) == recompute and formula.executed >= formula.model
    assert (formula.parts["target LM head (no grad)"][0] == 0) == topk
    assert formula.per_prediction == formula.model / formula.predictions


def test_the_parts_follow_the_training_convention():
    """A trainable matmul costs 3x its forward, fc and the frozen draft LM head 2x (no gradient of
    the target's states, none of the head's weight), the target's head 1x."""
    cfg = tiny_drafter_config(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_drafter(cfg, vocab_size=VOCAB, num_context_layers=CTX_LAYERS)
    f = step_flops(cfg, model.dims, sequences=2, tokens=24, anchors=3).parts
    assert set(f) == set(PARTS)
    for part in ("context K/V (every layer)", "draft layers: projections + MLP", "draft layers: attention"):
        assert f[part][1] == 2 * f[part][0] > 0
    assert f["context projection (fc)"][1] == f["context projection (fc)"][0] > 0
    assert f["draft LM head"][1] == f["draft LM head"][0] == 2 * 2 * 3 * 4 * HIDDEN * VOCAB  # every prediction
    assert f["target LM head (no grad)"] == (f["draft LM head"][0], 0)
    assert f["colocated target (no grad)"] == (0, 0)


def test_the_colocated_term_counts_the_targets_forward():
    """The target's decoder forward, against the counter; the formula counts causal attention's
    lower triangle, the math backend computes the full square."""
    target = tiny_llama_target()
    shape = TargetShape.of(target.config.to_dict())
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (3, 4, 2, 8)
    b, t = 2, 17
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad(), FlopCounterMode(display=False) as counter:
        target.get_decoder()(input_ids=torch.randint(0, 64, (b, t)), use_cache=False)
    upper = shape.num_layers * 2 * 2 * b * shape.num_heads * shape.head_dim * (t * t - t * (t + 1) // 2)
    assert target_forward_flops(shape, sequences=b, tokens=t) + upper == counter.get_total_flops()
    cfg = tiny_drafter_config(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    dims = tiny_drafter(cfg, vocab_size=VOCAB).dims
    with_target = step_flops(cfg, dims, sequences=b, tokens=t + 1, anchors=3, colocated_target=shape)
    alone = step_flops(cfg, dims, sequences=b, tokens=t + 1, anchors=3)
    assert with_target.model - alone.model == target_forward_flops(shape, sequences=b, tokens=t)


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H200", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H100 PCIe", "float16", 756e12),
        ("NVIDIA H200 NVL", "bfloat16", 836e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA H200", "float32", None),  # fp32's peak depends on TF32: no MFU rather than a wrong one
        ("cpu", "bfloat16", None),
        ("NVIDIA GeForce RTX 4090", "bfloat16", None),
    ],
)
def test_peak_flops_come_from_the_table_or_not_at_all(name, dtype, peak):
    assert peak_flops(name, dtype) == peak
