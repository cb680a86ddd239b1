"""The loss against a hand computation on a 2-position, 5-token case."""

import math

import pytest
import torch

from dspark.config import LossSettings
from dspark.loss import dspark_loss
from dspark.model import DraftOutput, DSparkDrafter
from tests.toy import tiny_drafter, tiny_drafter_config


def one_head_drafter(V: int, H: int, fields: dict, **kw) -> DSparkDrafter:
    """A one-layer drafter of width ``H`` (one attention head, MLP 2H, no Markov head) with
    ``fields``, on a made-up target of ``V`` tokens (tests/toy.py ``tiny_drafter``: seed 0, ``kw``)."""
    cfg = tiny_drafter_config(
        hidden_size=H, intermediate_size=2 * H, num_attention_heads=1, num_key_value_heads=1, markov_rank=0, **fields
    )
    return tiny_drafter(cfg, vocab_size=V, **kw)


@pytest.mark.parametrize("lk_weight,kl_weight", [(0.0, 0.0), (0.5, 0.0), (0.0, 1.0)])
def test_loss_matches_hand_computation(lk_weight, kl_weight):
    V, H = 5, 2
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    fields = dict(block_size=2, confidence_head_with_markov=False)
    m = one_head_drafter(V, H, fields, embed_tokens=torch.zeros(V, H), lm_head=lm_head, target_norm_eps=0.0)
    # one sequence x = [4, 2, 1, 3], anchor a=1: predictions for x_2=1 (k=1) and x_3=3 (k=2)
    ids = torch.tensor([[4, 2, 1, 3]])
    hidden = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])  # [B=1, A=1, K=2, H]
    conf = torch.tensor([[[0.5, -1.0]]])
    final_states = torch.tensor([[[9.0, 9.0], [0.0, 2.0], [-1.0, 1.0]]])  # s_0..s_2; targets use s_1, s_2
    out = DraftOutput(hidden=hidden, markov_embed=None, confidence_logits=conf)
    lcfg = LossSettings(
        ce_weight=0.1,
        tv_weight=0.9,
        confidence_weight=1.0,
        position_decay=4.0,
        lk_weight=lk_weight,
        kl_weight=kl_weight,
    )
    res = dspark_loss(
        m,
        out,
        input_ids=ids,
        final_states=final_states,
        anchor_positions=torch.tensor([[1]]),
        valid_anchors=torch.tensor([[True]]),
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
        lengths=torch.tensor([4]),
        cfg=lcfg,
    )

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    def rms(v):  # target final norm with eps 0, weight 1
        r = math.sqrt(sum(x * x for x in v) / len(v))
        return [x / r for x in v]

    rows = [
        (hidden[0, 0, 0].tolist(), final_states[0, 1].tolist(), 1, 0.5),
        (hidden[0, 0, 1].tolist(), final_states[0, 2].tolist(), 3, -1.0),
    ]
    w = [1.0, math.exp(-1 / 4)]
    ce = tv = bce = lk = kl = 0.0
    matches = []
    for (h, s, label, c), wk in zip(rows, w):
        pd = softmax([sum(a * b for a, b in zip(r, h)) for r in lm_head.tolist()])
        pt = softmax([sum(a * b for a, b in zip(r, rms(s))) for r in lm_head.tolist()])
        tv_k = 0.5 * sum(abs(a - b) for a, b in zip(pd, pt))
        y = 1 - tv_k
        sig = 1 / (1 + math.exp(-c))
        ce += wk * -math.log(pd[label])
        tv += wk * tv_k
        lk += wk * -math.log(sum(min(a, b) for a, b in zip(pd, pt)))  # the overlap, not 1 - TV
        kl += wk * sum(b * math.log(b / a) for a, b in zip(pd, pt))  # KL(target || draft)
        bce += wk * -(y * math.log(sig) + (1 - y) * math.log(1 - sig))
        matches.append(float(max(range(V), key=lambda i: pd[i]) == max(range(V), key=lambda i: pt[i])))
    ce, tv, bce, lk, kl = ce / sum(w), tv / sum(w), bce / sum(w), lk / sum(w), kl / sum(w)
    assert math.isclose(res.ce.item(), ce, rel_tol=1e-5)
    assert math.isclose(res.tv.item(), tv, rel_tol=1e-5)
    assert math.isclose(res.confidence_bce.item(), bce, rel_tol=1e-5)
    assert math.isclose(res.lk.item(), lk, rel_tol=1e-5) and lk > tv  # -log(1 - x) > x
    assert math.isclose(res.kl.item(), kl, rel_tol=1e-5) and kl > 0
    want = 0.1 * ce + 0.9 * tv + lk_weight * lk + kl_weight * kl + 1.0 * bce
    assert math.isclose(res.loss.item(), want, rel_tol=1e-5)
    assert res.accept_cond_per_position.tolist() == matches
    assert res.accept_per_position.tolist() == [matches[0], matches[0] * matches[1]]
    assert res.num_positions == 2


def test_positions_outside_the_answer_do_not_count():
    V, H = 7, 4
    m = one_head_drafter(V, H, dict(block_size=3, enable_confidence_head=False))  # random embedding and LM head
    ids = torch.randint(0, V, (1, 8))
    out = DraftOutput(hidden=torch.randn(1, 1, 3, H), markov_embed=None, confidence_logits=None)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)  # labels x_3, x_4 in the answer, x_5 not
    res = dspark_loss(
        m,
        out,
        input_ids=ids,
        final_states=torch.randn(1, 7, H),
        anchor_positions=torch.tensor([[2]]),
        valid_anchors=torch.tensor([[True]]),
        loss_mask=mask,
        lengths=torch.tensor([8]),
        cfg=LossSettings(ce_weight=0.1, tv_weight=0.9, confidence_weight=1.0, position_decay=4.0),
    )
    assert res.num_positions == 2
