"""The learning-efficiency levers in isolation: the top-k target distribution and its TV, copy-aware
anchors and the CE schedule (their trainer wiring is in test_trainer.py)."""

import pytest
import torch

from dspark.config import LossSettings, TrainConfig
from dspark.data.batching import collate
from dspark.data.shards import ShardSequence
from dspark.data.target_topk import SequenceTopK, cached_positions
from dspark.loss import dspark_loss, topk_kl, topk_tv
from dspark.model import copy_continuations, sample_anchors
from tests.toy import tiny_drafter, tiny_drafter_config


def _tv(p, q):
    return 0.5 * (p - q).abs().sum(-1)


def test_topk_tv_is_a_lower_bound_exact_on_the_whole_support_and_for_a_target_inside_it():
    g = torch.Generator().manual_seed(0)
    p_d = torch.softmax(torch.randn(6, 50, generator=g), -1)
    p_t = torch.softmax(3 * torch.randn(6, 50, generator=g), -1)
    exact = _tv(p_d, p_t)
    for k in (1, 5, 20):
        top = p_t.topk(k, -1)
        approx = topk_tv(p_d, top.indices, top.values)
        assert (approx <= exact + 1e-6).all()
    full = p_t.topk(50, -1)
    torch.testing.assert_close(topk_tv(p_d, full.indices, full.values), exact)
    # a target whose mass lies in 5 tokens: its top 5 give the exact TV
    sparse = torch.zeros_like(p_t)
    sparse[:, :5] = torch.softmax(torch.randn(6, 5, generator=g), -1)
    top = sparse.topk(5, -1)
    torch.testing.assert_close(topk_tv(p_d, top.indices, top.values), _tv(p_d, sparse))
    # and k grows toward the exact TV
    errs = [float((exact - topk_tv(p_d, *p_t.topk(k, -1)[::-1])).mean()) for k in (2, 10, 40)]
    assert errs[0] > errs[1] > errs[2] > -1e-6


def _kl(p_t, p_d):
    return torch.nn.functional.kl_div(p_d.log(), p_t, reduction="none").sum(-1)  # torch's own KL(p_t || p_d)


def test_topk_kl_is_a_lower_bound_exact_on_the_whole_support_and_for_a_target_inside_it():
    g = torch.Generator().manual_seed(0)
    p_d = torch.softmax(torch.randn(6, 50, generator=g), -1)
    p_t = torch.softmax(3 * torch.randn(6, 50, generator=g), -1)
    exact = _kl(p_t, p_d)
    errs = []
    for k in (1, 5, 20, 40):
        top = p_t.topk(k, -1)
        approx = topk_kl(p_d.log(), top.indices, top.values)
        assert (approx >= -1e-6).all() and (approx <= exact + 1e-6).all()
        errs.append(float((exact - approx).mean()))
    assert errs[0] > errs[1] > errs[2] > errs[3] > -1e-6  # k grows toward the exact KL
    full = p_t.topk(50, -1)
    torch.testing.assert_close(topk_kl(p_d.log(), full.indices, full.values), exact)
    # a target whose mass lies in 5 tokens: its top 5 give the exact KL
    sparse = torch.zeros_like(p_t)
    sparse[:, :5] = torch.softmax(torch.randn(6, 5, generator=g), -1)
    top = sparse.topk(5, -1)
    torch.testing.assert_close(topk_kl(p_d.log(), top.indices, top.values), _kl(sparse, p_d))
    # a draft equal to the target: 0, and its gradient pushes p_d toward p_t
    torch.testing.assert_close(topk_kl(p_t.log(), *p_t.topk(5, -1)[::-1]), torch.zeros(6), atol=1e-6, rtol=0)
    # a draft with almost no tail (5e-5) where the target keeps 0.2 there: a large loss whose
    # gradient pulls mass back (the tail bin's log is taken of the tail + TAIL_FLOOR)
    logits = torch.full((1, 50), -12.0)
    logits[0, :5] = 0.0
    logits.requires_grad_(True)
    kl = topk_kl(torch.log_softmax(logits, -1), torch.arange(5)[None], torch.full((1, 5), 0.16))
    kl.sum().backward()
    assert float(kl) > 1.0 and float(logits.grad[0, 5:].sum()) < -0.1  # descent raises the tail's logits


def _tiny_drafter(V=40, H=8):
    cfg = tiny_drafter_config(
        hidden_size=H, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, block_size=3
    )  # one layer, Markov rank 4
    return tiny_drafter(cfg, vocab_size=V)  # seed 0, random embedding and LM head


