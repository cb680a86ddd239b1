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
    heads = SimpleNamespace(  # the verifier's shared tensors, as dspark.target hands a target's over
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


def test_public_forward_loss_and_metrics_agree_with_ours_at_speculators_defaults(pair):
    """Through speculators' public ``DSparkDraftModel.forward``: its anchors, Markov bias, confidence
    head and its own ``compute_metrics``, at its defaults (position decay gamma 4, confidence alpha
    1), on greedy data (speculators' CE is against the target's argmax, ours against the dataset's
    token) with every prediction supervised. One definition differs and is accounted for, not
    hidden: speculators divides the decayed sum by the number of predictions, ours by the sum of
    the decay weights, so each of their terms is ours times the mean weight over a block
    (docs/speculators_notes.md, "Losses and where they differ from ours by design"). Their loss
    for each of ``tv``, ``kl_div`` and ``ce`` is that term plus the confidence BCE (each scaled
    so); their greedy accepted length (``eal``) is our tau and their mean acceptance rate our mean
    1 - TV. A change in speculators' forward, its anchor selection or its metrics shows here."""
    from speculators.losses import resolve_loss_config

    from dspark.config import LossSettings
    from dspark.loss import dspark_loss

    theirs, ours, verifier = pair
    block, gamma = ours.cfg.block_size, 4.0
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(1, T, 3 * 32, generator=gen)
    last = torch.randn(1, T, 32, generator=gen)
    ids = torch.randint(0, 96, (1, T), generator=gen)
    # Greedy data on which the first draft of every block is right, so tau and speculators' greedy
    # accepted length are away from their bound of 1: position by position, the target's final state
    # at t is set to point at the token our drafter's first slot predicts from anchor t (that slot
    # reads only the anchor's token and the states before it), and that token is x_{t+1}.
    head, norm_w = verifier.lm_head.weight.detach(), verifier.model.norm.weight.detach()
    with torch.no_grad():
        for t in range(T - 1):
            if 1 <= t < T - block:
                out = ours(ids, states[:, : T - 1], torch.tensor([[t]]))
                first = ours.lm_head(out.hidden)[0, 0, 0] + ours.markov_head.markov_w2(out.markov_embed)[0, 0, 0]
                last[0, t] = head[first.argmax()] / norm_w  # RMS norm then the head: the argmax is that token
            ids[0, t + 1] = verifier.lm_head(verifier.model.norm(last[:, t])).argmax(-1)
        target_logits = verifier.lm_head(verifier.model.norm(last))
    assert torch.equal(ids[0, 1:], target_logits[0, :-1].argmax(-1))  # greedy: x_{t+1} is the target's argmax at t
    loss_mask = torch.ones(1, T)
    loss_mask[0, 0] = 0  # anchors 1 .. T - block - 1 (none in the last block): every slot supervised
    anchors = list(range(1, T - block))

    def speculators_forward(spec: str) -> tuple[float, dict[str, float]]:
        with torch.no_grad():
            _, loss, metrics = theirs(
                hidden_states=states,
                input_ids=ids,
                loss_mask=loss_mask,
                verifier_last_hidden_states=last,
                document_ids=torch.zeros(1, T, dtype=torch.long),
                loss_config=resolve_loss_config(spec, "eager"),
                tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
                gamma=gamma,
                max_anchors=len(anchors),
                confidence_head_alpha=1.0,
            )
        return float(loss), {k: float(v) for k, v in metrics.items()}

    with torch.no_grad():
        out = ours(ids, states[:, : T - 1], torch.tensor([anchors]))
        mine = dspark_loss(
            ours,
            out,
            input_ids=ids,
            final_states=last[:, : T - 1],
            anchor_positions=torch.tensor([anchors]),
            valid_anchors=torch.ones(1, len(anchors), dtype=torch.bool),
            loss_mask=torch.ones(1, T, dtype=torch.bool),
            lengths=torch.tensor([T]),
            cfg=LossSettings(ce_weight=1.0, tv_weight=1.0, kl_weight=1.0, confidence_weight=1.0, position_decay=gamma),
        )
    mean_w = float(torch.exp(-torch.arange(block) / gamma).mean())  # their normaliser over ours
    bce = mean_w * float(mine.confidence_bce)
    for spec, term in (("tv", mine.tv), ("kl_div", mine.kl), ("ce", mine.ce)):
        loss, metrics = speculators_forward(spec)
        assert 0.05 < float(term) and float(mine.confidence_bce) > 0.1  # away from zero: the terms are measured
        assert abs(loss - (mean_w * float(term) + bce)) < 1e-5, (spec, loss, mean_w * float(term) + bce)
        assert abs(metrics["confidence_loss_sum"] - bce) < 1e-5, (spec, metrics["confidence_loss_sum"], bce)
        assert metrics["eal_total"] == len(anchors)
        assert abs(metrics["eal_sum"] / metrics["eal_total"] - mine.tau) < 1e-6, (metrics["eal_sum"], mine.tau)
        rate = metrics["accept_rate_sum"] / metrics["accept_rate_total"]
        assert abs(rate - float(mine.accept_prob_per_position.mean())) < 1e-5
    assert 2.0 <= mine.tau < block + 1  # every first draft matches, not every later one: tau is away from its bounds
