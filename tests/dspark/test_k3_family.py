"""Kimi K3's drafter family (drafter=k3_mla) end to end on CPU: a tiny K3-shaped target directory
goes through the K3 preset (``+experiment=kimi_k3_gb300`` with a path override) in the main job's
``run``, is trained under DeepSpeed, exported as ``K3DSparkModel`` and read by vLLM's own
``K3DSparkForCausalLM`` (names, shapes, every parameter written, fused tensors equal ours).

What ran for real: Hydra's composition of the K3 preset, the target loader on K3's wrapper layout,
the trainer (DeepSpeed ZeRO 0, 2 and 3; offline, online and colocated data), the export and vLLM's
config classes, layer-id capture rule and weight loader for the K3 draft class. What did not: a K3
target (vLLM on CPU runs neither its KDA nor its MoE layers, transformers has no K3), so the
states are the tiny Llama target's (tests/conftest.py), whose embedding, final norm and LM head
the K3-shaped directory carries; and vLLM's K3 block attention, which is Triton/CUDA only (the
attention math is checked against transformers' DeepSeek-V3 attention in test_k3_mla.py).
"""

import json

import pytest
import torch
from safetensors import safe_open

from dspark.checkpoint_weights import load_training_checkpoint
from dspark.config import ConfigError
from dspark.export import export
from dspark.export.vllm_format import ExportError, load_drafter, read_export
from dspark.recipe import build_trainer
from dspark.target import load_target_heads
from eval.reference import DraftRunner
from tests.conftest import compose_raw
from tests.toy import TINY_K3_TEXT, TINY_LAYERS, build_tiny_k3_target, overrides

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@pytest.fixture(scope="module")
def k3_dir(tiny_target_and_shards, tmp_path_factory):
    target, _ = tiny_target_and_shards
    return build_tiny_k3_target(tmp_path_factory.mktemp("k3") / "Kimi-K3-tiny", target)


def k3_preset(k3_dir, data, out, *extra):
    """The K3 preset on the tiny K3-shaped directory, at the tiny run's sizes and in fp32."""
    return [
        "+experiment=kimi_k3_gb300",
        f"target.path={k3_dir}",
        "target.hidden_size=64",
        f"target.layer_ids={TINY_LAYERS}",
        "target.dtype=float32",
        "target.tensor_parallel_size=1",
        "drafter.num_layers=2",
        "drafter.markov_rank=16",
        "drafter.block_size=4",
        f"data.shards_dir={data}",
        "data.allow_other_target=true",  # the tiny Llama's shards stand in for K3's (same width and layers)
        "data.store_dtype=float32",
        "data.batch_size=4",
        f"paths.output_dir={out}",
        f"train.checkpoint_dir={out}/ckpt",
        "train.dtype=float32",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=1",
        "train.anchors_per_seq=8",
        "train.max_seq_len=64",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.max_steps=3",
        "train.save_every=3",
        "train.eval_every=3",
        "logging.wandb=false",
        "stages=[train]",
        *extra,
    ]


