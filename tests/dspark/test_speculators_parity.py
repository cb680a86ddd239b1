"""Parity with speculators on the same weights (issue #38, item 2): one set of weights loaded into
speculators 0.9.0's DSparkDraftModel (through our conversion) and into our drafter, the same context
states, tokens and anchors, fp32 on CPU: the draft logits (LM head over the backbone), the Markov
bias and the confidence logit agree within 1e-5. speculators is installed by scripts/setup.sh."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dspark.export import export
from dspark.export.speculators_format import read_speculators, write_speculators
from dspark.export.vllm_format import load_drafter
from tests.conftest import need_speculators
from tests.dspark.test_export_bytes import TARGET_CONFIG, checkpoint
from tests.dspark.test_speculators_format import tiny_verifier

speculators = need_speculators()

FIELDS = dict(num_layers=2, block_size=4, markov_rank=4)
T, ANCHORS = 24, [3, 9, 14]


@pytest.fixture
def pair(tmp_path):
    """(theirs, ours, verifier): the same trained-looking weights in speculators' model and ours."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    ckpt = checkpoint(tmp_path, FIELDS)
    torch.manual_seed(1)  # fixed_weights leaves markov_w2 and the confidence head at their (zero) init: fill them
    for k, w in ckpt.weights.items():
        if k.startswith(("markov_head.markov_w2", "confidence_head")):
            ckpt.weights[k] = torch.randn_like(w) * 0.1
    export(ckpt, tmp_path / "ours", target_dir=target)
    verifier = tiny_verifier(target)
    out = write_speculators(tmp_path / "ours", tmp_path / "theirs")
    config = DSparkSpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    theirs = DSparkDraftModel(config)
    exp = read_speculators(out)
    missing, unexpected = theirs.load_state_dict(exp.weights, strict=False)
    assert not unexpected and sorted(missing) == sorted(
        ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"]
    )
    theirs.load_verifier_weights()
    heads = SimpleNamespace(  # the verifier's shared tensors, as dspark.core.target hands a target's over
        embed_tokens=verifier.model.embed_tokens.weight.detach(),
        lm_head=verifier.lm_head.weight.detach(),
        final_norm=verifier.model.norm.weight.detach(),
        rms_norm_eps=verifier.config.rms_norm_eps,
    )
    return theirs.eval(), load_drafter(exp, heads), verifier


