"""The drafter: visibility inside and across blocks, anchor batching, DFlash equivalence."""

import pytest
import torch

from dspark.model import DSparkDrafter, sample_anchors
from tests.toy import tiny_drafter, tiny_drafter_config

V, HT, NCTX = 97, 32, 2


def make_model(**overrides) -> DSparkDrafter:
    torch.manual_seed(0)
    cfg = tiny_drafter_config(
        **{"num_layers": 2, "hidden_size": HT, "num_attention_heads": 4, "num_key_value_heads": 2, "markov_rank": 8}
        | overrides
    )  # gamma 4, MLP 64
    embed, head = torch.randn(V, HT), torch.randn(V, HT) / 4
    m = tiny_drafter(
        cfg, vocab_size=V, num_context_layers=NCTX, mask_token_id=3, embed_tokens=embed, lm_head=head, seed=None
    )
    for p in m.parameters():  # make heads non-trivial (zero-initialised at construction)
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return m.eval()


def inputs(b=2, t=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, t), generator=g), torch.randn(b, t - 1, NCTX * HT, generator=g)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_block_sees_nothing_at_or_after_its_anchor(sample_from_anchor):
    m = make_model(sample_from_anchor=sample_from_anchor)
    ids, ctx = inputs()
    anchors = torch.tensor([[5, 12], [9, 15]])
    ref = m(ids, ctx, anchors)
    ids2, ctx2 = ids.clone(), ctx.clone()
    ids2[0, 6:] = (ids2[0, 6:] + 1) % V  # every token after anchor 5 ...
    ctx2[0, 5:] += 10.0  # ... and every context state at or after it
    ids2[1, 10:] = (ids2[1, 10:] + 1) % V
    ctx2[1, 9:] -= 3.0
    got = m(ids2, ctx2, anchors)
    assert torch.equal(got.hidden[:, 0], ref.hidden[:, 0])  # bit-identical backbone output
    assert not torch.allclose(got.hidden[:, 1], ref.hidden[:, 1])  # the later anchor does see them
    # the Markov head is teacher-forced on the true previous tokens (x_a, x_{a+1}, ...), by design
    assert torch.equal(got.markov_embed[:, 0, 0], ref.markov_embed[:, 0, 0])


def test_tokens_of_a_block_see_each_other_and_no_other_block():
    m = make_model()
    mask = m.block_mask(torch.tensor([[4, 9]]), num_context=12)[0, 0]  # [A*Q, S + A*Q]
    q = m.queries_per_block
    assert mask.shape == (2 * q, 12 + 2 * q)
    assert mask[:q, :4].all() and not mask[:q, 4:12].any()  # context strictly before anchor 4
    assert mask[q:, :9].all() and not mask[q:, 9:12].any()
    assert mask[:q, 12 : 12 + q].all() and not mask[:q, 12 + q :].any()  # own block only, both directions
    assert mask[q:, 12 + q :].all() and not mask[q:, 12 : 12 + q].any()


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_a_window_shows_each_query_exactly_w_positions_counting_its_own(sample_from_anchor):
    """drafter.attention_window=W: the block query at position p sees context p0 < anchor with
    p - p0 < W (vLLM's and llama.cpp's edge), and its whole block."""
    m = make_model(sample_from_anchor=sample_from_anchor, attention_window=7)
    q, w, s = m.queries_per_block, 7, 30
    anchors = torch.tensor([[4, 20]])
    mask = m.block_mask(anchors, num_context=s, window=w)[0, 0]
    for j, a in enumerate(anchors[0].tolist()):
        for i in range(q):
            row = mask[j * q + i]
            want = [max(0, a + i - w + 1) <= p0 < a for p0 in range(s)]
            assert row[:s].tolist() == want, (a, i)
            assert row[s + j * q : s + (j + 1) * q].all()  # its own block, both directions
    # query 0 of the anchor at 20 sees 14..19 (6 context positions + its own = W); the last sees 20-W+q..19
    assert mask[q, :s].nonzero().flatten().tolist() == list(range(14, 20))
    assert mask[2 * q - 1, :s].nonzero().flatten().tolist() == list(range(20 - w + q, 20))
    assert torch.equal(m.block_mask(anchors, s, None), m.block_mask(anchors, s, 10**6))  # a wide window is full


def test_a_windowed_block_reads_nothing_past_its_edge():
    """Through the whole forward: a context state just outside the first query's window changes
    nothing (bit-identical), one just inside it changes the block."""
    w = 8
    m = make_model(attention_window=w)
    ids, ctx = inputs(b=1, t=30)
    a = 20
    anchors = torch.tensor([[a]])
    ref = m(ids, ctx, anchors).hidden
    outside, inside = ctx.clone(), ctx.clone()
    outside[0, : a - w + 1] += 5.0  # positions <= a - W: no query sees them
    inside[0, a - w + 1] += 5.0  # the first query's farthest key
    assert torch.equal(m(ids, outside, anchors).hidden, ref)
    assert not torch.allclose(m(ids, inside, anchors).hidden, ref)
    full = make_model()  # the same weights without a window do read the far context
    assert not torch.allclose(full(ids, outside, anchors).hidden, full(ids, ctx, anchors).hidden)


