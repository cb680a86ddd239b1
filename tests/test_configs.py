"""The Hydra tree: every experiment composes, presets hold the agreed values, bad configs fail."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from dspark.core.config import DSparkConfig, TargetConfig, to_object

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUPS = ["target", "data", "drafter", "deepspeed", "eval", "logging", "paths"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_expected_experiments_exist():
    assert {"smollm2_cpu_demo", "smollm2_cpu_smoke", "smollm2_cpu_quality", "kimi_k3_gb300"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes(experiment):
    cfg = _compose(f"+experiment={experiment}", "target.path=/models/x")
    assert set(GROUPS) <= set(cfg)
    target = to_object(cfg.target, TargetConfig)
    drafter = to_object(cfg.drafter, DSparkConfig)
    assert drafter.block_size >= 2 and target.layer_ids
    # every value resolves (no dangling interpolations)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert cfg.deepspeed.zero_optimization.stage in (0, 1, 2, 3)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        cfg = _compose(f"{group}={option}")
        assert cfg[group] is not None


def test_kimi_k3_preset():
    cfg = _compose("+experiment=kimi_k3_gb300")
    target = to_object(cfg.target, TargetConfig)
    drafter = to_object(cfg.drafter, DSparkConfig)
    assert target.hidden_size == 7168
    assert target.layer_ids == [2, 23, 47, 71, 89]
    assert target.num_hidden_layers is None  # read from the checkpoint's config.json
    assert target.capture_layer_ids(93) == [2, 23, 47, 71, 89, 93]  # + the final state
    assert target.tensor_parallel_size == 16 and target.dtype == "bfloat16"
    assert cfg.train.dtype == "bfloat16" and cfg.data.store_dtype == "bfloat16"
    assert drafter.block_size == 7 and drafter.markov_rank == 256 and drafter.num_layers == 5
    assert cfg.deepspeed.zero_optimization.stage == 2
    assert list(cfg.eval.context_bins) == [16384, 65536, 131072]


def test_smollm2_demo_preset():
    cfg = _compose("+experiment=smollm2_cpu_demo")
    target = to_object(cfg.target, TargetConfig)
    assert target.source == "embedded_smollm2" and target.hidden_size == 576
    assert target.capture_layer_ids(30) == [1, 8, 15, 22, 29, 30]
    assert cfg.train.dtype == "float32" and cfg.deepspeed.zero_optimization.stage == 0


def test_smollm2_quality_preset_keeps_its_own_data_and_checkpoints():
    demo, quality = _compose("+experiment=smollm2_cpu_demo"), _compose("+experiment=smollm2_cpu_quality")
    assert quality.data.source == "bundled_lcr" and demo.data.source == "bundled"
    assert quality.data.shards_dir != demo.data.shards_dir  # another prompt set: its own dataset
    assert quality.train.checkpoint_dir != demo.train.checkpoint_dir
    ablation = _compose("+experiment=smollm2_cpu_quality", "drafter.markov_rank=0")
    assert ablation.train.checkpoint_dir.endswith("/lcr-markov0") and ablation.data.shards_dir == quality.data.shards_dir
    assert quality.train.max_seq_len >= quality.data.max_seq_len  # train on whole conversations
    assert list(quality.eval.context_bins) == list(demo.eval.context_bins)  # the demo's own eval set


def test_zero_presets_are_stages_0_to_3():
    stages = [_compose(f"deepspeed=zero{s}").deepspeed.zero_optimization.stage for s in range(4)]
    assert stages == [0, 1, 2, 3]


def test_typo_in_drafter_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="markov_rnak"):
        _compose("drafter.markov_rnak=8")


def test_wrong_type_fails_at_compose():
    with pytest.raises((ConfigCompositionException, ValidationError), match="markov_rank"):
        _compose("drafter.markov_rank=abc")


@pytest.mark.parametrize(
    "override, message",
    [
        ("drafter.markov_head_type=lstm", r"drafter.markov_head_type must be one of \('vanilla', 'gated', 'rnn'\), got 'lstm'"),
        ("drafter.block_size=1", r"drafter.block_size must be >= 2, got 1"),
        ("drafter.num_key_value_heads=5", r"must be a multiple of num_key_value_heads \(5\)"),
    ],
)
def test_bad_drafter_values_fail_with_clear_message(override, message):
    cfg = _compose(override)
    with pytest.raises(ValueError, match=message):
        to_object(cfg.drafter, DSparkConfig)


def test_missing_k3_path_is_reported():
    cfg = _compose("+experiment=kimi_k3_gb300", "paths.models_dir=/nonexistent")
    assert cfg.target.path == "/nonexistent/moonshotai/Kimi-K3"


def test_train_py_prints_resolved_config():
    out = subprocess.run(
        [sys.executable, "train.py", "+experiment=smollm2_cpu_demo", "--cfg", "job"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.target.name == "smollm2-135m" and cfg.drafter.block_size == 7
    assert cfg.tags == ["smollm2", "cpu", "demo"] and cfg.train.max_steps == 200


def test_auto_ablation_is_this_configs_markov_off_run(tmp_path):
    from eval.run import ablation_checkpoint

    for experiment, run_name in (("smollm2_cpu_demo", "markov0"), ("smollm2_cpu_quality", "lcr-markov0")):
        cfg = _compose(f"+experiment={experiment}", f"paths.output_dir={tmp_path}")
        assert ablation_checkpoint(cfg) is None  # not trained yet
        ckpt = tmp_path / "checkpoints" / "smollm2-135m" / run_name
        ckpt.mkdir(parents=True)
        (ckpt / "latest").write_text("step00000002")
        assert ablation_checkpoint(cfg) == ckpt
        assert ablation_checkpoint(_compose(f"+experiment={experiment}", f"paths.output_dir={tmp_path}",
                                            "drafter.markov_rank=0")) is None  # that run is the ablation itself
        assert ablation_checkpoint(_compose(f"+experiment={experiment}", "eval.ablation_checkpoint=null")) is None
