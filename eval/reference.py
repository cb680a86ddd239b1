"""Reference speculative decoding in PyTorch: the target in transformers with a KV cache, the
drafter reading the target's states at its context layers, exactly as vLLM runs it.

One step, for the last token x_a (sampled by the target, its states not computed yet):

1. the drafter proposes d_1..d_g from context states < a (one parallel block, then the Markov
   head left to right; a confidence threshold may end the block early);
2. the target verifies [x_a, d_1..d_g] in one forward (KV cache), which also yields the states
   of those positions;
3. greedy: keep the longest prefix that equals the target's argmax; sampling: standard rejection
   sampling (accept d_k with min(1, p/q), else sample from norm(max(p - q, 0))), so the output
   distribution is the target's; then one bonus/correction token from the target;
4. the target cache is cut back to the kept tokens and their states extend the drafter context.

Counting matches vLLM's counters (:mod:`eval.acceptance`): one draft per verification step that
proposed something, every proposed token counted even past ``max_new_tokens`` or EOS (the output
is cut afterwards), and every verification step counted as a step, drafted or not.

Proposers: our drafter (``DraftRunner``), vLLM's prompt lookup (``PromptLookup``: the ``ngram``
method's own matching function, its rules and the same gamma), or the two chained
(``ngram-then-dspark``): the lookup's proposal where it finds one, the drafter's block otherwise.
vLLM 0.32 serves one method per engine, so the chained row is measured here only; it is the upper
bound that a serving-side hybrid could reach.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dspark.calibration import NUM_BINS, calibration_sums, expected_calibration_error
from dspark.config import EvalConfig
from dspark.model import few_rows_linear
from eval.acceptance import AcceptanceCounts
from eval.results import Calibration

log = logging.getLogger(__name__)

HEAD_ONLY_LMS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV3ForCausalLM",
    }
)
"""transformers' causal LMs whose forward ends in ``lm_head(last_hidden_state)`` (no soft-capping,
no logit scale): :class:`TargetRunner` computes their head itself."""


@dataclass(frozen=True)
class DecodeConfig:
    """How the loop decodes. The eval's values are its config's (:meth:`of`), which holds their
    defaults (``eval.gamma``, ``eval.max_new_tokens``, ...)."""

    gamma: int
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    confidence_threshold: Optional[float] = None  # end a block at the first draft whose confidence is below
    seed: int = 0
    budget_blocks: bool = False
    """llama.cpp's rule at the end of the answer: a block of at most (tokens left - 1) drafts, none
    with one token left (``server_slot::get_n_draft_max``); off: every block has gamma drafts, as
    vLLM drafts. On for the rows with a drafter when the eval measures llama.cpp's rows too, so
    that each llama.cpp row and its reference twin count the same steps (``llama_cpp_parity``)."""

    @classmethod
    def of(cls, e: EvalConfig, *, budget_blocks: bool = False) -> DecodeConfig:
        return cls(
            gamma=e.gamma,
            max_new_tokens=e.max_new_tokens,
            temperature=e.temperature,
            confidence_threshold=e.confidence_threshold,
            seed=e.seed,
            budget_blocks=budget_blocks,
        )


class TargetRunner:
    """The target with a KV cache. ``forward`` returns float32 logits and the concatenated states
    of the context layers (``dspark.core.layer_ids`` convention) for the tokens it is given, on
    the model's device (a GPU's, when the eval put it there)."""

    def __init__(self, model: torch.nn.Module, context_layer_ids: Sequence[int]):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.layer_ids = [int(i) for i in context_layer_ids]
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        bad = [i for i in self.layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"context layer ids {bad} outside [0, {self.num_layers}] for this target")
        self._pre_norm: Optional[torch.Tensor] = None
        if self.num_layers in self.layer_ids:  # the final state before the norm: not in hidden_states
            model.get_decoder().norm.register_forward_pre_hook(lambda _m, a: setattr(self, "_pre_norm", a[0]))
        self.cache = None
        # transformers' causal LMs whose logits are lm_head(last hidden state), nothing after it:
        # their head is computed here (dspark.model.few_rows_linear: the verify pass's 8 rows), and
        # over the last position alone for a prefill (its other positions' logits are never read:
        # 7k x 49k floats, 1.4 GB, at 7k)
        self._head = model.get_output_embeddings()
        plain_head = isinstance(self._head, torch.nn.Linear) and type(model).__name__ in HEAD_ONLY_LMS
        self._decoder = model.get_decoder() if plain_head else None
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length()) if self.cache is not None else 0

    @torch.no_grad()
    def forward(
        self, ids: Sequence[int], states: bool = True, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] (``last_logits_only``: [1, V], the last position's) and context states
        [n, C] for ``ids`` appended to the cache."""
        inp = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        want_states = states and bool(self.layer_ids)  # plain decoding asks for none: a fair baseline
        kw = dict(input_ids=inp, past_key_values=self.cache, use_cache=True, output_hidden_states=want_states)
        if self._decoder is not None:
            out = self._decoder(**kw)
            h = out.last_hidden_state[0, -1:] if last_logits_only else out.last_hidden_state[0]
            logits = few_rows_linear(self._head, h)
        else:
            keep = last_logits_only and self._keeps_logits
            out = self.model(**kw, **({"logits_to_keep": 1} if keep else {}))
            logits = out.logits[0, -1:] if last_logits_only else out.logits[0]
        self.cache = out.past_key_values
        if not want_states:
            return logits.float(), torch.empty(inp.shape[1], 0, device=self.device)
        states = [self._pre_norm[0] if i == self.num_layers else out.hidden_states[i][0] for i in self.layer_ids]
        return logits.float(), torch.cat(states, dim=-1).float()

    def drop_last(self, n: int) -> None:
        """Forget the last n cached positions (rejected drafts)."""
        if n > 0:
            self.cache.crop(-n)

    def rewind(self, prefill: Prefill) -> None:
        """Back to the cache :func:`prefill_prompt` left (a pass appends to it and crops only what it
        rejects): the prompt's cached keys and values are the prefill's own, bit for bit."""
        if self.cache is None or self.length < prefill.length:
            raise ValueError(f"rewind to {prefill.length} cached positions, but the cache holds {self.length}")
        self.drop_last(self.length - prefill.length)  # transformers deprecates crop(positive length)