def test_loss_on_the_cached_full_support_equals_the_loss_on_final_states():
    m = _tiny_drafter()
    b, t, V = 2, 12, 40
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (b, t), generator=g)
    ctx = torch.randn(b, t - 1, 8, generator=g)
    final = torch.randn(b, t - 1, 8, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, :3] = False
    lengths = torch.tensor([t, t - 2])
    anchors, valid = sample_anchors(mask, lengths, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        p_t = torch.softmax(m.target_logits(final), -1)
    top = p_t.topk(V, -1)
    kw = dict(
        input_ids=ids,
        final_states=final,
        anchor_positions=anchors,
        valid_anchors=valid,
        loss_mask=mask,
        lengths=lengths,
        cfg=LossSettings(ce_weight=0.3, tv_weight=0.5, kl_weight=0.2, confidence_weight=1.0, position_decay=4.0),
    )
    results, grads = [], []
    for extra in ({}, {"topk_ids": top.indices, "topk_probs": top.values}):
        m.zero_grad()
        res = dspark_loss(m, m(ids, ctx, anchors), **kw, **extra)
        res.loss.backward()
        results.append(res)
        grads.append(m.fc.weight.grad.clone())
    full, cached = results
    torch.testing.assert_close(cached.loss, full.loss)
    torch.testing.assert_close(cached.tv, full.tv)
    torch.testing.assert_close(cached.kl, full.kl)
    assert full.kl > 0.1  # a random drafter is far from the target
    torch.testing.assert_close(full.loss, 0.3 * full.ce + 0.5 * full.tv + 0.2 * full.kl + full.confidence_bce)
    torch.testing.assert_close(cached.accept_per_position, full.accept_per_position)
    torch.testing.assert_close(grads[1], grads[0])


def test_collate_crops_the_cached_distribution_like_the_states():
    n, k = 10, 3
    ids = torch.arange(n)
    mask = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    pos = cached_positions(mask, "answer")
    assert pos.tolist() == [4, 5, 6, 7, 8]  # the states predicting tokens 5..9
    assert cached_positions(mask, "all").tolist() == list(range(9))
    tk = SequenceTopK(pos, pos[:, None].repeat(1, k) + 100, torch.full((len(pos), k), 0.25))
    seq = ShardSequence("s", ids, mask, torch.zeros(n - 1, 2, 4), target_topk=tk)
    batch = collate([seq], context_index=[0], final_index=1, max_len=6)  # keeps tokens 4..9
    assert batch.input_ids[0].tolist() == [4, 5, 6, 7, 8, 9]
    # state row r of the window is the full sequence's row r + 4
    assert batch.topk_ids[0, :, 0].tolist() == [104, 105, 106, 107, 108]
    assert batch.topk_probs[0].sum().item() == pytest.approx(5 * k * 0.25)


def test_copy_continuations_marks_bigrams_seen_before():
    ids = torch.tensor([5, 6, 7, 5, 6, 8, 6, 7])
    # bigrams: (5,6)@0 (6,7)@1 (7,5)@2 (5,6)@3 (6,8)@4 (8,6)@5 (6,7)@6
    assert copy_continuations(ids).tolist() == [False, False, False, True, False, False, True, False]


def test_copy_boost_oversamples_copy_anchors_and_zero_keeps_uniform_sampling():
    t = 200
    ids = torch.randint(1000, 2000, (t,), generator=torch.Generator().manual_seed(0))
    ids[120:160] = ids[20:60]  # the answer copies a stretch of its context
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[0, 100:] = True
    copy = copy_continuations(ids)
    cand = torch.arange(100, t - 1)
    base_rate = float(copy[cand].float().mean())  # about 0.4
    fracs = {}
    for boost in (0.0, 9.0):
        g = torch.Generator().manual_seed(0)
        hits = total = 0
        for _ in range(40):
            a, v = sample_anchors(mask, torch.tensor([t]), 16, g, input_ids=ids[None], copy_boost=boost)
            hits += int(copy[a[0][v[0]]].sum())
            total += int(v.sum())
        fracs[boost] = hits / total
    assert abs(fracs[0.0] - base_rate) < 0.1
    assert fracs[9.0] > base_rate + 0.3
    # boost 0 draws exactly what the uniform sampler draws
    a0, _ = sample_anchors(mask, torch.tensor([t]), 16, torch.Generator().manual_seed(3))
    a1, _ = sample_anchors(mask, torch.tensor([t]), 16, torch.Generator().manual_seed(3), input_ids=ids[None])
    assert torch.equal(a0, a1)


def test_ce_weight_schedule():
    s = LossSettings(ce_weight=0.1, ce_weight_start=1.0, ce_anneal_frac=0.5)
    assert [round(s.weights_at(k, 100).ce_weight, 4) for k in (0, 25, 50, 99)] == [1.0, 0.55, 0.1, 0.1]
    # the rule the trainer had (dspark.trainer.ce_weight_at), to the bit
    assert all(s.weights_at(k, 100).ce_weight == 1.0 + (0.1 - 1.0) * min(1.0, k / 50) for k in range(100))
    step = s.weights_at(25, 100)
    assert step.ce_weight_start is None and step.weights_at(99, 100) == step  # the schedule applied, once
    assert (step.kl_weight, step.tv_weight, step.position_decay) == (s.kl_weight, s.tv_weight, s.position_decay)
    t = TrainConfig(ce_weight=0.2)  # train.* is a LossSettings: no schedule, the same settings every step
    assert t.weights_at(7, t.max_steps) is t
