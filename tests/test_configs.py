"""The Hydra tree: every experiment and group option composes into the typed RunConfig, presets
hold the agreed values and repeat no default, and a bad value fails before any stage starts,
naming the key, the value and what is allowed."""

import logging
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from dspark.config import (
    _TAG_NAMES,
    _TAG_SPELLED,
    ConfigError,
    DSparkConfig,
    RunConfig,
    TargetConfig,
    drafter_tag,
    load_config,
    target_name_from_path,
)
from tests.conftest import compose_raw

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUPS = ["target", "data", "drafter", "deepspeed", "eval", "logging", "paths"]


def _load(*overrides: str) -> RunConfig:
    return load_config(compose_raw(*overrides))


def test_expected_experiments_exist():
    assert {"smollm2_cpu_demo", "smollm2_cpu_smoke", "smollm2_cpu_quality", "kimi_k3_gb300"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_builds_the_typed_config(experiment):
    cfg = _load(f"+experiment={experiment}")
    assert isinstance(cfg, RunConfig) and isinstance(cfg.drafter, DSparkConfig) and isinstance(cfg.target, TargetConfig)
    assert isinstance(cfg.train.max_steps, int) and isinstance(cfg.eval.context_bins, list)
    assert "${" not in str(cfg.to_dict())  # every interpolation resolved once, here
    assert cfg.eval.gamma <= cfg.drafter.block_size


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_builds(group, tiny_qwen3_dir):
    needs = {"target=hf": [f"target.path={tiny_qwen3_dir}"]}  # a generic target needs its directory
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        cfg = _load(f"{group}={option}", *needs.get(f"{group}={option}", []))
        raw = OmegaConf.load(CONF / group / f"{option}.yaml")
        section = getattr(cfg, group)
        for key, value in (OmegaConf.to_container(raw, resolve=False) or {}).items():
            if isinstance(value, (int, float, str, bool)) and "${" not in str(value):
                assert getattr(section, key) == value, (group, option, key)  # the option's values arrive typed


def test_dflash_drafter_is_dspark_without_markov_and_confidence():
    d = _load("drafter=dflash").drafter
    assert (d.markov_rank, d.sample_from_anchor, d.enable_confidence_head) == (0, False, False)
    assert d.num_layers == 5 and d.block_size == 7  # the rest is DSpark's


def _redundant(preset: Path, base: RunConfig) -> list[str]:
    """Keys a preset sets to the value its base already has."""
    body = OmegaConf.to_container(OmegaConf.load(preset), resolve=False)
    body.pop("defaults", None)
    found = []

    def walk(node, obj, prefix):
        for k, v in node.items():
            cur = getattr(obj, k) if hasattr(obj, k) else (obj.get(k) if isinstance(obj, dict) else None)
            if isinstance(v, dict):
                walk(v, cur, f"{prefix}{k}.")
            elif "${" not in str(v) and cur == v:
                found.append(f"{prefix}{k}: {v!r}")

    walk(body, base, "")
    return found


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_presets_list_only_what_they_change(experiment):
    raw = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
    parents, groups = [], []
    for entry in raw.get("defaults", []):
        if isinstance(entry, str):
            parents.append(f"+experiment={entry}")
        else:
            ((key, option),) = entry.items()
            groups.append(f"{key.removeprefix('override /')}={option}")
    base = _load(*parents, *groups)
    assert not _redundant(CONF / "experiment" / f"{experiment}.yaml", base)


RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_ablation_recipes_compose_under_their_own_run_name_and_change_something(recipe):
    base = _load("+experiment=smollm2_cpu_ablate")
    cfg = _load("+experiment=smollm2_cpu_ablate", f"+recipe={recipe}")
    name = f"ablate-{recipe.replace('_', '-')}"  # checkpoints never shared or resumed across (a recipe
    assert cfg.train.run_name in (name, f"{name}-seed{cfg.seed}")  # swept over seeds names each seed's)
    assert cfg.data == base.data and cfg.logging.group == "ablation-smollm2-135m"  # same data, one W&B group
    assert not _redundant(CONF / "recipe" / f"{recipe}.yaml", base)
    changed = {k for k, v in vars(cfg.train).items() if v != getattr(base.train, k)} - {"run_name", "checkpoint_dir"}
    assert recipe == "baseline" or changed or cfg.drafter != base.drafter


def test_redundancy_check_finds_a_repeated_default(tmp_path):
    preset = tmp_path / "x.yaml"
    preset.write_text("train:\n  lr: 6.0e-4\n  max_steps: 5\n")
    assert _redundant(preset, _load()) == ["train.lr: 0.0006"]


def test_kimi_k3_preset():
    cfg = _load("+experiment=kimi_k3_gb300")
    target, drafter = cfg.target, cfg.drafter
    assert target.hidden_size == 7168
    assert target.layer_ids == [2, 23, 47, 71, 89]
    assert target.num_hidden_layers is None  # read from the checkpoint's config.json
    assert target.capture_layer_ids(93) == [2, 23, 47, 71, 89, 93]  # + the final state
    assert target.tensor_parallel_size == 16 and target.dtype == "bfloat16"
    assert cfg.train.dtype == "bfloat16" and cfg.data.store_dtype == "bfloat16"
    assert drafter.block_size == 7 and drafter.markov_rank == 256 and drafter.num_layers == 5
    assert drafter.family == "k3_mla" and drafter.rope_theta == 50000.0  # K3's own drafter: MLA, K3DSparkModel
    assert drafter.kv_lora_rank is None  # the target's (its text config), else K3's sizes
    assert cfg.train.checkpoint_dir == "outputs/checkpoints/kimi-k3/k3_mla-markov256"
    assert cfg.deepspeed.zero_optimization.stage == 2
    assert cfg.deepspeed.to_dict()["zero_optimization"]["reduce_bucket_size"] == 5e8
    assert cfg.eval.context_bins == [16384, 65536, 131072]
    # no window in K3's vLLM class: it trains on the served context's length (issue #47, item 5)
    assert cfg.drafter.attention_window is None and cfg.train.max_seq_len == cfg.data.max_seq_len == 65536
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps == 32


def test_family_presets_set_what_their_run_names_take_as_given():
    from dspark.families import FAMILIES

    for family, fam in FAMILIES.items():
        preset = REPO / "conf" / "drafter" / f"{family}.yaml"
        if family == "qwen3":
            assert fam.tag_defaults == {}  # conf/drafter/dspark.yaml: the schema's defaults
            continue
        fields = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(preset)).items() if k != "family"}
        assert fields == fam.tag_defaults, preset


