"""drafter.attention_window through the export (issue #47, item 1): the keys vLLM and llama.cpp's
converter read (``dflash_config.use_swa`` + ``swa_window_size``), read back and checked against what
the drafter was trained with; speculators' form both ways, its own loader building the window and
its own mask's edge; vLLM's loader building every draft layer sliding-window and non-causal."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.config import ConfigError, DSparkConfig
from dspark.export import export
from dspark.export.speculators_format import read_speculators, write_speculators
from dspark.export.vllm_format import ExportError, read_export
from tests.conftest import need_speculators
from tests.dspark.test_export_bytes import checkpoint
from tests.dspark.test_speculators_format import tiny_verifier

W = 16
FIELDS = dict(num_layers=2, block_size=4, markov_rank=4, attention_window=W)


@pytest.fixture
def windowed(tmp_path):
    """(our windowed dspark export, its target dir with weights)."""
    target = tmp_path / "target"
    tiny_verifier(target)
    export(checkpoint(tmp_path, FIELDS), tmp_path / "ours", target_dir=target)
    return tmp_path / "ours", target


def test_the_export_serves_the_window_and_reads_it_back(windowed, tmp_path):
    export_dir, _ = windowed
    cfg = json.loads((export_dir / "config.json").read_text())
    # the window, and beside it the block's ids as DFlash's nested schema has them: llama.cpp's
    # converter reads mask_token_id from dflash_config alone once there is one
    assert cfg["dflash_config"] == {
        "target_layer_ids": [0, 2, 4],
        "mask_token_id": cfg["mask_token_id"],
        "use_swa": True,
        "swa_window_size": W,
    }
    assert cfg["target_layer_ids"] == [0, 2, 4]  # and at the top level, as before
    assert read_export(export_dir).drafter.attention_window == W
    # full attention writes no window key at all (the pinned bytes of tests/dspark/test_export_bytes.py)
    export(checkpoint(tmp_path / "full", {**FIELDS, "attention_window": None}), tmp_path / "full_out")
    assert "dflash_config" not in json.loads((tmp_path / "full_out" / "config.json").read_text())
    # a config.json that serves another window than the drafter was trained with is refused
    for dflash, served in (({"use_swa": True, "swa_window_size": 32}, 32), ({"use_swa": False}, None), (None, None)):
        bad = (
            {**cfg, "dflash_config": dflash}
            if dflash is not None
            else {k: v for k, v in cfg.items() if k != "dflash_config"}
        )
        (export_dir / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ExportError, match=rf"config.json: serves attention window {served} .*attention_window={W}"):
            read_export(export_dir)


def test_the_fill_in_layout_carries_the_window_in_its_dflash_config(tmp_path):
    fields = {**FIELDS, "markov_rank": 0, "sample_from_anchor": False, "enable_confidence_head": False}
    export(checkpoint(tmp_path, fields), tmp_path / "out", layout="dflash")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dflash_config"]["use_swa"] is True and cfg["dflash_config"]["swa_window_size"] == W
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    assert read_export(tmp_path / "out").drafter.attention_window == W


def test_a_window_is_refused_where_it_cannot_be_served():
    with pytest.raises(ConfigError, match=r"drafter.attention_window=4: expected null .* or an int >= 5"):
        DSparkConfig(block_size=4, attention_window=4)
    with pytest.raises(ConfigError, match=r"drafter.attention_window=5: expected null .* or an int >= 6"):
        DSparkConfig(block_size=4, sample_from_anchor=False, attention_window=5)  # the fill-in block has 5 queries
    with pytest.raises(ConfigError, match=r"drafter.family=k3_mla has full-attention layers only"):
        DSparkConfig(family="k3_mla", attention_window=64)


def test_speculators_form_both_ways(windowed, tmp_path):
    export_dir, _ = windowed
    out = write_speculators(export_dir, tmp_path / "theirs")
    cfg = json.loads((out / "config.json").read_text())
    layers = cfg["transformer_layer_config"]
    assert layers["layer_types"] == ["sliding_attention"] * 2 and layers["sliding_window"] == W
    assert layers["is_causal"] is False and layers["use_sliding_window"] is True
    assert cfg["sliding_window_non_causal"] is True
    assert read_speculators(out).drafter.attention_window == W
    for change, message in (
        ({"layer_types": ["sliding_attention", "full_attention"]}, r"expected every layer 'sliding_attention' or"),
        ({"sliding_window": None}, r"transformer_layer_config.sliding_window is None, expected an int >= 1"),
    ):
        (out / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": {**layers, **change}}))
        with pytest.raises(ExportError, match=message):
            read_speculators(out)
    (out / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}))
    with pytest.raises(ExportError, match=r"sliding_window_non_causal is False with sliding layers, expected true"):
        read_speculators(out)


def test_speculators_own_model_builds_the_window_and_masks_by_the_anchor(windowed, tmp_path):
    """speculators 0.9.0 reads the converted window into every layer, non-causal; its training mask
    keeps context a - W .. a - 1 for every query of the block at anchor a (by the anchor, where vLLM,
    llama.cpp and we edge each query by its own position: docs/speculators_notes.md)."""
    speculators = need_speculators()
    from speculators.models.dflash.attention import create_anchor_block_mask_mod

    export_dir, _ = windowed
    model = speculators.SpeculatorModel.from_pretrained(str(write_speculators(export_dir, tmp_path / "theirs")))
    assert model.sliding_window == W and model.sliding_window_indices == [0, 1]
    assert model.sliding_window_non_causal is True and not model.uses_full_attn
    s, a, q = 40, 30, 4
    mod, _, _ = create_anchor_block_mask_mod(
        torch.zeros(s, dtype=torch.long), s, torch.tensor([a]), q, sliding_window=W, sliding_window_non_causal=True
    )
    for i in range(q):
        seen = [p for p in range(s) if bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(i), torch.tensor(p)))]
        assert seen == list(range(a - W, a))  # theirs: W context keys whatever the query
    ours = DSparkConfig(**FIELDS)
    from dspark.model import window_mask

    for i in range(q):  # ours (and vLLM's, llama.cpp's): W keys counting the query's own position
        seen = [p for p in range(a) if bool(window_mask(torch.tensor(a + i), torch.tensor(p), ours.attention_window))]
        assert seen == list(range(a + i - W + 1, a))


def test_vllms_loader_builds_every_layer_sliding_and_non_causal(windowed):
    from dspark.export.validate import validate

    export_dir, target = windowed
    rep = validate(export_dir, target_dir=target, num_speculative_tokens=4)
    assert any(f"sliding window {W}" in c and "non-causal" in c for c in rep.checks), rep.checks
