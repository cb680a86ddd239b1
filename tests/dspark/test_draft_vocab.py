"""A reduced draft vocabulary (``drafter.draft_vocab_size``, issue #38 item 4): the map built from
token frequencies as speculators builds it, the loss over the draft vocabulary with the target's
mass outside it unattainable, and the export vLLM's own loader reads (``lm_head`` [N, H], ``d2t``)."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.config import ConfigError, DSparkConfig, LossSettings
from dspark.data.draft_vocab import build_d2t, map_problem, t2d_mask, target_ids, token_counts
from dspark.loss import dspark_loss, topk_tv
from tests.toy import tiny_drafter, tiny_drafter_config

V, H = 64, 32


def drafter(**fields):
    cfg = tiny_drafter_config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, **fields)
    return cfg


def test_the_map_keeps_the_most_frequent_tokens_ties_and_unseen_by_id_in_target_order():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[7, 2, 9, 4]] = torch.tensor([5, 3, 3, 1])  # 2 and 9 tie: 2 first
    d2t = build_d2t(counts, 3)
    assert target_ids(d2t).tolist() == [2, 7, 9] and d2t.tolist() == [2, 6, 7]  # target = draft + d2t[draft]
    # more tokens than were seen: the unseen fill in id order (speculators' fill), all sorted by id
    assert target_ids(build_d2t(counts, 6)).tolist() == [0, 1, 2, 4, 7, 9]
    assert build_d2t(counts, 10).tolist() == [0] * 10  # the whole vocabulary: the identity
    assert t2d_mask(d2t, 10).nonzero().flatten().tolist() == [2, 7, 9]
    assert d2t.dtype == torch.int64
    with pytest.raises(ValueError, match=r"expected an int in \[1, 10\]"):
        build_d2t(counts, 11)
    assert map_problem(d2t, 10) is None
    assert "strictly increasing" in map_problem(torch.tensor([3, 0, 0]), 10)
    assert "in [0, 10)" in map_problem(torch.tensor([2, 6, 8]), 10)


def test_counts_are_the_supervised_next_tokens():
    class Split:
        directory, split = "d", "train"
        rows = [
            (torch.tensor([1, 2, 3, 3, 5]), torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool)),
            (torch.tensor([4, 3, 1]), torch.tensor([0, 1, 0], dtype=torch.bool)),
        ]

        def __len__(self):
            return len(self.rows)

        def tokens(self, i):
            return self.rows[i]

    answers = token_counts(Split(), vocab_size=6, rule="answer")
    assert answers.tolist() == [0, 0, 0, 3, 0, 1]
    every = token_counts(Split(), vocab_size=6, rule="all")  # every token after the first
    assert every.tolist() == [0, 1, 1, 3, 0, 1]


def test_the_key_is_checked_and_refused_for_k3():
    with pytest.raises(ConfigError, match=r"drafter.draft_vocab_size=0: expected a number >= 1"):
        DSparkConfig(draft_vocab_size=0)
    with pytest.raises(ConfigError, match=r"drafter.draft_vocab_size=16384: .*k3_mla serves the target's full"):
        DSparkConfig(family="k3_mla", draft_vocab_size=16384)
    from dspark.config import DataConfig, RunConfig

    with pytest.raises(ConfigError, match=r"drafter.draft_vocab_size=10: expected null with data.mode=online"):
        RunConfig(data=DataConfig(mode="online"), drafter=DSparkConfig(draft_vocab_size=10))
    with pytest.raises(ConfigError, match=r"drafter.draft_vocab_size=65: expected an int in \[1, 64\]"):
        tiny_drafter(drafter(draft_vocab_size=65), vocab_size=V, d2t=torch.zeros(65, dtype=torch.int64))


def test_k3_refusal_is_one_error_line_from_the_command_line(compose_config):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "dspark.config.compose", "drafter=k3_mla", "drafter.draft_vocab_size=1000"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "error: drafter.draft_vocab_size=1000: vLLM's class for drafter.family=k3_mla" in out.stderr
    assert "Traceback" not in out.stderr


def _batch(model, *, seed=0, b=2, t=14, a=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    ctx = torch.randn(b, t - 1, H, generator=g)
    final = torch.randn(b, t - 1, H, generator=g) * 3
    anchors = torch.tensor([[1, 4, 7], [2, 5, 9]])[:, :a]
    return dict(
        input_ids=ids,
        context=ctx,
        final_states=final,
        anchor_positions=anchors,
        valid_anchors=torch.ones(b, a, dtype=torch.bool),
        loss_mask=torch.ones(b, t, dtype=torch.bool),
        lengths=torch.full((b,), t),
    )


def _loss(model, batch, **topk):
    out = model(batch["input_ids"], batch["context"], batch["anchor_positions"])
    kw = {k: v for k, v in batch.items() if k != "context"}
    return out, dspark_loss(model, out, cfg=LossSettings(), **kw, **topk)


def _topk(model, batch, k):
    with torch.no_grad():
        p = torch.softmax(model.target_logits(batch["final_states"]), -1)
    top = p.topk(k, -1)
    return dict(topk_ids=top.indices, topk_probs=top.values)


def test_the_whole_vocabulary_as_a_map_gives_the_full_vocabularys_loss():
    full = tiny_drafter(drafter(), vocab_size=V)
    mapped = tiny_drafter(drafter(draft_vocab_size=V), vocab_size=V, d2t=torch.zeros(V, dtype=torch.int64))
    mapped.load_state_dict(full.state_dict(), strict=False)
    batch = _batch(full)
    for topk in ({}, _topk(full, batch, 8)):
        _, a = _loss(full, batch, **topk)
        _, b = _loss(mapped, batch, **topk)
        for name in ("loss", "ce", "tv", "kl", "confidence_bce"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-6, atol=1e-6)
        # -log(1 - TV) magnifies the tail's float32 rounding (1 - sum p_t, ~1e-7) by 1 / (1 - TV) ~ 60 here
        torch.testing.assert_close(b.lk, a.lk, rtol=1e-4, atol=0)
        assert torch.equal(a.accept_per_position, b.accept_per_position)


def test_target_mass_outside_the_draft_vocabulary_is_unattainable():
    """TV = 1/2 (sum over D |p_d - p_t| + p_t(outside D)); CE = -log p_d(label) for labels in D and
    0 for the others; KL against the target renormalised over D (as speculators takes it); a match
    needs the target's argmax in D. Checked against those formulas written out per prediction, on
    both target paths (final states and a top k that holds everything)."""
    counts = torch.arange(V) % 5  # keeps 0-mod-5 last: 20 tokens, many labels and argmaxes fall outside
    d2t = build_d2t(counts, 20)
    kept = target_ids(d2t)
    model = tiny_drafter(drafter(draft_vocab_size=20), vocab_size=V, d2t=d2t)
    batch = _batch(model, seed=1)
    out, res = _loss(model, batch)
    with torch.no_grad():
        p_d = torch.softmax(model.draft_logits(out.hidden, out.markov_embed), -1)  # [B, A, K, 20]
        p_t = torch.softmax(model.target_logits(batch["final_states"]), -1)  # [B, S, V]
    w = torch.exp(-torch.arange(4.0) / LossSettings().position_decay)
    ce = tv = kl = wsum = 0.0
    outside = 0
    for i in range(2):
        for j in range(3):
            for k in range(4):
                a = int(batch["anchor_positions"][i, j])
                label, pt = int(batch["input_ids"][i, a + k + 1]), p_t[i, a + k]
                pd = p_d[i, j, k]
                tv_ijk = 0.5 * (float((pd - pt[kept]).abs().sum()) + float(1 - pt[kept].sum()))
                assert tv_ijk >= float(1 - pt[kept].sum()) - 1e-6
                in_d = bool((kept == label).any())
                outside += not in_d
                ce += float(w[k]) * (-float(torch.log(pd[(kept == label).nonzero()[0, 0]])) if in_d else 0.0)
                tv += float(w[k]) * tv_ijk
                q = pt[kept] / pt[kept].sum()
                kl += float(w[k]) * float((q * (q / pd).log()).sum())
                wsum += float(w[k])
    assert outside > 0  # the case exercises labels outside D
    assert float(res.tv) == pytest.approx(tv / wsum, rel=1e-5)
    assert float(res.ce) == pytest.approx(ce / wsum, rel=1e-5)
    assert float(res.kl) == pytest.approx(kl / wsum, rel=1e-5) and kl > 0
    # the same through a cached top k holding the whole distribution
    _, cached = _loss(model, batch, **_topk(model, batch, V))
    assert float(cached.tv) == pytest.approx(tv / wsum, rel=1e-5)
    assert float(cached.ce) == pytest.approx(ce / wsum, rel=1e-5)
    assert float(cached.kl) == pytest.approx(kl / wsum, rel=1e-5)
    assert torch.equal(cached.accept_cond_per_position, res.accept_cond_per_position)
    # gradients reach the draft side only through the kept tokens' logits; nothing is NaN
    res.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_topk_tv_counts_top_k_tokens_outside_the_draft_vocabulary_at_zero():
    # draft vocabulary {t0, t2}, p_d = [0.5, 0.5]; target top 2: t1 0.6, t0 0.3 (t2 holds the last 0.1)
    p_d = torch.tensor([[0.5, 0.5]])
    ids, in_vocab = torch.tensor([[0, 0]]), torch.tensor([[False, True]])  # t1 is outside: any draft id
    tv = topk_tv(p_d, ids, torch.tensor([[0.6, 0.3]]), in_vocab)
    exact = 0.5 * (abs(0.5 - 0.3) + abs(0 - 0.6) + abs(0.5 - 0.1))
    assert float(tv) == pytest.approx(exact) == pytest.approx(0.6)


def test_served_draft_ids_are_target_ids_and_the_proposal_is_zero_outside():
    from eval.reference import DraftRunner

    counts = torch.zeros(V, dtype=torch.int64)
    counts[[3, 10, 20, 40]] = 1
    model = tiny_drafter(drafter(draft_vocab_size=4), vocab_size=V, d2t=build_d2t(counts, 4)).eval()
    runner = DraftRunner(model)
    runner.extend(torch.randn(6, H))
    fixed = torch.tensor([0.0, 0.0, 5.0, 0.0])  # draft id 2 = target 20, whatever the state
    model.head_logits = lambda hidden: fixed.expand(*hidden.shape[:-1], 4)  # the block's LM head
    model.markov_logits = lambda markov: torch.zeros(4)
    tokens, _, _ = runner.propose(7, 3, 0.0, torch.Generator())
    assert tokens == [20, 20, 20]
    tokens, q, _ = runner.propose(7, 2, 1.0, torch.Generator().manual_seed(0))
    assert q.shape == (2, V) and set(tokens) <= {3, 10, 20, 40}
    assert torch.allclose(q.sum(-1), torch.ones(2)) and float(q[:, [3, 10, 20, 40]].sum()) == pytest.approx(2.0)
    assert all(float(q[i, t]) > 0 for i, t in enumerate(tokens))


def test_acceptance_in_the_reference_loop_counts_target_tokens():
    """A drafter that always proposes the target's next token when it can (its draft vocabulary
    lacks some of the target's tokens): each step accepts the run of tokens up to the first one
    outside the vocabulary, computed here by hand from the target's own greedy answer."""
    from dspark.config import EvalConfig
    from eval.reference import DecodeConfig, DraftRunner, TargetRunner, plain_generate, speculative_generate
    from tests.toy import tiny_llama_target

    target = tiny_llama_target(vocab_size=V, hidden_size=H, num_hidden_layers=2)
    prompt = [5, 9, 2, 33, 17]
    cfg = DecodeConfig.of(EvalConfig(gamma=3, max_new_tokens=24, temperature=0.0))
    longer = DecodeConfig.of(EvalConfig(gamma=3, max_new_tokens=24 + 4, temperature=0.0))  # drafts run past the end
    beyond = plain_generate(TargetRunner(target, [1]), prompt, longer, set(), torch.Generator()).tokens
    greedy, full = beyond[: cfg.max_new_tokens], prompt + beyond
    missing = sorted(set(beyond[1:]))[::3]  # a third of the answer's distinct tokens cannot be drafted
    counts = torch.ones(V, dtype=torch.int64)
    counts[missing] = 0
    d2t = build_d2t(counts, V - len(missing))
    assert not set(missing) & set(target_ids(d2t).tolist())
    model = tiny_drafter(drafter(draft_vocab_size=len(d2t)), target=target, d2t=d2t).eval()
    runner = DraftRunner(model)
    n_draft = len(d2t)

    def oracle(hidden):  # the block's LM head: at each position, the true next target token's draft id (0 if none)
        rows = []
        for k in range(hidden.shape[0]):
            pos = runner.length + k + 1  # the token draft k predicts (runner.length: the anchor's index)
            want = full[pos] if pos < len(full) else 0
            ids, ok = model.to_draft_ids(torch.tensor([want]))
            row = torch.zeros(n_draft)
            row[int(ids[0]) if bool(ok[0]) else 0] = 10.0
            rows.append(row)
        return torch.stack(rows)

    model.head_logits = oracle
    model.markov_logits = lambda markov: torch.zeros(n_draft)
    res = speculative_generate(TargetRunner(target, [1]), runner, prompt, cfg, set(), torch.Generator())
    assert res.tokens == greedy  # lossless
    # by hand: from answer index j (the anchor), accept the leading drafts in the vocabulary
    drafts = accepted = 0
    j = 0
    while j < cfg.max_new_tokens - 1:
        n = 0
        while n < cfg.gamma and beyond[j + 1 + n] not in missing:
            n += 1
        drafts, accepted, j = drafts + 1, accepted + n, j + n + 1
    assert missing and 0 < accepted < drafts * cfg.gamma
    assert (res.counts.num_drafts, res.counts.num_draft_tokens) == (drafts, drafts * cfg.gamma)
    assert res.counts.num_accepted == accepted