def test_smollm2_demo_preset():
    cfg = _load("+experiment=smollm2_cpu_demo")
    assert cfg.target.source == "embedded_smollm2" and cfg.target.hidden_size == 576
    assert cfg.target.capture_layer_ids(30) == [1, 8, 15, 22, 29, 30]
    assert cfg.train.dtype == "float32" and cfg.deepspeed.zero_optimization.stage == 0
    assert cfg.deepspeed.to_dict() == {"zero_optimization": {"stage": 0}}  # unset knobs stay DeepSpeed's
    assert cfg.drafter.attention_window == 256 and cfg.train.run_name == "markov256-win256"  # issue #47's default
    for preset in ("smollm2_cpu_ablate", "smollm2_cpu_data_scale", "smollm2_cpu_smoke"):  # recorded / plumbing runs
        assert _load(f"+experiment={preset}").drafter.attention_window is None, preset
    t = cfg.train  # issue #57's winner: Muon at 2e-3, bf16 products where the CPU has them, micro batch 4
    assert (t.optimizer, t.muon_lr, t.autocast, t.micro_batch_size, t.max_steps) == ("muon", 2e-3, "auto", 4, 306)
    for preset in (
        "smollm2_cpu_demo_adamw_fp32",
        "smollm2_cpu_ablate",
        "smollm2_cpu_data_scale",
        "smollm2_cpu_quality",
        "smollm2_cpu_levers",
        "smollm2_cpu_smoke",
    ):
        t = _load(f"+experiment={preset}").train  # recorded fp32 AdamW runs, the levers' baseline, the plumbing
        assert (t.optimizer, t.autocast, t.micro_batch_size) == ("adamw", "off", 2), preset


