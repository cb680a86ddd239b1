"""issue #58: nothing a user owns is written over, nothing is created at the filesystem root, and a
resume that cannot read its checkpoint's files says why in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.checkpoint_tags import CheckpointError
from dspark.core.path_env import path_env_problem
from dspark.recipe import build_trainer
from dspark.target import load_target_heads
from tests.toy import overrides

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny(tiny_target_and_shards):
    return tiny_target_and_shards


def test_a_checkpoint_dir_holding_a_users_files_is_refused_and_left_as_it_was(compose_config, tiny, tmp_path):
    """Item 3: a 1-step run replaced the user's validation.jsonl and wrote its tag, latest, .lock and
    .owner.json beside their notes.txt."""
    target, data = tiny
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "validation.jsonl").write_text("my numbers\n")
    (mine / "notes.txt").write_text("my notes\n")
    cfg = compose_config(*overrides(target, data, tmp_path, f"train.checkpoint_dir={mine}", "train.max_steps=1"))
    with pytest.raises(CheckpointError) as err:
        build_trainer(cfg, load_target_heads(target))
    assert str(err.value) == (
        f"train.checkpoint_dir={mine}: holds notes.txt, validation.jsonl, which no training run wrote (no "
        ".owner.json); refusing to write checkpoints into it: set train.checkpoint_dir to a new or empty directory"
    )
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "validation.jsonl"]
    assert (mine / "validation.jsonl").read_text() == "my numbers\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    cfg = compose_config(*overrides(target, data, tmp_path, f"train.checkpoint_dir={afile}", "train.max_steps=1"))
    with pytest.raises(CheckpointError, match="a file, expected a directory for the run's checkpoints or nothing"):
        build_trainer(cfg, load_target_heads(target))


@pytest.mark.slow  # two short trainings: the full suite runs it
def test_an_earlier_runs_checkpoint_dir_and_an_empty_one_are_written(compose_config, tiny, tmp_path):
    target, data = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = compose_config(*overrides(target, data, tmp_path, f"train.checkpoint_dir={empty}", "train.max_steps=2"))
    build_trainer(cfg, load_target_heads(target)).train()
    assert (empty / "latest").is_file()
    cfg = compose_config(*overrides(target, data, tmp_path, f"train.checkpoint_dir={empty}", "train.max_steps=3"))
    assert build_trainer(cfg, load_target_heads(target)).train().step == 3  # resumed, not refused


@pytest.mark.parametrize(
    "env, says",
    [
        ({"DSPARK_OUTPUT_DIR": ""}, "DSPARK_OUTPUT_DIR is set but empty"),
        ({"DSPARK_CACHE": "  "}, "DSPARK_CACHE is set but empty"),
        ({"DSPARK_OUTPUT_DIR": "/"}, "DSPARK_OUTPUT_DIR='/': the filesystem root"),
        ({"DSPARK_OUTPUT_DIR": "out\nput"}, "a control character"),
        ({"DSPARK_OUTPUT_DIR": "outputs", "DSPARK_CACHE": "/tmp/c"}, None),
        ({}, None),
    ],
)
def test_directory_variables_that_would_place_outputs_at_the_root_are_named(env, says):
    problem = path_env_problem(env)
    assert problem is None if says is None else says in problem


@pytest.mark.slow  # a train.py process: the full suite runs it
def test_train_py_with_an_empty_output_dir_variable_exits_2_in_one_line_and_creates_nothing(tmp_path):
    """Item 4: ``DSPARK_OUTPUT_DIR=`` put every output at the root; Hydra created /runs/... first."""
    env = {**os.environ, "DSPARK_OUTPUT_DIR": "", "WANDB_MODE": "disabled"}
    before = set(os.listdir("/"))
    r = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "+experiment=smollm2_cpu_demo", "stages=[train]"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: DSPARK_OUTPUT_DIR is set but empty: the directories under it would start at the filesystem root "
        "(/data, /checkpoints, /runs) or the working directory; unset it (the default applies) or set it to a "
        "directory"
    ]
    assert set(os.listdir("/")) == before and list(tmp_path.iterdir()) == []


def test_a_resume_under_another_zero_stage_is_refused_naming_it(tmp_path):
    """Item 10: a ZeRO-0 checkpoint resumed with deepspeed=zero1 ended in FileNotFoundError
    (zero_pp_rank_0_mp_rank_00_optim_states.pt): DeepSpeed keeps each stage's optimizer state apart."""
    from dspark.checkpoint_run import run_differences
    from dspark.checkpoint_tags import RUN_FILE
    from dspark.config import RunConfig
    from dspark.config.deepspeed import DeepSpeedConfig, ZeroConfig

    saved = RunConfig()
    (tmp_path / RUN_FILE).write_text(json.dumps({"config": saved.to_dict()}))
    assert run_differences(tmp_path, RunConfig()) == []
    zero1 = RunConfig(deepspeed=DeepSpeedConfig(zero_optimization=ZeroConfig(stage=1)))
    assert run_differences(tmp_path, zero1) == ["deepspeed.zero_optimization.stage: checkpoint 0, now 1"]


