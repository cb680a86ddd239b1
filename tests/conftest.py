"""Shared fixtures. Everything runs offline on CPU in fp32."""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def need_speculators():
    """speculators (the peer our export converts to): skipped where it is not installed, but a
    failure under CI (``DSPARK_REQUIRE_SPECULATORS=1``, as llama.cpp's tests under
    ``DSPARK_REQUIRE_LLAMA_CPP``), where scripts/setup.sh installs it."""
    if os.environ.get("DSPARK_REQUIRE_SPECULATORS") == "1":
        import speculators  # noqa: PLC0415 - a missing install fails the test here

        return speculators
    return pytest.importorskip("speculators", reason="scripts/setup.sh installs speculators==0.9.0")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded target converted to a transformers dir (in the user cache, so converted
    once per machine, not once per test run)."""
    from dspark.config import TargetConfig
    from dspark.target import resolve_target

    return resolve_target(TargetConfig()).path


TINY_QWEN3_SEED = 0


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smollm2_dir) -> Path:
    """A second architecture: a tiny Qwen3 target with random weights (tests/toy.py TINY_QWEN3:
    Qwen3ForCausalLM, 8 layers, hidden 64) and SmolLM2's tokenizer and chat template, built offline
    once per machine under ``$DSPARK_CACHE/targets/tiny-qwen3-<hash of its recipe>`` (written to a
    temporary name, renamed when complete)."""
    from filelock import FileLock

    from dspark.core.atomic_files import atomic_path
    from dspark.target import cache_root
    from tests.toy import TINY_QWEN3, TOKENIZER_FILES, save_target, tiny_qwen3_target

    recipe = json.dumps({"config": TINY_QWEN3, "seed": TINY_QWEN3_SEED, "tokenizer": TOKENIZER_FILES}, sort_keys=True)
    out = cache_root() / "targets" / f"tiny-qwen3-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not (out / "config.json").is_file():
            with atomic_path(out) as tmp:
                save_target(tiny_qwen3_target(seed=TINY_QWEN3_SEED), tmp, smollm2_dir, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_target_and_shards(tmp_path_factory, smollm2_dir) -> tuple[Path, Path]:
    """(target dir, shards dir): tests/toy.py's tiny target and its 12 train + 3 val rows
    (``build_target_and_shards``), built once per session. Shared: a test may read them (the
    trainer's Arrow cache beside the shards is a cache) but one that changes them works on a copy
    (``shutil.copytree``), as test_trainer's fp8, top-k and wrong-target tests do."""
    from tests.toy import build_target_and_shards

    return build_target_and_shards(tmp_path_factory.mktemp("tiny"), smollm2_dir)


@pytest.fixture
def tiny(tiny_target_and_shards) -> tuple[Path, Path]:
    """:func:`tiny_target_and_shards` under the short name the trainer's tests use
    (``tests.toy.make_trainer(compose_config, tiny, out, ...)``)."""
    return tiny_target_and_shards


@pytest.fixture(scope="session")
def tiny_trained_drafter(tmp_path_factory, tiny_target_and_shards) -> tuple[Path, Path, Path]:
    """(target dir, shards dir, checkpoint dir): a drafter trained in this process for 2 steps
    (``tests.toy.overrides(..., "train.max_steps=2", "train.save_every=2")``, one checkpoint,
    step00000002) on :func:`tiny_target_and_shards`, once per session. Read-only: a test that writes
    into the checkpoint copies the directory first."""
    from dspark.config import load_config
    from dspark.target import load_target_heads
    from tests.toy import overrides, train_drafter

    target, data = tiny_target_and_shards
    out = tmp_path_factory.mktemp("tiny_drafter")
    cfg = load_config(compose_raw(*overrides(target, data, out, "train.max_steps=2", "train.save_every=2")))
    train_drafter(cfg, load_target_heads(target))
    return target, data, out / "ckpt"


def compose_raw(*overrides: str):
    """The composed conf/config.yaml with overrides (a DictConfig), as Hydra hands it to a command."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def compose_config():
    """The typed, validated RunConfig that `python train.py OVERRIDES...` hands to its stages."""
    from dspark.config import load_config

    return lambda *overrides: load_config(compose_raw(*overrides))


class SmallDisk:
    """tmpfs filesystems of a chosen size under a test's tmp_path, for disk-full tests; mounting
    needs root (or CAP_SYS_ADMIN): where it is refused, the test is skipped and says so."""

    def __init__(self, root: Path):
        self.root, self.mounted = root, []

    def mount(self, size: int, name: str = "disk") -> Path:
        where = self.root / name
        where.mkdir()
        self._run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
        self.mounted.append(where)
        return where

    def resize(self, where: Path, size: int) -> None:
        """Room freed: the same filesystem, files kept, now ``size`` bytes."""
        self._run("mount", "-o", f"remount,size={size}", str(where))

    @staticmethod
    def _run(*cmd: str) -> None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("disk-full test: no mount command to make a small tmpfs")
        if out.returncode:
            pytest.skip(f"disk-full test: a small tmpfs cannot be mounted here ({out.stderr.strip()}); needs root")

    def unmount_all(self) -> None:
        for where in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path):
    """:class:`SmallDisk` in this test's tmp_path; everything it mounted is unmounted after."""
    disks = SmallDisk(tmp_path)
    yield disks
    disks.unmount_all()