def test_smollm2_quality_preset_keeps_its_own_data_and_checkpoints():
    demo, quality = _load("+experiment=smollm2_cpu_demo"), _load("+experiment=smollm2_cpu_quality")
    assert quality.data.source == "bundled_lcr" and demo.data.source == "bundled"
    assert quality.data.shards_dir != demo.data.shards_dir  # another prompt set: its own dataset
    assert quality.train.checkpoint_dir != demo.train.checkpoint_dir
    ablation = _load("+experiment=smollm2_cpu_quality", "drafter.markov_rank=0")
    assert (
        ablation.train.checkpoint_dir.endswith("/lcr-markov0-win256")
        and ablation.data.shards_dir == quality.data.shards_dir
    )
    assert quality.ablation_dir == ablation.train.checkpoint_dir
    assert quality.train.max_seq_len >= quality.data.max_seq_len  # train on whole conversations
    assert quality.eval.context_bins == demo.eval.context_bins  # the demo's own eval set


def test_a_fixed_run_name_has_no_markov_off_ablation_of_itself():
    """train.run_name=X names the Markov-off config's directory X too: the eval must not take the
    run's own checkpoint for its ablation (it reported 'markov-off' equal to dspark, ratio 1.000)."""
    named = _load("+experiment=smollm2_cpu_demo", "train.run_name=mine")
    assert named.ablation_dir is None
    assert _load("+experiment=smollm2_cpu_demo").ablation_dir.endswith("/markov0-win256")


def test_run_names_tell_drafters_apart():
    names = {
        o: _load(*o).train.run_name
        for o in [
            (),
            ("drafter.markov_rank=0",),
            ("drafter=dflash",),
            ("drafter=tiny",),
            ("drafter.markov_head_type=gated",),
            ("drafter.block_size=5",),
        ]
    }
    assert names[()] == "markov256" and names[("drafter.markov_rank=0",)] == "markov0"
    assert names[("drafter=dflash",)] == "markov0-fillin-noconf"  # not the Markov-off ablation's directory
    assert names[("drafter=tiny",)] == "markov16-L1-i256"
    assert len(set(names.values())) == len(names)


def test_every_drafter_field_has_a_place_in_the_run_name():
    """A new DSparkConfig field must get a short name, or two drafters differing in it would share
    a checkpoint directory."""
    assert {f.name for f in fields(DSparkConfig)} == set(_TAG_NAMES) | set(_TAG_SPELLED)
    assert drafter_tag(DSparkConfig(target_layer_ids=[1, 15])) == "markov256-ctx1_15"


def test_typo_in_a_key_fails_at_compose():
    for key in ("drafter.markov_rnak=8", "train.max_stpes=8", "eval.gama=3"):
        with pytest.raises(ConfigCompositionException, match=key.split("=")[0].split(".")[1]):
            compose_raw(key)