def test_a_reduced_export_loads_in_vllms_loader_with_its_head_and_map(tmp_path):
    """The export vLLM's Qwen3DSparkForCausalLM loads: draft_vocab_size N, lm_head.weight [N, H]
    (the target's rows of the kept tokens), d2t [N] int64, markov_w2 [N, r]; read back, the drafter
    is the trained one with the same map."""
    from safetensors.torch import load_file

    from dspark.checkpoint_weights import TrainingCheckpoint
    from dspark.export import export
    from dspark.export.validate import validate
    from dspark.export.vllm_format import load_drafter, read_export
    from dspark.target import load_target_heads
    from tests.dspark.test_export_bytes import DIMS, fixed_weights
    from tests.dspark.test_speculators_format import tiny_verifier

    target = tmp_path / "target"
    tiny_verifier(target)
    heads = load_target_heads(target)
    n = 40
    cfg = DSparkConfig(num_layers=2, block_size=4, markov_rank=4, draft_vocab_size=n)
    d2t = build_d2t(torch.arange(DIMS.vocab_size) % 7, n)
    weights = {k: v for k, v in fixed_weights(cfg, DIMS).items() if k != "d2t"} | {"d2t": d2t}
    ckpt = TrainingCheckpoint(
        path=tmp_path / "ckpt" / "step00000007",
        step=7,
        drafter=cfg,
        dims=DIMS,
        weights=weights,
        run_config={"target": {"name": "golden"}, "train": {"dtype": "float32"}},
        zero_stage=0,
        context_layer_ids=[1, 3, 5],
    )
    export(ckpt, tmp_path / "out", target_dir=target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["draft_vocab_size"], config["vocab_size"]) == (n, DIMS.vocab_size)
    served = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert served["d2t"].dtype == torch.int64 and torch.equal(served["d2t"], d2t)
    assert torch.equal(served["lm_head.weight"], heads.lm_head[target_ids(d2t)])
    assert served["markov_head.markov_w2.weight"].shape == (n, 4)
    assert served["markov_head.markov_w1.weight"].shape == (DIMS.vocab_size, 4)
    rep = validate(tmp_path / "out", target_dir=target, num_speculative_tokens=4)
    assert any("draft vocabulary: vLLM's lm_head [40, 32]" in c for c in rep.checks), rep.checks
    exp = read_export(tmp_path / "out")
    assert torch.equal(exp.weights["d2t"], d2t) and "lm_head.weight" not in exp.weights
    model = load_drafter(exp, heads)
    assert torch.equal(model.lm_head.weight, served["lm_head.weight"]) and torch.equal(model.d2t, d2t)
    from dspark.export.speculators_format import write_speculators
    from dspark.export.vllm_format import ExportError

    with pytest.raises(ExportError, match=r"config.json: draft_vocab_size is 40, expected the full vocabulary \(96\)"):
        write_speculators(tmp_path / "out", tmp_path / "theirs")


