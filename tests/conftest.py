"""Shared fixtures. Everything runs offline on CPU in fp32."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded target converted to a transformers dir (in the user cache, so converted
    once per machine, not once per test run)."""
    from dspark.core.config import TargetConfig
    from dspark.core.target import resolve_target

    return resolve_target(TargetConfig()).path


def compose_raw(*overrides: str):
    """The composed conf/config.yaml with overrides (a DictConfig), as Hydra hands it to a command."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def compose_config():
    """The typed, validated RunConfig that `python train.py OVERRIDES...` hands to its stages."""
    from dspark.core.config import load_config

    return lambda *overrides: load_config(compose_raw(*overrides))