@pytest.mark.parametrize(
    "override, key",
    [
        ("drafter.markov_rank=abc", "drafter.markov_rank"),
        ("train.max_steps=abc", "train.max_steps"),
        ("data.num_prompts=1.5", "data.num_prompts"),
    ],
)
def test_wrong_type_fails_at_compose_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_raw(override)
    text = f"{err.value} {err.value.__cause__}"
    assert key in text and override.split("=")[1] in text


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.anchors_per_seq=0", r"train.anchors_per_seq=0: expected a number >= 1"),
        ("train.micro_batch_size=0", r"train.micro_batch_size=0: expected a number >= 1"),
        (
            "stages=[trian]",
            r"stages\[\]='trian': expected one of \['extract', 'train', 'export', 'eval', 'serve_bench'\]",
        ),
        ("drafter.num_layers=0", r"drafter.num_layers must be >= 1, got 0"),
        (
            "drafter.markov_head_type=lstm",
            r"drafter.markov_head_type must be one of \('vanilla', 'gated', 'rnn'\), got 'lstm'",
        ),
        ("drafter.block_size=1", r"drafter.block_size must be >= 2, got 1"),
        ("drafter.num_key_value_heads=5", r"must be a multiple of num_key_value_heads \(5\)"),
        ("data.on_overlong=drop", r"data.on_overlong='drop': expected one of \['skip', 'truncate'\]"),
        ("data.store_dtype=int8", r"data.store_dtype='int8': expected one of"),
        ("data.val_fraction=1.0", r"data.val_fraction=1.0: expected a fraction in \[0, 1\)"),
        ("eval.gamma=8", r"eval.gamma=8: expected at most drafter.block_size=7"),
        ("eval.plain_tokens=0", r"eval.plain_tokens=0: expected a number >= 1"),
        ("eval.baselines=[suffix]", r"eval.baselines\[\]='suffix': expected one of \['ngram'\]"),
        ("logging.mode=loud", r"logging.mode='loud'"),
        ("deepspeed.zero_optimization.stage=4", r"deepspeed.zero_optimization.stage=4: expected one of \[0, 1, 2, 3\]"),
        ("drafter.target_layer_ids=[2]", r"drafter.target_layer_ids=\[2\]: expected a subset of target.layer_ids"),
        ("train.supervise=prompt", r"train.supervise='prompt': expected one of \['answer', 'all'\]"),
        ("train.target_topk=-1", r"train.target_topk=-1: expected a number >= 0"),
        ("train.kl_weight=-1", r"train.kl_weight=-1.0: expected a number >= 0"),
        ("train.markov_init=xavier", r"train.markov_init='xavier': expected one of \['zeros', 'speculators'\]"),
        ("train.ce_anneal_frac=0", r"train.ce_anneal_frac=0.0: expected a fraction in \(0, 1\]"),
        (
            "train.init_from_target_layers=[1,2]",
            r"train.init_from_target_layers=\[1, 2\]: expected drafter.num_layers=5 target layer ids",
        ),
    ],
)
def test_bad_values_fail_naming_key_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        _load(override)


def test_a_loss_needs_a_weighted_term_and_a_markov_init_a_markov_head():
    with pytest.raises(ConfigError, match=r"train.ce_weight=0.0: ce_weight, tv_weight, lk_weight and kl_weight cannot"):
        _load("train.kl_weight=0")
    assert _load("train.kl_weight=0", "train.tv_weight=1").train.tv_weight == 1.0
    no_head = r"train.markov_init='speculators': expected zeros with drafter.markov_rank=0"
    with pytest.raises(ConfigError, match=no_head):
        _load("train.markov_init=speculators", "drafter.markov_rank=0")


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
def test_fp8_is_a_store_dtype_only(dtype):
    assert _load(f"data.store_dtype={dtype}").data.store_dtype == dtype
    for key in ("train.dtype", "export.dtype", "target.dtype"):
        with pytest.raises(ConfigError) as err:
            _load(f"{key}={dtype}")
        assert str(err.value) == (
            f"{key}={dtype!r}: fp8 is a shard storage format, allowed only for data.store_dtype; "
            "expected one of ['float32', 'bfloat16', 'float16']"
        )