def test_training_builds_the_map_from_the_answers_and_a_resumed_run_keeps_it(
    compose_config, tiny_target_and_shards, tmp_path
):
    """The map is the answers' most frequent tokens (counts cached beside the shards); a resumed
    run drafts over its checkpoint's map even when the data would now give another; the export
    carries it."""
    from safetensors.torch import load_file, save_file

    from dspark.data.draft_vocab import CACHE_DIR
    from dspark.data.shards import ShardDataset
    from dspark.export import export
    from dspark.export.vllm_format import read_export
    from dspark.recipe import build_trainer
    from dspark.target import load_target_heads
    from tests.toy import overrides

    target, data = tiny_target_and_shards
    heads = load_target_heads(target)
    extra = ("drafter.draft_vocab_size=256", "train.save_every=2", "deepspeed=zero0")
    first = build_trainer(compose_config(*overrides(target, data, tmp_path, "train.max_steps=2", *extra)), heads)
    d2t = first.model.d2t.clone()
    ds = ShardDataset(data, "train")
    answers = torch.cat([ds.tokens(i)[0][ds.tokens(i)[1]] for i in range(len(ds))])
    assert torch.equal(d2t, build_d2t(torch.bincount(answers, minlength=heads.vocab_size), 256))
    assert set(answers.tolist()) <= set(target_ids(d2t).tolist())  # the tiny answers hold < 256 distinct tokens
    assert torch.equal(first.model.lm_head.weight, heads.lm_head[target_ids(d2t)])
    first.train()
    (cache,) = (data / CACHE_DIR).glob("train-answer-*.safetensors")
    counts = load_file(str(cache))["counts"]
    try:
        save_file({"counts": counts.flip(0).contiguous()}, str(cache))  # the data now says: other tokens
        resumed = build_trainer(compose_config(*overrides(target, data, tmp_path, "train.max_steps=4", *extra)), heads)
        assert resumed.state.step == 2 and torch.equal(resumed.model.d2t, d2t)
        assert torch.equal(resumed.model.lm_head.weight, heads.lm_head[target_ids(d2t)])
        resumed.train()
    finally:
        save_file({"counts": counts}, str(cache))
    export(tmp_path / "ckpt", tmp_path / "out", target_dir=target)
    exp = read_export(tmp_path / "out")
    assert torch.equal(exp.weights["d2t"], d2t) and exp.drafter.draft_vocab_size == 256
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_vocab_size"] == 256
