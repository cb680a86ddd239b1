"""The eval names the fade's cause before it measures: a full-attention drafter evaluated past the
window it was trained on gets one warning with both ways out; a windowed one, or one evaluated
inside its training length, gets none (issue #47)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from dspark.config import DSparkConfig
from dspark.export.stage import _warn_past_training_window


def _ckpt(window, trained):
    return SimpleNamespace(
        drafter=DSparkConfig(attention_window=window), run_config={"train": {"max_seq_len": trained}}
    )


def test_a_full_attention_drafter_past_its_training_window_is_named(caplog):
    cfg = SimpleNamespace(eval=SimpleNamespace(context_bins=[1024, 7168]))
    with caplog.at_level(logging.WARNING):
        _warn_past_training_window(cfg, _ckpt(None, 512))
    (rec,) = caplog.records
    assert (
        "train.max_seq_len=512" in rec.message and "reach 7168 tokens" in rec.message and "14x farther" in rec.message
    )
    assert "drafter.attention_window" in rec.message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _warn_past_training_window(cfg, _ckpt(512, 512))  # windowed: it never reads past W
        _warn_past_training_window(cfg, _ckpt(None, 8192))  # trained as long as it is served
        _warn_past_training_window(cfg, SimpleNamespace(drafter=DSparkConfig(), run_config=None))  # an export
    assert not caplog.records