def test_anchor_batched_forward_equals_one_forward_per_anchor():
    m = make_model()
    ids, ctx = inputs(b=1, t=30)
    anchors = torch.tensor([[3, 11, 20, 26]])
    batched = m(ids, ctx, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        # one anchor, and a context cut just before it: no mask is needed at all
        single = m(ids[:, : a + m.cfg.block_size + 1], ctx[:, :a], torch.tensor([[a]]))
        torch.testing.assert_close(batched.hidden[:, j], single.hidden[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            batched.confidence_logits[:, j], single.confidence_logits[:, 0], rtol=1e-5, atol=1e-5
        )


def dflash_reference(m: DSparkDrafter, ids, ctx, a: int) -> torch.Tensor:
    """A DFlash forward written out: block [x_a, mask x gamma] at a..a+gamma, context < a,
    logits at the gamma mask slots through the target LM head, no Markov term."""
    g = m.cfg.block_size
    block = torch.tensor([[int(ids[0, a])] + [m.dims.mask_token_id] * g])
    x = m.embed_tokens(block)
    c = m.hidden_norm(m.fc(ctx[:, :a]))
    pos = torch.arange(a, a + g + 1)[None]
    cpos = torch.arange(a)[None]
    full = torch.ones(1, 1, g + 1, a + g + 1, dtype=torch.bool)
    for layer in m.layers:
        x = layer(x, pos, c, cpos, full)
    return m.lm_head(m.norm(x))[:, 1:]


def test_rank_zero_is_a_dflash_forward():
    m = make_model(markov_rank=0, sample_from_anchor=False, confidence_head_with_markov=False)
    assert m.markov_head is None and not any("markov" in n for n, _ in m.named_parameters())
    ids, ctx = inputs(b=1, t=30)
    anchors = torch.tensor([[4, 13, 21]])
    out = m(ids, ctx, anchors)
    assert out.markov_embed is None
    logits = m.draft_logits(out.hidden, out.markov_embed)
    for j, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(logits[0, j], dflash_reference(m, ids, ctx, a)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_head_variants_bias_the_logits(kind):
    m = make_model(markov_head_type=kind)
    ids, ctx = inputs(b=1)
    out = m(ids, ctx, torch.tensor([[6]]))
    assert out.markov_embed.shape == (1, 1, 4, 8)
    plain = m.lm_head(out.hidden).float()
    assert not torch.allclose(m.draft_logits(out.hidden, out.markov_embed), plain)


def test_only_backbone_and_heads_train():
    m = make_model()
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight", "target_norm.weight"}
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    } <= {n for n, p in m.named_parameters() if p.requires_grad}


def test_anchors_start_on_answer_tokens_with_an_answer_label():
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 9:11] = True
    anchors, valid = sample_anchors(mask, torch.tensor([12, 11]), 4, torch.Generator().manual_seed(0))
    for i in range(2):
        for a, v in zip(anchors[i].tolist(), valid[i].tolist()):
            if v:
                assert mask[i, a] and mask[i, a + 1] and a + 1 < [12, 11][i]
    assert valid[0].all() and valid[1].sum() == 1 and anchors[1, 0] == 9  # only a=9 qualifies (a+1=10 < 11)


@pytest.mark.parametrize("confidence_head_dtype", [torch.bfloat16, torch.float32])
def test_bf16_model_runs_with_its_confidence_head_in_either_dtype(confidence_head_dtype):
    """DeepSpeed's bf16 engine casts the whole drafter; vLLM keeps the confidence head fp32."""
    m = make_model()
    ids = torch.randint(0, V, (1, 12))
    ctx = torch.randn(1, 11, NCTX * HT)
    ref = m(ids, ctx, torch.tensor([[2, 5]]))
    m = m.to(torch.bfloat16)
    m.confidence_head.to(confidence_head_dtype)
    out = m(ids, ctx.bfloat16(), torch.tensor([[2, 5]]))
    assert out.hidden.dtype == torch.bfloat16 and out.confidence_logits.dtype == torch.float32
    # measured: 8.4e-4 off the fp32 logits (|logit| <= 0.18); 4e-3 is bf16's rounding step at 1.0, so a
    # head run in the wrong dtype or on other inputs fails while bf16's own rounding passes (issue #49)
    torch.testing.assert_close(out.confidence_logits, ref.confidence_logits, rtol=0, atol=4e-3)


def test_the_blocks_head_logits_are_the_lm_heads_and_the_markov_bias_adds_to_them():
    """The reference loop's block product (W @ h^T, issue #60) is the LM head up to rounding, and the
    head plus the Markov bias is draft_logits (the reduced head: tests/dspark/test_draft_vocab.py)."""
    m = make_model()
    ids, ctx = inputs(b=1)
    out = m(ids, ctx, torch.tensor([[6]]))
    h, e = out.hidden[0, 0], out.markov_embed[0, 0]  # [K, H], [K, R]
    assert m.head_logits(h).shape == (h.shape[0], V)
    torch.testing.assert_close(m.head_logits(h), m.lm_head(h).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.head_logits(h) + m.markov_logits(e), m.draft_logits(h, e), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m.head_logits(h), m.draft_logits(h, e))  # the bias is not zero here
