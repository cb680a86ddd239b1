"""The reference speculative-decoding loop: lossless in greedy and in sampling mode, counted
the way vLLM counts, and the cached-context drafter equal to the training forward."""

import pytest
import torch

from eval.acceptance import AcceptanceCounts
from eval.reference import (
    DecodeConfig,
    DraftRunner,
    TargetRunner,
    calibration,
    plain_generate,
    prefill_prompt,
    speculative_generate,
    state_columns,
    verify,
)
from tests.toy import tiny_drafter, tiny_drafter_config, tiny_llama_target

LAYERS = [1, 2]  # 2 = the final pre-norm state of the 2-layer target


MLA = dict(family="k3_mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
"""A tiny K3 drafter (multi-head latent attention layers; the same heads and block layout)."""


def tiny_pair(
    vocab: int,
    *,
    sample_from_anchor: bool = True,
    markov_rank: int = 4,
    seed: int = 0,
    family: str = "qwen3",
    window: int | None = None,
):
    target = tiny_llama_target(seed=seed, vocab_size=vocab, num_hidden_layers=2, tie_word_embeddings=False)
    mla = MLA if family == "k3_mla" else {}
    cfg = tiny_drafter_config(
        markov_rank=markov_rank, sample_from_anchor=sample_from_anchor, attention_window=window, **mla
    )  # + confidence head
    drafter = tiny_drafter(cfg, target=target, num_context_layers=len(LAYERS), seed=None)
    with torch.no_grad():  # a drafter that is neither useless nor perfect
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5) if drafter.markov_head is not None else None
        drafter.confidence_head["proj"].weight.normal_(0, 0.3)
    return target, drafter.eval()


