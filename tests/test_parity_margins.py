"""benchmarks/parity_margins.py: each llama.cpp row's first difference from the reference loop's
greedy text, once per (prompt, token), with the token each side chose."""

from __future__ import annotations

import pytest

from benchmarks.parity_margins import first_differences, main


def _row(name, runner, outputs):
    return {"name": name, "runner": runner, "per_prompt": [{"prompt_id": p, "output_ids": o} for p, o in outputs]}


def test_first_differences_name_the_first_row_to_part_and_both_tokens():
    ref = _row("dspark", "reference", [("a", [1, 2, 3, 4]), ("b", [5, 6, 7])])
    none = _row("llama.cpp-none", "llama.cpp", [("a", [1, 2, 3, 4]), ("b", [5, 9, 7])])
    dspark = _row("llama.cpp-dspark", "llama.cpp", [("a", [1, 2, 8, 4]), ("b", [5, 9, 9])])
    chain = _row("llama.cpp-ngram-then-dspark", "llama.cpp", [("a", [1, 2, 8]), ("b", None)])
    other = _row("ngram", "vllm", [("a", [0, 0, 0, 0])])  # not llama.cpp's: not compared
    diffs = first_differences({"drafters": [ref, none, dspark, chain, other]})
    # b parts at token 1 already without a drafter; a at token 2, first in llama.cpp-dspark; the chain's
    # same difference is not repeated, and its missing output is skipped
    assert diffs == [("llama.cpp-none", "b", 1, 6, 9), ("llama.cpp-dspark", "a", 2, 3, 8)]


def test_an_eval_without_the_reference_loop_is_refused(tmp_path):
    (tmp_path / "results.json").write_text('{"drafters": [{"name": "x", "runner": "llama.cpp", "per_prompt": []}]}')
    (tmp_path / "eval_set.jsonl").write_text("")
    with pytest.raises(SystemExit, match="eval.reference=true"):
        main([str(tmp_path)])
