"""The storage bill the extract stage prints before it starts (no engine, no target)."""

from types import SimpleNamespace

import pytest

from data_tools.extract import estimate_storage
from data_tools.prompts import Conversation
from data_tools.storage import main, sequence_tokens, storage_estimate
from dspark.config import DataConfig
from tests.toy import toy_manifest


def test_k3_layout_per_token_and_per_run():
    bf16 = storage_estimate(dtype="bfloat16", n_layers=6, hidden=7168, num_prompts=200_000, tokens_per_prompt=16384)
    fp8 = storage_estimate(dtype="float8_e4m3", n_layers=6, hidden=7168, num_prompts=200_000, tokens_per_prompt=16384)
    assert bf16.bytes_per_token == 6 * 7168 * 2 == 86016
    assert fp8.bytes_per_token == 6 * 7168 + 6 * 4 == 43032  # the scales: 0.03% over half of bf16
    assert bf16.total_bytes == 86016 * 16384 * 200_000 and bf16.bytes_per_1k_prompts == 86016 * 16384 * 1000
    assert bf16.line() == (
        "storage estimate: 86016 bytes/token, about 1409.3 GB per 1k prompts, about 281.86 TB for this run's "
        "200000 prompts (~16384 tokens per sequence)"
    )


def test_a_sequence_is_prompt_plus_answer_within_the_window():
    assert sequence_tokens(100, None, max_new_tokens=256, window=2048) == 356  # the target answers
    assert sequence_tokens(100, 40, max_new_tokens=256, window=2048) == 140  # the dataset's answer
    assert sequence_tokens(2000, None, max_new_tokens=256, window=2048) == 2048


class WordTokenizer:
    """One token per whitespace-separated word; the chat template joins contents."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return " ".join(m["content"] for m in messages) + (" <gen>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=list(range(len(text.split()))))


def test_extract_estimates_from_the_manifest_layout_and_the_sampled_prompts():
    manifest = toy_manifest(dtype="float8_e5m2")
    convs = [Conversation((("user", "a b c"),)), Conversation((("user", "a b c d e f g"),))]
    data = DataConfig(max_new_tokens=10, max_seq_len=20)
    est = estimate_storage(manifest, {"train": convs[:1], "val": convs[1:]}, WordTokenizer(), data)
    assert (est.bytes_per_token, est.num_prompts) == (2 * (8 + 4), 2)
    assert est.tokens_per_prompt == ((3 + 1 + 10) + (7 + 1 + 10)) / 2  # prompt + generation prompt + answer


@pytest.mark.parametrize("dtype, expected", [("bfloat16", "86016 bytes/token"), ("float8_e4m3", "43032 bytes/token")])
def test_the_command_prices_the_k3_preset_without_vllm_or_the_target(capsys, dtype, expected):
    assert main(["+experiment=kimi_k3_gb300", f"data.store_dtype={dtype}", "--prompt-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kimi-k3, data.store_dtype={dtype}: storage estimate: {expected}")
    assert "for this run's 200000 prompts (~8192 tokens per sequence)" in out
