"""Prompt lookup (n-gram) proposals without vLLM.

:func:`longest_match_proposal` gives the same proposals as vLLM's ``ngram`` proposer
(``vllm.v1.spec_decode.ngram_proposer._find_longest_matched_ngram_and_propose_tokens``, vLLM 0.32);
``tests/eval/test_prompt_lookup.py`` pins the two equal on random sequences. It is written
independently (vLLM's runs KMP on the reversed sequence under numba): here the candidates are
narrowed one token at a time with numpy, O(len(tokens) * max_n) work in vectorised steps.
"""

from __future__ import annotations

import numpy as np


def longest_match_proposal(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> np.ndarray:
    """The tokens that followed the earliest earlier occurrence of the longest suffix n-gram.

    Let ``T = len(tokens)``. The suffix ``tokens[T-n:]`` of length ``n`` *occurs earlier* when
    ``tokens[s:s+n]`` equals it for some start ``s`` with ``s + n <= T - 1`` (the occurrence ends
    before the last token; it may overlap the suffix). ``L`` is the largest ``n <= max_n`` whose
    suffix occurs earlier, ``s`` the smallest such start for it. When ``L >= min_n`` the proposal
    is ``tokens[s+L : s+L+k']`` with ``k' = min(k, max_model_len - T)`` (never past the model's
    length; the slice also stops at the end of ``tokens``, so it holds at least one token);
    otherwise, and when ``T < min_n`` or ``k' <= 0``, it is empty.

    ``tokens`` is a 1-d integer array (int32, as vLLM passes it); the result is a view of it
    with its dtype. Requires ``1 <= min_n <= max_n``.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"longest_match_proposal needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
    tokens = np.asarray(tokens)
    total = tokens.shape[0]
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0 or total < 2:
        return tokens[:0]

    # Candidate occurrences by their last position e (0 <= e <= T-2): after step n, ``ends``
    # holds the e with tokens[e-n+1 : e+1] == tokens[T-n:], in increasing order.
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    best_n, best_end = 0, -1
    n = 1
    while ends.size:
        best_n, best_end = n, int(ends[0])  # the smallest end = the earliest start for this length
        if n == max_n:
            break
        ends = ends[ends >= n]  # room for one more token before the occurrence
        ends = ends[tokens[ends - n] == tokens[total - 1 - n]]
        n += 1

    if best_n < min_n:
        return tokens[:0]
    start = best_end + 1  # the token right after the matched n-gram (<= T-1)
    return tokens[start : start + k]
