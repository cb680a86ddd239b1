"""eval.prompt_lookup against vLLM's own n-gram matcher: the reference loop's ``ngram`` rows on a
machine without vLLM (the one-GPU device run) must propose exactly what the served method does."""

import numpy as np
import pytest

from eval.prompt_lookup import longest_match_proposal


def _cases(seed: int, n: int):
    """Random sequences over small vocabularies (many repeats, so long matches), some with a
    copied run planted, at every length from 0 up, with the proposer's usual and edge settings."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        vocab = int(rng.integers(2, 12))
        length = int(rng.integers(0, 60))
        tokens = rng.integers(0, vocab, size=length).astype(np.int32)
        if length > 20 and i % 3 == 0:  # an answer that copies a span of its prompt
            start = int(rng.integers(0, length - 12))
            tokens[-8:] = tokens[start : start + 8]
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        max_model_len = length + int(rng.integers(-2, 10))  # includes a window already full
        yield tokens, min_n, max_n, max_model_len, k


def test_proposals_equal_vllms_on_random_sequences():
    vllm_find = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")._find_longest_matched_ngram_and_propose_tokens
    proposed = 0
    for args in _cases(seed=0, n=3000):
        ours, theirs = longest_match_proposal(*args), vllm_find(*args)
        assert ours.dtype == theirs.dtype and ours.tolist() == theirs.tolist(), args
        proposed += len(theirs) > 0
    assert proposed > 1000  # the cases exercise matches, not only the empty answer


def test_the_earliest_occurrence_of_the_longest_suffix_by_hand():
    t = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 1, 2, 3], dtype=np.int32)
    # suffix [1, 2, 3] occurs at 1 and 5; the earliest is followed by 9, 1, 2, 3, 7
    assert longest_match_proposal(t, 2, 3, 100, 5).tolist() == [9, 1, 2, 3, 7]
    assert longest_match_proposal(t, 4, 5, 100, 5).tolist() == []  # [4, 1, 2, 3] never occurred before
    assert longest_match_proposal(t, 2, 3, len(t) + 2, 5).tolist() == [9, 1]  # never past max_model_len
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        longest_match_proposal(t, 3, 2, 100, 5)
