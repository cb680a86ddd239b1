"""The eval names the fade's cause before it measures: a full-attention drafter evaluated past the
window it was trained on gets one warning with both ways out; a windowed one, or one evaluated
inside its training length, gets none (issue #47)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from dspark.config import DSparkConfig
from eval.prompts import warn_past_training_window


def _ckpt(window, trained):
    """What the export stage records of a checkpoint: [drafter.attention_window, train.max_seq_len]."""
    return DSparkConfig(attention_window=window).attention_window, trained


def test_a_full_attention_drafter_past_its_training_window_is_named(caplog):
    cfg = SimpleNamespace(eval=SimpleNamespace(context_bins=[1024, 7168]))
    with caplog.at_level(logging.WARNING):
        warn_past_training_window(cfg, *_ckpt(None, 512))
    (rec,) = caplog.records
    assert (
        "train.max_seq_len=512" in rec.message and "reach 7168 tokens" in rec.message and "14x farther" in rec.message
    )
    assert "drafter.attention_window" in rec.message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_past_training_window(cfg, *_ckpt(512, 512))  # windowed: it never reads past W
        warn_past_training_window(cfg, *_ckpt(None, 8192))  # trained as long as it is served
        warn_past_training_window(cfg, DSparkConfig().attention_window, None)  # a drafter directory: no training length
    assert not caplog.records
