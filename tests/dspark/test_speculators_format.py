"""Our DSpark export in speculators' format (issue #38, item 1): the config translated (layer ids in
Hugging Face hidden_states numbering, the draft layers' Qwen3 config, the verifier), the weights
file unchanged, refusals for what speculators' DSpark cannot hold, nothing of a user's lost; and
speculators' own loader (installed by scripts/setup.sh) reads it back to the same tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dspark.checkpoint_tags import CheckpointError
from dspark.checkpoint_weights import load_training_checkpoint
from dspark.export import export
from dspark.export.speculators_format import read_speculators, speculators_config, write_speculators
from dspark.export.vllm_format import ExportError, read_export
from tests.conftest import need_speculators
from tests.dspark.test_export_bytes import DIMS, TARGET_CONFIG, checkpoint

REPO = Path(__file__).resolve().parents[2]
FIELDS = dict(num_layers=2, block_size=4, markov_rank=4)


def tiny_verifier(target: Path) -> Any:
    """A Qwen3 target with weights, of the dims TARGET_CONFIG names, saved to ``target``: what
    speculators reads its embedding, head and norm from. Its LM head at std 1 (not the 0.02 init),
    so logits are of order 1-10 and a backbone difference shows at 1e-5."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=96,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    model.save_pretrained(target)
    return model


