"""The greedy-output comparison: how many prompts each row decodes to the reference's exact tokens."""

import json

import pytest

from dspark.config import ConfigError
from eval.agreement import greedy_outputs_equal
from eval.results import DrafterResult


def _row(name: str, runner: str, outputs: dict[str, list[int]]) -> DrafterResult:
    per_prompt = [{"prompt_id": k, "bin": 1024, "output_ids": v} for k, v in outputs.items()]
    return DrafterResult(name, runner, name, {}, {}, per_prompt=per_prompt)


VLLM = {"a": [1, 2, 3], "b": [4, 5], "c": [6]}
OURS = {"a": [1, 2, 3], "b": [4, 9], "c": [6]}  # b parts at its second token


def test_rows_are_compared_with_this_runs_first_vllm_row(compose_config):
    cfg = compose_config("+experiment=smollm2_cpu_smoke")
    got = greedy_outputs_equal(cfg, [_row("dspark", "reference", OURS), _row("ngram", "vllm", VLLM)])
    assert got["dspark"] == {"equal": 2, "prompts": 3, "reference": "vLLM ngram in this run"}
    assert got["ngram"]["equal"] == 3
    assert greedy_outputs_equal(cfg, [_row("dspark", "reference", OURS)]) == {}  # nothing to compare with
    sampled = compose_config("+experiment=smollm2_cpu_smoke", "eval.temperature=0.7")
    assert greedy_outputs_equal(sampled, [_row("dspark", "reference", OURS), _row("ngram", "vllm", VLLM)]) == {}


def test_rows_are_compared_with_another_runs_outputs_file(compose_config, tmp_path):
    ref = tmp_path / "vllm_cpu.json"
    ref.write_text(json.dumps({"method": "none", "outputs": {"a": [1, 2, 3], "b": [4, 9], "d": [7]}}))
    cfg = compose_config("+experiment=smollm2_cpu_smoke", f"eval.reference_outputs={ref}")
    got = greedy_outputs_equal(cfg, [_row("dspark", "reference", OURS), _row("ngram", "vllm", VLLM)])
    assert got["dspark"] == {"equal": 2, "prompts": 2, "reference": str(ref)}  # c is not in the file
    assert got["ngram"]["equal"] == 1
    ref.write_text(json.dumps({"per_bin": {}}))
    with pytest.raises(ConfigError, match=rf"eval.reference_outputs={ref}: expected .* 'outputs'"):
        greedy_outputs_equal(cfg, [_row("dspark", "reference", OURS)])
