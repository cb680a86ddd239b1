"""Issue #48: config names that become directories are checked as paths, and Hydra's own
composition errors read like ours: one ``error:`` line naming the override, what is wrong and the
closest valid key or option, exit status 2."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config import ConfigError, load_config
from dspark.core.errors import UserError, check_composition, closest_key
from tests.conftest import compose_raw

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("key", ["train.run_name", "target.name"])
@pytest.mark.parametrize("name", [".", "..", "", ".hidden", "a/b"])
def test_names_that_become_directories_are_refused_as_paths(key, name):
    """``train.run_name=..`` wrote the run into checkpoints/ beside the other targets' runs, ``.``
    into checkpoints/<target>/ beside the other runs; ``target.name`` was not checked at all."""
    with pytest.raises(ConfigError, match=re.escape(f"{key}={name!r}: expected a directory name")):
        load_config(compose_raw(f"{key}={name}"))


def test_names_that_are_directory_names_are_kept():
    cfg = load_config(compose_raw("train.run_name=mine.v2", "target.name=smollm2-135m.q8"))
    assert cfg.train.checkpoint_dir.endswith("/checkpoints/smollm2-135m.q8/mine.v2")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train.seed=1"], "unknown config key train.seed (did you mean seed?)"),
        (["train.lrr=1"], "unknown config key train.lrr (did you mean train.lr?)"),
        (["train.seeed=1"], "unknown config key train.seeed (did you mean seed?)"),
        (["hydra.run.dirr=x"], "unknown config key hydra.run.dirr (did you mean hydra.run.dir?)"),
        (["foo=1"], "unknown config key foo (every key: python train.py --help)"),
        (
            ["+experiment=smollm2_cpu_dmeo"],
            f"+experiment=smollm2_cpu_dmeo: no such experiment, expected one of {', '.join(EXPERIMENTS)} "
            "(did you mean +experiment=smollm2_cpu_demo?)",
        ),
        (
            ["experiment=smollm2_cpu_demo"],
            "experiment=smollm2_cpu_demo: experiment is not in the defaults list "
            "(did you mean +experiment=smollm2_cpu_demo?)",
        ),
        (["+train.lr=1"], "+train.lr=1: train.lr is set already, expected train.lr=1 (without +) to change it"),
        (["train.lr=abc"], "train.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
        (["train.lr=1,2"], "train.lr=1,2: a comma outside brackets or quotes, expected train.lr=[1,2] for a list"),
        (["train.lr=[1,"], "train.lr=[1,: cannot parse (no viable alternative at input '[1,')"),
        (["-m", "train.lr=1,abc"], "train.lr=abc: Value 'abc' of type 'str' could not be converted"),
        (
            ["+experiment=smollm2_cpu_demo", "+experiment=smollm2_cpu_smoke"],
            "+experiment=smollm2_cpu_demo, +experiment=smollm2_cpu_smoke: one experiment at a time",
        ),
    ],
)
def test_hydras_composition_errors_name_the_key_and_the_closest_valid_one(argv, message):
    """Hydra's ``train.seed=1`` said 'To append to your config use +train.seed=1', which the schema
    check then refused; every composition error is now one line in our words."""
    with pytest.raises(UserError) as err:
        check_composition(argv)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["+experiment=smollm2_cpu_demo", "train.lr=1e-4", "hydra.run.dir=/tmp/x"],
        ["-m", "+experiment=smollm2_cpu_ablate", "+recipe=glob(*)", "seed=0,1"],
        ["--help"],
    ],
)
def test_what_hydra_composes_passes_the_check(argv):
    check_composition(argv)


def test_closest_key_prefers_a_sibling_then_the_same_name_elsewhere():
    cfg = compose_raw()
    assert closest_key(cfg, "train.lrr") == "train.lr"
    assert closest_key(cfg, "train.seed") == "seed"  # also data.seed, eval.seed: the shallowest
    assert closest_key(cfg, "drafter.foo") is None


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.seed=1", "error: unknown config key train.seed (did you mean seed?)"),
        (
            "+experiment=does_not_exist",
            f"error: +experiment=does_not_exist: no such experiment, expected one of {', '.join(EXPERIMENTS)}",
        ),
        ("train.run_name=..", "error: train.run_name='..': expected a directory name"),
    ],
)
def test_train_py_refuses_with_one_error_line_and_exit_2(override, line, tmp_path):
    out = subprocess.run(
        [sys.executable, "train.py", override, "stages=[]", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), out.stderr[-2000:]