@pytest.mark.parametrize("family", ["qwen3", "k3_mla"])
@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_cached_block_equals_training_forward(sample_from_anchor, family):
    target, drafter = tiny_pair(50, sample_from_anchor=sample_from_anchor, family=family)
    ids = torch.randint(1, 50, (1, 12))
    runner = TargetRunner(target, LAYERS)
    runner.reset()
    _, states = runner.forward(ids[0].tolist())  # [12, 2*32]
    a = 7
    with torch.no_grad():
        ref = drafter(ids, states[None, :11], torch.tensor([[a]])).hidden[0, 0]  # [K, H]
    dr = DraftRunner(drafter)
    dr.extend(states[:3])  # the cache grows as a decoder's does: appended, not recomputed
    dr.extend(states[3:a])
    q = drafter.queries_per_block
    block = torch.full((1, q), 0)
    block[0, 0] = ids[0, a]
    got = drafter.forward_block(block, torch.arange(a, a + q)[None], dr.kv)[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_a_windowed_cached_block_equals_the_windowed_training_forward(sample_from_anchor):
    """The reference loop keeps the whole cache and reads the window: at an anchor far past the
    window it equals the training forward under the window's block mask, and a cached state just
    outside the first query's window changes nothing while one just inside it does."""
    w, a, t = 8, 17, 24
    target, drafter = tiny_pair(50, sample_from_anchor=sample_from_anchor, window=w)
    ids = torch.randint(1, 50, (1, t), generator=torch.Generator().manual_seed(3))
    runner = TargetRunner(target, LAYERS)
    runner.reset()
    _, states = runner.forward(ids[0].tolist())
    with torch.no_grad():
        ref = drafter(ids, states[None, : t - 1], torch.tensor([[a]])).hidden[0, 0]
    q = drafter.queries_per_block
    block = torch.full((1, q), 0)
    block[0, 0] = ids[0, a]

    def cached(st: torch.Tensor) -> torch.Tensor:
        dr = DraftRunner(drafter)
        dr.extend(st[:5])
        dr.extend(st[5:a])
        assert dr.length == a  # the cache holds everything; the block reads its last W - 1 entries
        return drafter.forward_block(block, torch.arange(a, a + q)[None], dr.kv)[0]

    got = cached(states)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    outside, inside = states.clone(), states.clone()
    outside[: a - w + 1] += 5.0
    # the farthest key of the first query that predicts (the fill-in layout's anchor query predicts
    # nothing, and the 1-layer tiny drafter mixes no query into another)
    inside[a - w + 1 + (0 if sample_from_anchor else 1)] += 5.0
    assert torch.equal(cached(outside), got)
    assert not torch.allclose(cached(inside), got)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_passes_that_share_one_prefill_equal_passes_that_prefill_alone(temperature):
    """The eval runs every pass over a prompt from one prefill (``prefill_prompt``, rewound
    before each pass) on a runner that holds every drafter's layers: each pass's tokens, counts and
    confidences equal those of the same pass prefilling alone on its own runner, and the rewound
    cache continues exactly as a fresh prefill does."""
    target, drafter = tiny_pair(8)
    cfg = DecodeConfig(gamma=4, max_new_tokens=24, temperature=temperature)
    prompt = torch.randint(0, 8, (11,), generator=torch.Generator().manual_seed(3)).tolist()

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone_t = TargetRunner(target, LAYERS)
    alone = [speculative_generate(alone_t, DraftRunner(drafter), prompt, cfg, set(), gen(s)) for s in (0, 1)]
    alone_plain = plain_generate(TargetRunner(target, []), prompt, cfg, set(), gen(0))

    wide = [0, *LAYERS]  # another drafter's layer 0 too: this drafter reads its own columns
    shared_t = TargetRunner(target, wide)
    d = DraftRunner(drafter, columns=state_columns(wide, LAYERS, target.config.hidden_size))
    prefill = prefill_prompt(shared_t, prompt)
    shared_plain = plain_generate(shared_t, prompt, cfg, set(), gen(0), prefill=prefill)
    shared = [speculative_generate(shared_t, d, prompt, cfg, set(), gen(s), prefill=prefill) for s in (0, 1)]

    assert shared_plain.tokens == alone_plain.tokens
    for a, b in zip(alone, shared):
        assert b.tokens == a.tokens and b.confidence == a.confidence
        assert b.counts == a.counts
    assert sum(a.counts.num_accepted for a in alone) > 0  # the drafts mean something
    shared_t.rewind(prefill)
    fresh = TargetRunner(target, wide)
    prefill_prompt(fresh, prompt)
    assert torch.equal(shared_t.forward([5, 1])[0], fresh.forward([5, 1])[0])
    assert state_columns(wide, wide, 32) is None
    with pytest.raises(ValueError, match=r"layers \[3\] are not among the target runner's \[0, 1, 2\]"):
        state_columns(wide, [3], 32)


def test_a_windowed_drafter_stays_lossless_past_its_window():
    """A smoke test of the windowed cache path over a whole answer (a crash or a cache that stops
    growing would show here; the window's edge itself: the tests above): the output is the
    target's greedy one and the drafter's blocks are accepted past its window too."""
    target, drafter = tiny_pair(8, window=6)
    cfg = DecodeConfig(gamma=4, max_new_tokens=32)
    t, d = TargetRunner(target, LAYERS), DraftRunner(drafter)
    accepted = 0
    for i in range(3):
        prompt = torch.randint(0, 8, (9 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        spec = speculative_generate(t, d, prompt, cfg, eos=set(), gen=torch.Generator().manual_seed(0))
        plain = plain_generate(t, prompt, cfg, eos=set(), gen=torch.Generator().manual_seed(0))
        assert spec.tokens == plain.tokens and len(spec.tokens) == 32
        accepted += spec.counts.num_accepted
    assert accepted > 0


@pytest.mark.parametrize(
    "sample_from_anchor,gamma,threshold,family",
    [(True, 4, None, "qwen3"), (False, 3, None, "qwen3"), (True, 4, 0.5, "qwen3"), (True, 4, None, "k3_mla")],
)
def test_greedy_speculative_output_equals_plain_greedy(sample_from_anchor, gamma, threshold, family):
    target, drafter = tiny_pair(8, sample_from_anchor=sample_from_anchor, family=family)
    cfg = DecodeConfig(gamma=gamma, max_new_tokens=32, confidence_threshold=threshold)
    t, d = TargetRunner(target, LAYERS), DraftRunner(drafter)
    accepted = rejected = 0
    for i in range(4):
        prompt = torch.randint(0, 8, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        spec = speculative_generate(t, d, prompt, cfg, eos=set(), gen=torch.Generator().manual_seed(0))
        plain = plain_generate(t, prompt, cfg, eos=set(), gen=torch.Generator().manual_seed(0))
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 32
        c = spec.counts
        assert c.num_draft_tokens >= c.num_accepted
        accepted += c.num_accepted
        rejected += c.num_drafts - c.accepted_per_pos[-1]
    assert accepted > 0 and rejected > 0  # both paths were exercised


def test_eos_stops_both_the_same_way():
    target, drafter = tiny_pair(8)
    cfg = DecodeConfig(gamma=4, max_new_tokens=40)
    t, d = TargetRunner(target, LAYERS), DraftRunner(drafter)
    prompt = [1, 2, 3, 4, 5]
    plain = plain_generate(t, prompt, cfg, eos=set(), gen=torch.Generator())
    eos = plain.tokens[5]
    stop = plain.tokens.index(eos)
    spec = speculative_generate(t, d, prompt, cfg, eos={eos}, gen=torch.Generator())
    assert spec.tokens == plain.tokens[: stop + 1]


def test_rejection_sampling_keeps_the_target_distribution():
    """A draft distribution far from the target's; one step, tiny vocab: the emitted token must
    follow p, not q (accepting every draft would give q)."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q = torch.softmax(torch.tensor([-1.0, 2.0, 1.0, 0.5, -2.0]), -1)
    p = torch.softmax(p_logits[0], -1)
    n, hist = 8000, torch.zeros(5)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        acc, nxt = verify([d], q[None], p_logits, 1.0, gen)
        hist[d if acc == 1 else nxt] += 1
    emp = hist / n
    assert 0.5 * (emp - p).abs().sum() < 0.02, (emp, p)  # sampling noise ~0.01 at n=8000
    assert 0.5 * (q - p).abs().sum() > 0.4  # the test would catch "always accept"


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_speculative_sampling_matches_exact_target_marginals():
    """End to end on a 6-token vocabulary: the marginal of generated tokens 2 and 3 over many
    sampled runs equals the exact target marginal (computed by enumeration)."""
    target, drafter = tiny_pair(6, seed=1)
    prompt, temp = [1, 2, 3], 1.0
    with torch.no_grad():

        def probs(ids):
            return torch.softmax(target(torch.tensor([ids])).logits[0, -1].float() / temp, -1)

        p0 = probs(prompt)
        p1 = {a: probs(prompt + [a]) for a in range(6)}
        m1 = sum(p0[a] * p1[a] for a in range(6))
        m2 = sum(p0[a] * p1[a][b] * probs(prompt + [a, b]) for a in range(6) for b in range(6))
    cfg = DecodeConfig(gamma=3, temperature=temp, max_new_tokens=3)
    t, d = TargetRunner(target, LAYERS), DraftRunner(drafter)
    gen = torch.Generator().manual_seed(0)
    n = 2000
    h1, h2, counts = torch.zeros(6), torch.zeros(6), AcceptanceCounts(3)
    for _ in range(n):
        g = speculative_generate(t, d, prompt, cfg, eos=set(), gen=gen)
        h1[g.tokens[1]] += 1
        h2[g.tokens[2]] += 1
        counts.merge(g.counts)
    assert counts.num_accepted > 0.2 * counts.num_draft_tokens  # drafts were really used
    assert 0.5 * (h1 / n - m1).abs().sum() < 0.05  # sampling noise ~0.025 at n=2000
    assert 0.5 * (h2 / n - m2).abs().sum() < 0.05


def test_counts_follow_vllm_definitions():
    c = AcceptanceCounts(3)
    for proposed, acc in [(3, 3), (3, 1), (3, 0), (3, 2)]:
        c.add_step(proposed, acc)
    assert c.tau == pytest.approx(1 + 6 / 4)
    assert c.accept_per_pos == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert c.accept_cond_per_pos == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    later = AcceptanceCounts(3)
    later.merge(c)
    later.add_step(3, 3)
    assert later.minus(c).tau == pytest.approx(4.0)


def test_calibration_ece():
    recs = [(0.9, True)] * 9 + [(0.9, False)] + [(0.25, False)] * 3 + [(0.25, True)]
    cal = calibration(recs, num_bins=10)
    assert cal.bin_count[9] == 10 and cal.bin_count[2] == 4
    assert cal.bin_accuracy[9] == pytest.approx(0.9) and cal.bin_accuracy[2] == pytest.approx(0.25)
    assert cal.ece == pytest.approx(0.0)
    skewed = calibration([(0.95, False)] * 4)
    assert skewed.ece == pytest.approx(0.95)


@pytest.mark.parametrize("window", [None, 6])
def test_the_window_sweep_counts_what_the_reference_loop_counts(window):
    """benchmarks/window_sweep.py runs the target once per prompt and every drafter against its
    fixed greedy continuation: the same steps, drafts and accepted tokens as the reference loop."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from window_sweep import simulate, target_pass

    target, drafter = tiny_pair(8, window=window)
    cfg = DecodeConfig(gamma=4, max_new_tokens=24)
    for i in range(3):
        prompt = torch.randint(0, 8, (9 + i,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        want = speculative_generate(
            TargetRunner(target, LAYERS), DraftRunner(drafter), prompt, cfg, eos={5}, gen=torch.Generator()
        )
        greedy, states = target_pass(target, LAYERS, prompt, cfg.max_new_tokens + cfg.gamma + 1)
        got, tokens, _ = simulate(drafter, len(prompt), greedy, states, cfg.gamma, cfg.max_new_tokens, {5})
        assert tokens == want.tokens
        assert got == want.counts and got.num_accepted > 0


@pytest.mark.parametrize("tied", [False, True])
def test_the_runners_own_head_gives_the_models_logits_and_a_prefill_keeps_the_last(tied):
    """TargetRunner computes a Llama's head itself (W @ h^T) and, for a prefill, over the last
    position alone: the logits are the model's own at every position, a cached continuation's
    too, the states unchanged, and a model outside the list goes through its own forward."""
    target = tiny_llama_target(seed=1, vocab_size=50, num_hidden_layers=2, tie_word_embeddings=tied)
    ids = torch.randint(1, 50, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = target(torch.tensor([ids]), output_hidden_states=True)
    own = TargetRunner(target, LAYERS)
    assert own._decoder is not None
    own.reset()
    head, states = own.forward(ids[:9])
    tail, tail_states = own.forward(ids[9:])
    torch.testing.assert_close(torch.cat([head, tail]), ref.logits[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([head, tail]).argmax(-1), ref.logits[0].argmax(-1))
    torch.testing.assert_close(states[:, :32], ref.hidden_states[1][0, :9])  # layer 1's state

    pre = prefill_prompt(own, ids)
    assert pre.logits.shape == (50,) and pre.length == 12 and pre.states.shape == (12, 2 * 32)
    torch.testing.assert_close(pre.logits, ref.logits[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre.states, torch.cat([states, tail_states]))

    class Wrapped(type(target)):  # a class the runner does not know: the model's own forward
        pass

    target.__class__ = Wrapped
    theirs = TargetRunner(target, LAYERS)
    assert theirs._decoder is None
    pre_theirs = prefill_prompt(theirs, ids)
    torch.testing.assert_close(pre_theirs.logits, ref.logits[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre_theirs.states, pre.states)