@dataclass
class Prefill:
    """The target's forward over one prompt (:func:`prefill_prompt`), computed once and shared
    by every pass over that prompt (plain decoding, each drafter, the chain): the prompt's prefill
    is most of a long prompt's cost, and no pass's decode timing includes it."""

    logits: torch.Tensor  # [V], the last position's
    states: torch.Tensor  # [len, C], the context layers' states (C = 0 without layers)
    length: int


def state_columns(runner_layers: Sequence[int], layers: Sequence[int], width: int) -> Optional[torch.Tensor]:
    """The columns of a :class:`TargetRunner`'s states (its ``runner_layers``' states side by side,
    ``width`` each) that hold ``layers``', in that order; None when they are all of them in order."""
    runner_layers, layers = [int(i) for i in runner_layers], [int(i) for i in layers]
    if layers == runner_layers:
        return None
    missing = [i for i in layers if i not in runner_layers]
    if missing:
        raise ValueError(f"layers {missing} are not among the target runner's {runner_layers}")
    return torch.cat([torch.arange(j * width, (j + 1) * width) for j in map(runner_layers.index, layers)])


class DraftRunner:
    """Our drafter over a growing context cache (what vLLM's drafter KV or latent cache holds), on
    the drafter's device."""

    def __init__(self, drafter: torch.nn.Module, columns: Optional[torch.Tensor] = None):
        self.drafter = drafter.eval()
        self.device = drafter.fc.weight.device
        self.cfg = drafter.cfg
        self.columns = columns
        """Which columns of the target runner's states are this drafter's context layers, when the
        runner serves several drafters (:func:`state_columns`); None: all of them, in order."""
        self.kv: Optional[list[tuple[torch.Tensor, ...]]] = None  # per layer, the family's context cache
        self.length = 0

    def reset(self) -> None:
        self.kv, self.length = None, 0

    def extend(self, states: torch.Tensor) -> None:
        """Append target states [n, C] for the next n positions."""
        if self.columns is not None:
            states = states[:, self.columns.to(states.device)]
        pos = torch.arange(self.length, self.length + states.shape[0], device=self.device)[None]
        new = self.drafter.context_kv(states[None].to(self.device, self.drafter.fc.weight.dtype), pos)
        self.kv = self.drafter.extend_context(self.kv, new)
        self.length += states.shape[0]

    @torch.no_grad()
    def propose(
        self,
        anchor: int,
        gamma: int,
        temperature: float,
        gen: torch.Generator,
        confidence_threshold: Optional[float] = None,
    ) -> tuple[list[int], Optional[torch.Tensor], list[float]]:
        """Drafts for the positions after the anchor (at position ``self.length``). Returns the
        tokens (target ids), their proposal distributions [g, V] over the target vocabulary
        (sampling only) and confidences (if a head)."""
        d, a = self.drafter, self.length
        q = gamma if self.cfg.sample_from_anchor else gamma + 1
        block = torch.full((1, q), d.dims.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        hidden = d.forward_block(block, torch.arange(a, a + q, device=self.device)[None], self.kv)[0]  # [gamma, H]
        # the LM head over the whole block in one product, reading its weights once rather than once
        # per position; the Markov bias, which needs the token just drafted, is added per position
        head_logits = d.head_logits(hidden[:gamma])  # [gamma, V]
        tokens: list[int] = []
        probs, confs = [], []
        prev = [anchor]
        for k in range(gamma):
            markov = None
            if d.markov_head is not None:  # sequential: the previous token is the one just drafted
                markov = d.markov_head.embed(torch.tensor(prev, device=self.device), hidden[: k + 1])[-1]
            logits = head_logits[k] if markov is None else head_logits[k] + d.markov_logits(markov)
            if d.confidence_head is not None:
                conf = float(torch.sigmoid(d.confidence_logits(hidden[k], markov)))
                if confidence_threshold is not None and k > 0 and conf < confidence_threshold:
                    break
                confs.append(conf)
            # a reduced draft vocabulary drafts a draft id, mapped to its target id (d2t) as vLLM does;
            # its proposal distribution is 0 on the other target tokens
            if temperature > 0:  # sampled on the host, with the host generator, wherever the model runs
                p = torch.softmax(logits.float().cpu() / temperature, dim=-1)
                tok = int(d.to_target_ids(torch.multinomial(p, 1, generator=gen)))
                probs.append(d.to_target_vocab(p))
            else:
                tok = int(d.to_target_ids(torch.argmax(logits)))
            tokens.append(tok)
            prev.append(tok)
        return tokens, (torch.stack(probs) if probs else None), confs


class PromptLookup:
    """vLLM's ``ngram`` proposer: the longest suffix n-gram (``min_n``..``max_n`` tokens) of the
    sequence so far that occurred before, and the up to ``k`` tokens that followed its earliest
    occurrence (never past ``max_model_len``); none when there is no such match. The matching is
    vLLM's own function
    (``vllm.v1.spec_decode.ngram_proposer._find_longest_matched_ngram_and_propose_tokens``) when
    vLLM is installed, else :func:`eval.prompt_lookup.longest_match_proposal`, which
    ``tests/eval/test_prompt_lookup.py`` pins equal to vLLM's; either way the proposals are the
    ones the served ``ngram`` method makes on the same tokens."""

    _logged = False  # which matching function is used: logged once per process

    def __init__(self, min_n: int, max_n: int, max_model_len: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        try:
            from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find

            source = "vLLM's _find_longest_matched_ngram_and_propose_tokens"
        except ImportError:
            from eval.prompt_lookup import longest_match_proposal as find

            source = "eval.prompt_lookup.longest_match_proposal (vLLM not installed)"
        if not PromptLookup._logged:
            log.info("prompt lookup matching: %s", source)
            PromptLookup._logged = True
        self._find = find
        self.min_n, self.max_n, self.max_model_len = min_n, max_n, max_model_len

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        import numpy as np

        found = self._find(np.asarray(tokens, dtype=np.int32), self.min_n, self.max_n, self.max_model_len, k)
        return [int(t) for t in found]


def _one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    """The proposal distribution of a model-free proposer: all mass on its token (what vLLM's
    rejection sampler assumes for drafts without probabilities)."""
    q = torch.zeros(len(tokens), vocab)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


def _sample(p: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def verify(
    drafts: list[int], q: Optional[torch.Tensor], target_logits: torch.Tensor, temperature: float, gen: torch.Generator
) -> tuple[int, int]:
    """(number accepted, next token) for drafts against target logits [g+1, V] at the positions
    that predict d_1..d_g and the bonus. Greedy: exact match; sampling: rejection sampling."""
    if temperature <= 0:
        best = torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return n, best[n]
    p = torch.softmax(target_logits.cpu() / temperature, dim=-1)  # the host generator samples
    for k, tok in enumerate(drafts):
        if torch.rand((), generator=gen) < torch.clamp(p[k, tok] / q[k, tok], max=1.0):
            continue
        residual = torch.clamp(p[k] - q[k], min=0)
        total = residual.sum()
        return k, _sample(residual / total if total > 0 else p[k], gen)
    return len(drafts), _sample(p[len(drafts)], gen)


@dataclass
class Generation:
    tokens: list[int]
    counts: AcceptanceCounts
    confidence: list[tuple[float, bool]] = field(default_factory=list)  # (predicted, accepted) per decided draft
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0


def _first_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    return _sample(torch.softmax(logits.cpu() / temperature, dim=-1), gen)


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def speculative_generate(
    target: TargetRunner,
    draft: Optional[DraftRunner],
    prompt: Sequence[int],
    cfg: DecodeConfig,
    eos: set[int],
    gen: torch.Generator,
    lookup: Optional[PromptLookup] = None,
    prefill: Optional[Prefill] = None,
) -> Generation:
    """One prompt. ``draft`` alone: our drafter every step; ``lookup`` alone: vLLM's ngram rule
    (a step without a match verifies the anchor alone); both: the lookup where it matches, the
    drafter otherwise (its context still grows every step). ``prefill``: this prompt's, shared with
    other passes (``target`` made it); None: computed here."""
    if draft is None and lookup is None:
        raise ValueError("speculative_generate needs a drafter, a prompt lookup, or both")
    res = Generation([], AcceptanceCounts(cfg.gamma))
    if draft is not None:
        draft.reset()
    t0 = time.perf_counter()
    prefill = _prefilled(target, prompt, prefill)
    out = [_first_token(prefill.logits, cfg.temperature, gen)]
    if draft is not None:
        draft.extend(prefill.states)
    logits = prefill.logits[None]
    res.prefill_s = time.perf_counter() - t0
    t_dec = time.perf_counter()
    while True:
        out, done = _finish(out, cfg.max_new_tokens, eos)
        if done:
            break
        anchor = out[-1]
        t1 = time.perf_counter()
        drafts, q, confs = [], None, []
        k = min(cfg.gamma, cfg.max_new_tokens - len(out) - 1) if cfg.budget_blocks else cfg.gamma
        if lookup is not None and k > 0:
            drafts = lookup.propose([*prompt, *out], k)
            if drafts and cfg.temperature > 0:
                q = _one_hot(drafts, logits.shape[-1])
        if not drafts and draft is not None and k > 0:
            drafts, q, confs = draft.propose(anchor, k, cfg.temperature, gen, cfg.confidence_threshold)
        t2 = time.perf_counter()
        logits, states = target.forward([anchor, *drafts])
        n, nxt = verify(drafts, q, logits, cfg.temperature, gen)
        t3 = time.perf_counter()
        res.draft_s += t2 - t1
        res.verify_s += t3 - t2
        res.counts.add_step(len(drafts), n)
        res.confidence += [(c, k < n) for k, c in enumerate(confs[: n + 1])]
        target.drop_last(len(drafts) - n)  # keep the anchor and the accepted drafts
        if draft is not None:
            draft.extend(states[: n + 1])
        out += drafts[:n] + [nxt]
    res.decode_s = time.perf_counter() - t_dec
    res.tokens = out
    return res


def prefill_prompt(target: TargetRunner, prompt: Sequence[int]) -> Prefill:
    """A fresh cache holding ``prompt`` (the runner interface alone: reset, forward): its last
    position's logits and every position's context states, for every pass over the prompt
    (:meth:`TargetRunner.rewind`)."""
    target.reset()
    logits, states = target.forward(prompt, last_logits_only=True)
    return Prefill(logits[-1], states, len(prompt))


def _prefilled(target: TargetRunner, prompt: Sequence[int], prefill: Optional[Prefill]) -> Prefill:
    if prefill is None:
        return prefill_prompt(target, prompt)
    if prefill.length != len(prompt):
        raise ValueError(f"a prefill of {prefill.length} tokens for a prompt of {len(prompt)}")
    target.rewind(prefill)
    return prefill


def plain_generate(
    target: TargetRunner,
    prompt: Sequence[int],
    cfg: DecodeConfig,
    eos: set[int],
    gen: torch.Generator,
    prefill: Optional[Prefill] = None,
) -> Generation:
    """The same target decoding one token per forward (no context states asked for): the baseline
    for tokens/s and the losslessness check. ``prefill`` as in :func:`speculative_generate`."""
    res = Generation([], AcceptanceCounts(cfg.gamma))
    t0 = time.perf_counter()
    out = [_first_token(_prefilled(target, prompt, prefill).logits, cfg.temperature, gen)]
    res.prefill_s = time.perf_counter() - t0
    t_dec = time.perf_counter()
    while True:
        out, done = _finish(out, cfg.max_new_tokens, eos)
        if done:
            break
        logits, _ = target.forward([out[-1]], states=False)
        out.append(_first_token(logits[-1], cfg.temperature, gen))
    res.decode_s = time.perf_counter() - t_dec
    res.tokens = out
    return res


def calibration(records: list[tuple[float, bool]], num_bins: int = NUM_BINS) -> Optional[Calibration]:
    """Expected calibration error over equal-width confidence bins (:mod:`dspark.calibration`, the
    trainer's definition), and the reliability curve."""
    if not records:
        return None
    sums = calibration_sums(
        torch.tensor([c for c, _ in records], dtype=torch.float64),
        torch.tensor([float(ok) for _, ok in records], dtype=torch.float64),
        num_bins,
    )
    count, conf_sum, acc_sum = sums[:, 0].tolist(), sums[:, 1].tolist(), sums[:, 2].tolist()
    return Calibration(
        expected_calibration_error(sums),
        [i / num_bins for i in range(num_bins + 1)],
        [conf_sum[b] / count[b] if count[b] else None for b in range(num_bins)],
        [acc_sum[b] / count[b] if count[b] else None for b in range(num_bins)],
        [int(c) for c in count],
    )