def test_a_window_at_or_past_the_targets_context_is_refused_naming_it(compose_config, tiny, tmp_path):
    """Item 14: drafter.attention_window=1000000000 trained and exported as a sliding window of 10^9."""
    from dspark.config import ConfigError

    target, data = tiny
    positions = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    for window in (positions, 10**9):
        cfg = compose_config(*overrides(target, data, tmp_path, f"drafter.attention_window={window}"))
        with pytest.raises(ConfigError) as err:
            build_trainer(cfg, load_target_heads(target))
        assert str(err.value).startswith(
            f"drafter.attention_window={window}: at or past the target's whole context ({positions} positions"
        )
        assert str(err.value).endswith(f"or a window below {positions}")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda c: c.update(target="x"), "field 'config.target' is 'x'; expected a mapping of its keys"),
        (lambda c: c["target"].update(layer_ids="1,2"), "field 'config.target.layer_ids' is '1,2'; expected a list"),
        (lambda c: c["target"].update(name=7), "field 'config.target.name' is 7; expected a string"),
    ],
)
def test_a_wrong_typed_run_json_field_is_named_with_its_file(tiny_trained_drafter, tmp_path, edit, says):
    """Item 9: run.json's "target": "x" ended export in TypeError: TargetConfig() argument after **."""
    import shutil

    from dspark.checkpoint_tags import RUN_FILE, latest_tag
    from dspark.export import export

    target, _, ckpt = tiny_trained_drafter
    copy = tmp_path / "run"
    shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns(".lock", ".owner.json"))
    run_file = copy / latest_tag(copy) / RUN_FILE
    record = json.loads(run_file.read_text())
    edit(record["config"])
    run_file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError) as err:
        export(copy, tmp_path / "out", target_dir=target)
    assert str(err.value).startswith(f"{run_file}: {says}")
    assert not (tmp_path / "out").exists()


def test_a_name_that_becomes_a_path_refuses_control_characters_and_overlong_names():
    """Item 11 (a run_name with a newline became a directory name) and item 8 (300 characters)."""
    from dspark.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"train.run_name='a\\nb': a control character"):
        TrainConfig(run_name="a\nb")
    with pytest.raises(ConfigError, match=r"\(300 bytes\)': expected a directory name of at most 223 bytes"):
        TrainConfig(run_name="x" * 300)
    assert TrainConfig(run_name="x" * 223).run_name == "x" * 223


def test_a_shards_dir_holding_a_users_files_is_refused_before_anything_is_written(tmp_path):
    """'Every output directory follows export's rule': the data directory too."""
    from data_tools.extract import claim_shards_dir
    from dspark.config import ConfigError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        claim_shards_dir(mine)
    assert str(err.value).startswith(f"data.shards_dir={mine}: holds notes.txt, which no extraction wrote")
    (tmp_path / "earlier" / "train").mkdir(parents=True)
    for ok in (tmp_path / "missing", tmp_path / "earlier"):
        claim_shards_dir(ok)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
