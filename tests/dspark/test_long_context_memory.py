"""benchmarks/long_context_memory.py (issue #47, item 5): its meta-device count of what a training
sequence saves for backward is the count of the same forward on real tensors, and it grows linearly
with the training window, so its K3 figures at 16k-128k are the model's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dspark.model import resolve_dims
from tests.toy import tiny_drafter_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from long_context_memory import sequence_bytes  # noqa: E402

MLA = dict(family="k3_mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
TARGET = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


@pytest.mark.parametrize("family", ["qwen3", "k3_mla"])
def test_the_meta_count_is_the_real_count_and_linear_in_the_window(family):
    cfg = tiny_drafter_config(num_layers=2, markov_rank=4, **(MLA if family == "k3_mla" else {}))
    dims = resolve_dims(cfg, target_config=TARGET, vocab_size=64, num_context_layers=3, mask_token_id=0)
    meta = [sequence_bytes(cfg, dims, n, 4, torch.float32) for n in (64, 128, 192)]
    real = sequence_bytes(cfg, dims, 128, 4, torch.float32, device="cpu")
    assert meta[1] == real > 0
    assert meta[2] - meta[1] == meta[1] - meta[0] > 0  # per token, whatever the window
