"""Target resolution, GGUF conversion cache and the partial loader."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dspark.config import TargetConfig
from dspark.target import COMPLETE_MARKER, TargetError, load_target_heads, resolve_target
from tests.toy import copy_tokenizer, save_target, tiny_llama_target


def test_partial_loader_equals_full_model(smollm2_dir):
    heads = load_target_heads(smollm2_dir, spec=TargetConfig())
    full = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    assert heads.architecture == "LlamaForCausalLM"
    assert heads.tied and full.config.tie_word_embeddings
    assert (heads.hidden_size, heads.vocab_size) == (576, 49152)
    assert torch.equal(heads.embed_tokens, full.get_input_embeddings().weight)
    assert torch.equal(heads.final_norm, full.model.norm.weight)
    assert torch.equal(heads.lm_head, full.get_output_embeddings().weight)
    assert heads.rms_norm_eps == full.config.rms_norm_eps
    # The chat template survives the GGUF conversion and renders the ChatML the model was tuned on.
    text = heads.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text


def test_second_resolution_reuses_cache(smollm2_dir):
    marker = smollm2_dir / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns, (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    again = resolve_target(TargetConfig())
    assert again.path == smollm2_dir and not again.converted
    assert (
        marker.stat().st_mtime_ns,
        (smollm2_dir / "model.safetensors").stat().st_mtime_ns,
    ) == before  # nothing rewritten


CONVERT = """
import json, logging, sys
from dspark.config import TargetConfig
from dspark.target import resolve_target
r = resolve_target(TargetConfig())
print(json.dumps({"path": str(r.path), "converted": r.converted}))
"""


@pytest.mark.slow
def test_concurrent_conversions_produce_one_valid_dir(tmp_path):
    env = {**__import__("os").environ, "DSPARK_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", CONVERT], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0]["path"] == outs[1]["path"]
    assert sorted(o["converted"] for o in outs) == [False, True]  # exactly one did the work
    targets = tmp_path / "targets"
    assert sorted(p.name for p in targets.iterdir() if not p.name.endswith(".lock")) == [Path(outs[0]["path"]).name]
    heads = load_target_heads(Path(outs[0]["path"]))
    assert heads.embed_tokens.shape == (49152, 576) and torch.isfinite(heads.embed_tokens).all()


# --- a tiny untied, sharded target ----------------------------------------------------------


def _tiny_llama(path: Path, smollm2_dir: Path, *, tie: bool = False) -> LlamaForCausalLM:
    model = tiny_llama_target(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4, tie_word_embeddings=tie
    )
    save_target(model, path, smollm2_dir, max_shard_size="100KB", safe_serialization=True)
    return model


def test_sharded_target_reads_only_the_needed_shards(tmp_path, smollm2_dir):
    model = _tiny_llama(tmp_path, smollm2_dir)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    shards = set(weight_map.values())
    assert shards - needed, "the fixture must have shards the loader does not need"
    for shard in shards - needed:  # as if they had never been downloaded
        (tmp_path / shard).unlink()
    heads = load_target_heads(tmp_path)
    assert not heads.tied
    assert torch.equal(heads.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(heads.final_norm, model.model.norm.weight)
    assert torch.equal(heads.lm_head, model.lm_head.weight)
    assert not torch.equal(heads.lm_head, heads.embed_tokens)


def test_kimi_k3_wrapper_layout(tmp_path, smollm2_dir):
    """K3 checkpoints nest the text model under language_model. and text_config."""
    copy_tokenizer(smollm2_dir, tmp_path)
    torch.manual_seed(0)
    tensors = {
        "language_model.embed_tokens.weight": torch.randn(49152, 16),
        "language_model.norm.weight": torch.randn(16),
        "language_model.lm_head.weight": torch.randn(49152, 16),
        "language_model.layers.0.mlp.gate.weight": torch.randn(4, 16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "model_type": "kimi_k3",
                "text_config": {
                    "hidden_size": 16,
                    "num_hidden_layers": 3,
                    "vocab_size": 49152,
                    "tie_word_embeddings": False,
                },
            }
        )
    )
    spec = TargetConfig(
        name="k3-mini", source="hf_dir", path=str(tmp_path), hidden_size=16, num_hidden_layers=None, layer_ids=[0, 2]
    )
    heads = load_target_heads(resolve_target(spec).path, spec=spec)
    assert heads.architecture == "KimiK3ForConditionalGeneration" and heads.config["num_hidden_layers"] == 3
    assert torch.equal(heads.lm_head, tensors["language_model.lm_head.weight"])
    assert torch.equal(heads.final_norm, tensors["language_model.norm.weight"])


# --- bad specs and directories: the error names the path and what was expected ---------------


def test_missing_directory(tmp_path):
    spec = TargetConfig(name="x", source="hf_dir", path=str(tmp_path / "nope"))
    with pytest.raises(TargetError, match=r"nope: target.path is not a directory"):
        resolve_target(spec)


def test_missing_config(tmp_path):
    with pytest.raises(TargetError, match=r"config.json: missing file"):
        resolve_target(TargetConfig(name="x", source="hf_dir", path=str(tmp_path)))


def test_missing_weights_file(tmp_path, smollm2_dir):
    shutil.copy(smollm2_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(
        TargetError, match=rf"{tmp_path}: missing file; expected model.safetensors or model.safetensors.index.json"
    ):
        load_target_heads(tmp_path)


def test_missing_shard_names_the_shard(tmp_path, smollm2_dir):
    _tiny_llama(tmp_path, smollm2_dir)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / weight_map["lm_head.weight"]).unlink()
    with pytest.raises(TargetError, match=rf"{weight_map['lm_head.weight']}: missing file; .*'lm_head.weight'"):
        load_target_heads(tmp_path)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MysteryLM"], "hidden_size": 8}))
    with pytest.raises(
        TargetError, match=r"config.json: unknown architecture \['MysteryLM'\] in field 'architectures'"
    ):
        load_target_heads(tmp_path)


def test_missing_lm_head_when_untied(tmp_path, smollm2_dir):
    model = _tiny_llama(tmp_path, smollm2_dir)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for f in tmp_path.glob("model*.safetensors*"):
        f.unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(TargetError, match=r"model.safetensors: missing tensor for the LM head .*\['lm_head.weight'\]"):
        load_target_heads(tmp_path)


def test_hidden_size_mismatch_between_config_and_tensors(tmp_path, smollm2_dir):
    _tiny_llama(tmp_path, smollm2_dir)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        TargetError, match=r"input embedding has shape \[256, 64\], but config.json hidden_size=48 expects \['\*', 48\]"
    ):
        load_target_heads(tmp_path)


def test_spec_disagrees_with_directory(tmp_path, smollm2_dir):
    _tiny_llama(tmp_path, smollm2_dir)
    spec = TargetConfig(
        name="x", source="hf_dir", path=str(tmp_path), hidden_size=7168, num_hidden_layers=4, layer_ids=[1]
    )
    with pytest.raises(
        TargetError, match=r"config.json: field 'hidden_size' is 64, but target.hidden_size expects 7168"
    ):
        load_target_heads(tmp_path, spec=spec)
    spec = TargetConfig(
        name="x", source="hf_dir", path=str(tmp_path), hidden_size=64, num_hidden_layers=None, layer_ids=[1, 4]
    )
    with pytest.raises(TargetError, match=r"num_hidden_layers.*must lie in \[0, 4\)"):
        load_target_heads(tmp_path, spec=spec)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "s3"}, r"target.source must be one of"),
        ({"source": "hf_dir"}, r"target.path must name a local HF model directory"),
        ({"dtype": "fp8"}, r"target.dtype must be one of"),
        ({"layer_ids": [8, 1]}, r"strictly increasing"),
        ({"layer_ids": [1, 30]}, r"must lie in \[0, 30\) \(the final state id 30 is added implicitly\)"),
    ],
)
def test_bad_target_spec(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TargetConfig(**kwargs)


def test_a_damaged_conversion_is_converted_again_from_the_gguf_with_a_warning(tmp_path, monkeypatch, caplog):
    """Issue #58 item 6: a truncated model.safetensors in the converted target ended in safetensors'
    traceback, and a config.json edited to 24 layers was trusted (its way out trained on the
    damaged 30-layer weights). Here the conversion is a stand-in that writes two files."""
    import os

    import dspark.target as tgt

    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)  # as save_pretrained does
        (out_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
        (out_dir / "model.safetensors").write_bytes(b"w" * 5000)

    monkeypatch.setattr(tgt, "_convert_gguf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"g" * 100)
    out = tmp_path / "targets" / "t"
    assert tgt.convert_gguf_once(gguf, out).converted and len(calls) == 1
    assert not tgt.convert_gguf_once(gguf, out).converted and len(calls) == 1  # intact: reused
    for damage, says in (
        (lambda: os.truncate(out / "model.safetensors", 100), "safetensors: 100 bytes, its conversion wrote 5000"),
        (lambda: (out / "config.json").write_text(json.dumps({"num_hidden_layers": 24})), "config.json: "),
        (lambda: (out / "model.safetensors").unlink(), "model.safetensors: missing"),
    ):
        damage()
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert tgt.convert_gguf_once(gguf, out).converted
        (warning,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert says in warning and warning.endswith(f"converting it again from {gguf}")
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 30
        assert (out / "model.safetensors").stat().st_size == 5000
    assert len(calls) == 4