@pytest.fixture
def ours(tmp_path):
    """(our dspark export, its target dir): a 2-layer drafter over context layers [1, 3, 5]."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    export(checkpoint(tmp_path, FIELDS), tmp_path / "ours", target_dir=target)
    return tmp_path / "ours", target


def test_the_config_is_translated_and_the_weights_are_the_same_file(ours, tmp_path):
    export_dir, target = ours
    out = write_speculators(export_dir, tmp_path / "theirs")
    cfg = json.loads((out / "config.json").read_text())
    mine = json.loads((export_dir / "config.json").read_text())
    # speculators counts layers as hidden_states does (0 = embeddings): vLLM's target_layer_ids + 1
    assert mine["target_layer_ids"] == [0, 2, 4] and cfg["aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["speculators_model_type"] == "dspark"
    assert (cfg["block_size"], cfg["markov_rank"], cfg["sample_from_anchor"]) == (4, 4, True)
    layers = cfg["transformer_layer_config"]
    assert (layers["num_hidden_layers"], layers["hidden_size"], layers["head_dim"]) == (2, DIMS.hidden_size, 8)
    assert layers["rope_parameters"] == {"rope_theta": mine["rope_theta"], "rope_type": "default"}
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": str(target.resolve()), "architectures": ["Qwen3ForCausalLM"]}
    assert (out / "model.safetensors").read_bytes() == (export_dir / "model.safetensors").read_bytes()
    assert json.loads((out / "export.json").read_text())["format"] == "speculators"


def test_what_speculators_dspark_cannot_hold_is_refused_by_file_and_field(ours, tmp_path):
    export_dir, _ = ours
    cfg_file = export_dir / "config.json"
    good = cfg_file.read_text()
    for key, value, message in (
        ("markov_head_type", "gated", r"config.json: markov_head_type is 'gated', expected 'vanilla'"),
        ("sample_from_anchor", False, r"config.json: sample_from_anchor is False, expected true"),
        ("architectures", ["K3DSparkModel"], r"config.json: architectures is \['K3DSparkModel'\], expected"),
    ):
        cfg_file.write_text(json.dumps({**json.loads(good), key: value}))
        with pytest.raises(ExportError, match=message):
            speculators_config(export_dir)
    cfg_file.write_text(good)
    with pytest.raises(ExportError, match=r"nowhere/config.json: the verifier's config is missing \(pass --verifier"):
        speculators_config(export_dir, tmp_path / "nowhere")


def test_a_users_directory_is_refused_and_an_earlier_conversion_replaced(ours, tmp_path):
    export_dir, _ = ours
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"--out .*mine: .*notes.txt"):
        write_speculators(export_dir, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    with pytest.raises(ExportError, match="it is the export being converted"):
        write_speculators(export_dir, export_dir)
    out = write_speculators(export_dir, tmp_path / "theirs")
    assert write_speculators(export_dir, out) == out  # its own earlier output: replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "model.safetensors"]


def test_the_command_line(ours, tmp_path):
    export_dir, target = ours
    run = [sys.executable, "-m", "dspark.export", "speculators", str(export_dir), "--out", str(tmp_path / "t")]
    ok = subprocess.run([*run, "--verifier", str(target)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "speculators' DSparkDraftModel" in ok.stdout, ok.stderr
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "x").write_text("x")
    bad = subprocess.run([*run[:-1], str(tmp_path / "u")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("error:") == 1 and "Traceback" not in bad.stderr


def test_speculators_own_loader_reads_the_same_weights(ours, tmp_path):
    """speculators 0.9.0's SpeculatorModel.from_pretrained on the conversion: its DSparkDraftModel,
    every tensor of ours equal, nothing of ours left unread, the rest (embedding, verifier head and
    norm) taken from the verifier's directory."""
    speculators = need_speculators()
    export_dir, target = ours
    verifier = tiny_verifier(target)
    out = write_speculators(export_dir, tmp_path / "theirs")
    model = speculators.SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "DSparkDraftModel"
    assert list(model.config.aux_hidden_state_layer_ids) == [1, 3, 5] and model.config.block_size == 4
    state = model.state_dict()
    weights = load_file(str(export_dir / "model.safetensors"))
    assert set(weights) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    assert sorted(set(state) - set(weights)) == [
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    assert torch.equal(model.embed_tokens.weight, verifier.model.embed_tokens.weight)
    assert torch.equal(model.verifier_lm_head.weight, verifier.lm_head.weight)
    # and back: the files speculators' own save_pretrained writes read as our drafter, tensor for tensor
    model.save_pretrained(str(tmp_path / "saved_by_speculators"))
    back = read_speculators(tmp_path / "saved_by_speculators")
    assert sorted(back.weights) == sorted(weights) and all(torch.equal(back.weights[k], v) for k, v in weights.items())
    assert back.dims == read_export(export_dir).dims and back.context_layer_ids == [1, 3, 5]


def test_round_trip_ours_theirs_ours_gives_the_same_drafter(ours, tmp_path):
    export_dir, _ = ours
    mine = read_export(export_dir)
    back = read_speculators(write_speculators(export_dir, tmp_path / "theirs"))
    assert back.dims == mine.dims and back.context_layer_ids == mine.context_layer_ids == [1, 3, 5]
    shaping = ("num_layers", "block_size", "markov_rank", "sample_from_anchor", "enable_confidence_head")
    assert all(getattr(back.drafter, f) == getattr(mine.drafter, f) for f in shaping)
    assert back.drafter.confidence_head_with_markov == mine.drafter.confidence_head_with_markov
    assert sorted(back.weights) == sorted(mine.weights)
    assert all(torch.equal(back.weights[k], mine.weights[k]) for k in mine.weights)


def test_a_speculators_config_our_drafter_cannot_be_is_refused(ours, tmp_path):
    export_dir, _ = ours
    out = write_speculators(export_dir, tmp_path / "theirs")
    good = json.loads((out / "config.json").read_text())
    for change, message in (
        ({"speculators_model_type": "eagle3"}, r"speculators_model_type is 'eagle3', expected 'dspark'"),
        ({"draft_vocab_size": 32}, r"draft_vocab_size is 32, expected the full vocabulary \(96\)"),
        ({"mask_token_id": None}, r"mask_token_id is null"),
        (
            {"aux_hidden_state_layer_ids": [1, -3]},
            r"'aux_hidden_state_layer_ids' is \[1, -3\], expected a list of integers >= 0",
        ),
        ({"aux_hidden_state_layer_ids": [1, True]}, r"'aux_hidden_state_layer_ids' is \[1, True\], expected"),
        ({"markov_rank": 8}, r"model.safetensors: tensor 'markov_head.markov_w1.weight' has shape \[96, 4\], expected"),
    ):
        (out / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(CheckpointError, match=message):  # ExportError, or check_weights' CheckpointError
            read_speculators(out)


@pytest.mark.slow
def test_a_run_starts_from_a_speculators_checkpoint_of_its_own_drafter(tiny_trained_drafter, tmp_path):
    """train.init_from: the tiny run's drafter, exported and converted to speculators' format, is
    where a new run starts (at lr 0 its first checkpoint holds exactly those weights); a run whose
    drafter differs is refused with the field that differs."""
    from dspark.config import ConfigError, load_config
    from dspark.recipe import build_drafter, init_from_drafter
    from dspark.target import load_target_heads
    from tests.conftest import compose_raw
    from tests.toy import overrides, train_drafter

    target, data, ckpt = tiny_trained_drafter
    export(ckpt, tmp_path / "ours", target_dir=target)
    theirs = write_speculators(tmp_path / "ours", tmp_path / "theirs")
    want = read_export(tmp_path / "ours").weights
    heads = load_target_heads(target)
    run = tmp_path / "run"
    cfg = load_config(
        compose_raw(
            *overrides(target, data, run, "train.max_steps=1", "train.save_every=1", "train.lr=0"),
            f"train.init_from={theirs}",
        )
    )
    train_drafter(cfg, heads)
    got = load_training_checkpoint(run / "ckpt").weights
    assert sorted(got) == sorted(want) and all(torch.equal(got[k].float(), v) for k, v in want.items())
    other = load_config(
        compose_raw(*overrides(target, data, run, "drafter.markov_rank=8"), f"train.init_from={theirs}")
    )
    drafter, _, _ = build_drafter(other, heads)
    with pytest.raises(ConfigError, match=r"train.init_from=.*theirs: its drafter.markov_rank is 16, this run's is 8"):
        init_from_drafter(drafter, other, theirs)
    both = compose_raw(*overrides(target, data, run), f"train.init_from={theirs}", "train.init_from_target_layers=[0]")
    with pytest.raises(ConfigError, match="expected null with train.init_from_target_layers"):
        load_config(both)


@pytest.mark.slow
def test_vllms_own_loader_accepts_the_speculators_conversion(tiny_trained_drafter, tmp_path):
    """vLLM 0.32 reads speculators' DSpark format itself (its speculators config path maps
    DSparkDraftModel to Qwen3DSparkModel and aux_hidden_state_layer_ids to target_layer_ids): our
    validation on the conversion passes through that path, with the same layers and weights."""
    from dspark.export.validate import validate

    target, _, ckpt = tiny_trained_drafter
    export(ckpt, tmp_path / "ours", target_dir=target)
    theirs = write_speculators(tmp_path / "ours", tmp_path / "theirs")
    rep = validate(theirs)  # the target from speculators_config.verifier
    assert rep.method == "dspark" and rep.target_dir == target.resolve()
    assert rep.vllm_aux_layer_ids == read_export(tmp_path / "ours").context_layer_ids
    assert any("vLLM's loader writes all" in c for c in rep.checks)
    assert rep.params_checked == validate(tmp_path / "ours").params_checked