def test_a_bad_value_stops_the_main_job_before_any_stage(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "train.anchors_per_seq=0",
            f"paths.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: train.anchors_per_seq=0: expected a number >= 1"
    assert "Traceback" not in out.stderr and "target smollm2" not in out.stdout + out.stderr  # no stage ran


def test_keys_the_schema_lacks_are_refused_naming_them(compose_config):
    """Issue #37: ``+train.lrr=1`` (what Hydra's own error suggests typing) and ``+foo=1`` were
    accepted and ignored; ``+drafter.foo=1`` failed on eval.export_dir. A dict-typed field still
    takes any key."""
    from dspark.config import ConfigError, load_config
    from tests.conftest import compose_raw

    for extra, message in (
        ("+train.lrr=1", r"unknown config key\(s\): train.lrr \(did you mean train.lr\?\)"),
        ("+foo=1", r"unknown config key\(s\): foo;"),
        ("+drafter.foo=1", r"unknown config key\(s\): drafter.foo;"),
        ("+data.online.portt=3", r"data.online.portt \(did you mean data.online.port\?\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(compose_raw(extra))
    assert load_config(compose_raw("+eval.vllm_engine_kwargs.block_size=32")).eval.vllm_engine_kwargs == {
        "block_size": 32
    }


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_every_config_error_exits_2_hydras_own_too(tmp_path):
    """Hydra's composition errors (a key without +, a missing option) exited 1, ours 2: one status."""
    unknown = "error: unknown config key train.lrr (did you mean train.lr?)"
    for extra, says in (("train.lrr=1", unknown), ("+train.lrr=1", "train.lrr")):
        out = subprocess.run(
            [sys.executable, "train.py", extra, "stages=[]", f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_generic_target_reads_name_shape_and_layers_from_its_checkpoint(tiny_qwen3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.config"):
        cfg = _load("+experiment=smollm2_cpu_smoke", "target=hf", f"target.path={tiny_qwen3_dir}")
    name = tiny_qwen3_dir.name  # tiny-qwen3-<hash>: already a slug
    t = cfg.target
    assert (t.name, t.source, t.hidden_size, t.num_hidden_layers) == (name, "hf_dir", 64, 8)
    assert t.layer_ids == [1, 3, 4, 6, 7] and t.capture_layer_ids(8) == [1, 3, 4, 6, 7, 8]
    # everything the run writes lives under the target's own name, apart from SmolLM2's
    for path in (
        cfg.data.shards_dir,
        cfg.train.checkpoint_dir,
        cfg.export.out_dir,
        cfg.eval.out_dir,
        cfg.ablation_dir,
    ):
        assert f"/{name}" in path and "smollm2" not in path, path
    assert (
        f"target {name} (named after its directory) at {tiny_qwen3_dir}: Qwen3ForCausalLM, 8 layers, hidden 64 "
        "(config.json) | layer_ids [1, 3, 4, 6, 7] + final state 8 (spread_layer_ids(8): 5 evenly over depth from 1 "
        "to 7; target.layer_ids=[...] to choose)"
    ) in caplog.text


def test_generic_target_keeps_what_is_given(tiny_qwen3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.config"):
        cfg = _load("target=hf", f"target.path={tiny_qwen3_dir}", "target.name=mine", "target.layer_ids=[2,5]")
    assert (cfg.target.name, cfg.target.layer_ids, cfg.target.hidden_size) == ("mine", [2, 5], 64)
    assert cfg.data.shards_dir.endswith("/data/mine")
    assert "target mine (target.name)" in caplog.text and "layer_ids [2, 5] + final state 8 (given as" in caplog.text


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (
            ["target.hidden_size=128"],
            "TargetError",
            r"config.json: field 'hidden_size' is 64, but target.hidden_size "
            r"expects 128; set target.hidden_size=64 \(or null to read it\)",
        ),
        (
            ["target.num_hidden_layers=30"],
            "TargetError",
            r"field 'num_hidden_layers' is 8, but target.num_hidden_layers "
            r"expects 30",
        ),
        (["target.layer_ids=[1,8]"], "ConfigError", r"target.layer_ids must lie in \[0, 8\)"),
    ],
)
def test_generic_target_value_that_disagrees_with_config_json(tiny_qwen3_dir, overrides, error, message):
    with pytest.raises(ValueError, match=message) as info:
        _load("target=hf", f"target.path={tiny_qwen3_dir}", *overrides)
    assert type(info.value).__name__ == error


def test_generic_target_needs_a_path(tmp_path):
    with pytest.raises(ConfigError, match=r"target.path: not set, .*; run with target=hf target.path=/path/to/model"):
        _load("target=hf")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'nope'}: target.path is not a directory"):
        _load("target=hf", f"target.path={tmp_path / 'nope'}")


def test_open_values_need_a_directory_to_read():
    with pytest.raises(ConfigError, match=r"null is read from config.json only for target.source=hf_dir"):
        _load("target.layer_ids=null")


@pytest.mark.parametrize(
    "path, name",
    [
        ("/models/Qwen/Qwen3-0.6B", "qwen3-0.6b"),
        ("/models/Qwen/Qwen3-0.6B/", "qwen3-0.6b"),
        ("/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f2", "llama-3.1-8b-instruct"),
        ("/m/My Model (v2)", "my-model-v2"),
    ],
)
def test_target_name_from_path(path, name):
    assert target_name_from_path(path) == name


def test_missing_k3_checkpoint_is_reported_with_its_path():
    from dspark.target import TargetError, resolve_target

    cfg = _load("+experiment=kimi_k3_gb300", "paths.models_dir=/nonexistent")
    with pytest.raises(TargetError, match="/nonexistent/moonshotai/Kimi-K3: target.path is not a directory"):
        resolve_target(cfg.target)


def test_train_py_prints_resolved_config():
    out = subprocess.run(
        [sys.executable, "train.py", "+experiment=kimi_k3_gb300", "--cfg", "job"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.target.name == "kimi-k3" and cfg.drafter.block_size == 7
    assert cfg.drafter.family == "k3_mla"  # the MLA drafter vLLM's K3DSparkModel serves
    assert cfg.tags == ["kimi-k3", "gb300", "production"] and cfg.train.max_steps == 60000


def test_train_py_help_lists_the_stages_experiments_and_examples():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    help_text = out.stdout
    assert help_text.startswith("python train.py: train a DSpark speculative-decoding drafter for a target LLM.")
    stages = help_text.split("== Stages", 1)[1].split("== Experiments", 1)[0].splitlines()[1:]
    named = [line.split()[0] for line in stages if re.match(r"  [a-z_]+ +\S", line)]  # not the continuations
    assert named == ["extract", "train", "export", "eval", "serve_bench"]
    section = help_text.split("== Experiments", 1)[1].split("== Examples", 1)[0]
    listed = {line.split()[0] for line in section.splitlines()[1:] if line.strip()}
    assert listed == {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}  # none missing
    examples = help_text.split("== Examples ==", 1)[1].split("== Configuration groups", 1)[0]
    assert examples.count("python train.py +experiment=") == 3
    # Hydra's own lists stay: the groups and the whole config with its defaults
    assert "experiment: kimi_k3_gb300, smollm2_cpu_ablate," in help_text and "deepspeed: zero0, zero1" in help_text
    assert "markov_rank: 256" in help_text and "HYDRA_FULL_ERROR=1" in help_text


def test_auto_ablation_is_this_configs_markov_off_run(tmp_path):
    from dspark.export.stage import ablation_checkpoint

    for experiment, run_name in (("smollm2_cpu_demo", "markov0-win256"), ("smollm2_cpu_quality", "lcr-markov0-win256")):
        cfg = _load(f"+experiment={experiment}", f"paths.output_dir={tmp_path}")
        assert ablation_checkpoint(cfg) is None  # not trained yet
        ckpt = tmp_path / "checkpoints" / "smollm2-135m" / run_name
        ckpt.mkdir(parents=True)
        (ckpt / "latest").write_text("step00000002")
        assert ablation_checkpoint(cfg) == ckpt
        assert (
            ablation_checkpoint(
                _load(f"+experiment={experiment}", f"paths.output_dir={tmp_path}", "drafter.markov_rank=0")
            )
            is None
        )  # that run is the ablation itself
        assert ablation_checkpoint(_load(f"+experiment={experiment}", "eval.ablation_checkpoint=null")) is None


LEVERS = sorted(p.stem for p in (CONF / "lever").glob("*.yaml"))


@pytest.mark.parametrize("lever", LEVERS)
def test_levers_compose_on_the_demos_data_under_their_own_run_name(lever):
    """Issue #57: one checkpoint directory per lever and seed, the demo's shards, one W&B group."""
    demo = _load("+experiment=smollm2_cpu_demo")
    base = _load("+experiment=smollm2_cpu_levers")
    cfg = _load("+experiment=smollm2_cpu_levers", f"+lever={lever}", "seed=2")
    assert cfg.train.run_name == f"lever-{lever.replace('_', '-')}-seed2"
    assert cfg.train.checkpoint_dir == f"outputs/checkpoints/levers/smollm2-135m/{cfg.train.run_name}"
    assert cfg.data == demo.data and cfg.logging.group == "levers-smollm2-135m"
    assert not _redundant(CONF / "lever" / f"{lever}.yaml", base)
    changed = {k for k, v in vars(cfg.train).items() if v != getattr(base.train, k)} - {"run_name", "checkpoint_dir"}
    assert lever == "fp32" or changed or cfg.drafter != base.drafter