def test_the_k3_preset_trains_exports_and_vllms_k3_class_loads_it(k3_dir, tiny_target_and_shards, tmp_path, caplog):
    import train

    _, data = tiny_target_and_shards
    cfg = compose_raw(*k3_preset(k3_dir, data, tmp_path))
    assert cfg.drafter.family == "k3_mla" and cfg.deepspeed.zero_optimization.stage == 2
    result = train.run(cfg)
    assert result.target.architecture == "KimiK3ForConditionalGeneration" and result.stages_run == ["target", "train"]

    ckpt = load_training_checkpoint(tmp_path / "ckpt")
    assert ckpt.step == 3 and ckpt.zero_stage == 2 and ckpt.drafter.family == "k3_mla"
    # a drafter as wide as the target copies its MLA layout from the K3 text config
    assert {k: getattr(ckpt.dims, k) for k in MLA_KEYS} == {k: TINY_K3_TEXT[k] for k in MLA_KEYS}
    assert ckpt.dims.num_heads == TINY_K3_TEXT["num_attention_heads"]

    summary = export(ckpt, tmp_path / "export")
    assert summary.architecture == "K3DSparkModel" and summary.method == "dspark"
    assert summary.cache_values_per_token == 16 + 8  # kv_lora_rank + qk_rope_head_dim
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "k3_dspark" and config["architectures"] == ["K3DSparkModel"]
    assert config["target_layer_ids"] == [i - 1 for i in TINY_LAYERS] and config["num_target_layers"] == 2
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert config["max_position_embeddings"] == TINY_K3_TEXT["max_position_embeddings"]
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        served = set(f.keys())
    assert {"context_proj.weight", "context_norm.weight", "final_norm.weight"} <= served
    assert not {"fc.weight", "hidden_norm.weight", "norm.weight"} & served
    assert "layers.1.self_attn.kv_a_proj_with_mqa.weight" in served

    from dspark.export.validate import validate

    rep = validate(tmp_path / "export")  # against the K3-shaped target recorded in export.json
    assert rep.architecture == "K3DSparkModel" and rep.vllm_aux_layer_ids == TINY_LAYERS
    # per layer: 2 norms, fused_qkv_a_proj, q_a_layernorm, q_b_proj, kv_a_layernorm, kv_b_proj, o_proj, gate_up, down;
    # once: context_proj, context_norm, context_kv_proj, final_norm, markov w1/w2, confidence weight/bias
    assert rep.params_checked == 2 * 10 + 8
    assert any("context_kv_proj" in c and "fused_qkv_a_proj" in c for c in rep.checks), rep.checks

    exp = read_export(tmp_path / "export")  # the served names back to ours, bit for bit
    assert set(exp.weights) == set(ckpt.weights)
    assert all(torch.equal(exp.weights[k], ckpt.weights[k]) for k in ckpt.weights)
    drafter = load_drafter(exp, load_target_heads(k3_dir))
    runner = DraftRunner(drafter)
    states, _ = torch.randn(9, 2 * 64), None
    runner.extend(states[:5])
    runner.extend(states[5:])
    tokens, _, confs = runner.propose(anchor=17, gamma=4, temperature=0.0, gen=torch.Generator())
    assert len(tokens) == 4 and len(confs) == 4 and all(0 < c < 1 for c in confs)


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_k3_family_under_zero0_and_zero3_and_colocated_trains_alike(k3_dir, tiny_target_and_shards, tmp_path):
    """ZeRO-3 partitions the MLA parameters like any others, and the colocated target (here the
    tiny Llama the K3 directory stands in for) gives the shard run's losses."""
    target, data = tiny_target_and_shards
    heads = load_target_heads(target)
    mla = ("drafter=k3_mla", "drafter.num_layers=2", "train.max_steps=3", "train.save_every=3")
    runs = {}
    for name, extra in (
        ("z0", ("deepspeed=zero0",)),
        ("z3", ("deepspeed=zero3",)),
        ("colocated", ("deepspeed=zero0", "data.mode=colocated")),
    ):
        cfg = load(overrides(target, data, tmp_path / name, *mla, *extra))
        tr = build_trainer(cfg, heads)
        runs[name] = (tr, tr.train())
    ref = runs["z0"][1]
    for name in ("z3", "colocated"):
        got = runs[name][1]
        assert [h["loss"] for h in got.history] == pytest.approx([h["loss"] for h in ref.history], rel=1e-4), name
    assert ref.history[-1]["loss"] < ref.history[0]["loss"]
    e0 = load_training_checkpoint(tmp_path / "z0" / "ckpt")
    e3 = load_training_checkpoint(tmp_path / "z3" / "ckpt")
    assert e3.zero_stage == 3 and set(e3.weights) == set(e0.weights)
    # Adam divides each gradient by its own magnitude, so an element whose gradient is rounding
    # noise (the zero-initialised markov_w2's rows of tokens the batch never shows) moves by up to
    # lr a step in a direction that the reduction order decides: ZeRO-0 and ZeRO-3 add in different
    # orders. Such elements are allowed, a handful of them, each within what 3 steps of lr 3e-3 can
    # move two runs apart; every other element agrees to 1e-3.
    for k, v in e0.weights.items():
        d = (e3.weights[k] - v).abs()
        noisy = d > 1e-4 + 1e-3 * v.abs()
        assert noisy.sum() <= max(1, v.numel() // 10_000), (k, int(noisy.sum()), v.numel())
        assert float(d.max()) <= 2 * 3 * 3e-3, (k, float(d.max()))


def test_k3_family_trains_online(tiny_target_and_shards, tmp_path):
    from tests.dspark.test_online import shard_source

    target, data = tiny_target_and_shards
    cfg = load(overrides(target, data, tmp_path, "drafter=k3_mla", "data.mode=online", "train.max_steps=2"))
    state = build_trainer(cfg, load_target_heads(target), shard_source(data, [1, 2, 4], 64)).train()
    assert state.step == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in state.history)


def test_family_fields_and_layouts_are_checked(tiny_trained_drafter, tmp_path):
    with pytest.raises(ConfigError, match=r"drafter.kv_lora_rank=16: read by drafter.family=k3_mla only"):
        load(["drafter.kv_lora_rank=16"])
    with pytest.raises(ConfigError, match=r"drafter.family='gqa'.*expected one of \['qwen3', 'k3_mla'\]"):
        load(["drafter.family=gqa"])
    with pytest.raises(
        ConfigError, match=r"init_from_target_layers=\[0, 1, 2, 3, 4\]: implemented for drafter.family=qwen3"
    ):
        load(["drafter=k3_mla", "train.init_from_target_layers=[0,1,2,3,4]"])
    from dspark.config import DSparkConfig
    from dspark.export.vllm_format import check_layout

    with pytest.raises(
        ExportError, match=r"layout 'dflash': drafter.family='k3_mla' is served by vLLM's K3DSparkModel"
    ):
        check_layout(DSparkConfig(family="k3_mla", markov_rank=0, sample_from_anchor=False), "dflash")
    assert load_training_checkpoint(tiny_trained_drafter[2]).drafter.family == "qwen3"


def load(overrides_list):
    from dspark.config import load_config

    return load_config(compose_raw(*overrides_list))