def test_logits_markov_bias_and_confidence_agree_on_the_same_weights(pair):
    theirs, ours, _ = pair
    block = ours.cfg.block_size
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(1, T, 3 * 32, generator=gen)
    ids = torch.randint(0, 96, (1, T), generator=gen)
    loss_mask = torch.zeros(1, T)
    loss_mask[0, ANCHORS] = 1  # speculators draws its anchors from the supervised positions: exactly these
    with torch.no_grad():
        hidden, logits, _, _, idx = theirs._backbone_forward(
            states,
            ids,
            loss_mask,
            torch.randn(1, T, 32, generator=gen),
            torch.zeros(1, T, dtype=torch.long),
            max_anchors=len(ANCHORS),
        )
        assert idx.view(len(ANCHORS), block)[:, 0].tolist() == ANCHORS
        prev = ids[0, idx].view(len(ANCHORS), block)  # the teacher-forced previous token of each slot
        prev_emb = theirs.markov_head.prev_embeddings(prev)
        their_bias = theirs.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden.view(len(ANCHORS), block, -1), prev_emb=prev_emb
        )
        their_conf = theirs.confidence_head(torch.cat([hidden.view(len(ANCHORS), block, -1), prev_emb], -1))

        out = ours(ids, states[:, : T - 1], torch.tensor([ANCHORS]))  # ours reads the states before the last token
        our_logits = ours.lm_head(out.hidden)[0]
        our_bias = ours.markov_head.markov_w2(out.markov_embed)[0]

    assert logits.abs().max() > 1 and their_bias.abs().max() > 0.01 and their_conf.abs().max() > 0.01  # not at zero
    torch.testing.assert_close(our_logits, logits.view(len(ANCHORS), block, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(our_bias, their_bias, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.confidence_logits[0], their_conf.view(len(ANCHORS), block), rtol=0, atol=1e-5)


def test_tv_kl_ce_and_confidence_bce_agree_at_matched_weights(pair):
    """Where the definitions coincide: TV, KL (speculators' default ``kl_div``, our ``kl``) and the
    confidence BCE (against the detached 1 - TV) per prediction, and CE when the data are the
    target's greedy text (speculators' CE is against the target's argmax, ours against the
    dataset's token); every prediction supervised and weighted alike, so speculators' masked mean
    and our weighted mean are the same reduction
    (their defaults differ: docs/speculators_notes.md, "Losses")."""
    from speculators.losses import compound_loss, resolve_loss_config
    from torch.nn.functional import binary_cross_entropy_with_logits

    from dspark.core.config import LossSettings
    from dspark.loss import dspark_loss

    theirs, ours, verifier = pair
    block, a = ours.cfg.block_size, len(ANCHORS)
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(1, T, 3 * 32, generator=gen)
    last = torch.randn(1, T, 32, generator=gen)
    with torch.no_grad():
        target_logits = verifier.lm_head(verifier.model.norm(last))
    ids = torch.randint(0, 96, (1, T), generator=gen)
    ids[0, 1:] = target_logits[0, :-1].argmax(-1)  # greedy data: x_{t+1} is the target's argmax at t
    loss_mask = torch.zeros(1, T)
    loss_mask[0, ANCHORS] = 1
    with torch.no_grad():
        hidden, logits, targets, _, idx = theirs._backbone_forward(
            states, ids, loss_mask, last, torch.zeros(1, T, dtype=torch.long), max_anchors=a
        )
        prev = ids[0, idx].view(a, block)
        prev_emb = theirs.markov_head.prev_embeddings(prev)
        bias = theirs.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden.view(a, block, -1), prev_emb=prev_emb
        )
        logits = (logits.view(a, block, -1) + bias).view(1, a * block, -1)
        conf = theirs.confidence_head(torch.cat([hidden.view(a, block, -1), prev_emb], -1)).view(1, -1)
        every = torch.ones(1, a * block)  # every prediction supervised, no position weights
        pos = (torch.arange(a * block) % block)[None]
        tv, _ = compound_loss(logits, targets, every, pos, loss_config=resolve_loss_config("tv", "eager"))
        ce, _ = compound_loss(logits, targets, every, pos, loss_config=resolve_loss_config("ce", "eager"))
        kl, _ = compound_loss(logits, targets, every, pos, loss_config=resolve_loss_config("kl_div", "eager"))
        tv_fn = resolve_loss_config("tv", "eager")["tv"][0]
        bce = binary_cross_entropy_with_logits(conf, 1.0 - tv_fn(logits, targets), reduction="none").mean()

        out = ours(ids, states[:, : T - 1], torch.tensor([ANCHORS]))
        mine = dspark_loss(
            ours,
            out,
            input_ids=ids,
            final_states=last[:, : T - 1],
            anchor_positions=torch.tensor([ANCHORS]),
            valid_anchors=torch.ones(1, a, dtype=torch.bool),
            loss_mask=torch.ones(1, T, dtype=torch.bool),
            lengths=torch.tensor([T]),
            cfg=LossSettings(ce_weight=1.0, tv_weight=1.0, confidence_weight=1.0, position_decay=float("inf")),
        )
    assert 0.05 < float(tv) < 0.95 and float(ce) > 0.1 and float(kl) > 0.1 and float(bce) > 0.1  # away from bounds
    pairs = (
        ("tv", mine.tv, tv),
        ("kl", mine.kl, kl),
        ("ce", mine.ce, ce),
        ("confidence_bce", mine.confidence_bce, bce),
    )
    for name, got, want in pairs:
        assert abs(float(got) - float(want)) < 1e-5, (name, float(got), float(want))
