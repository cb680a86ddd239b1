"""Shared fixtures. Everything runs offline on CPU in fp32."""

import hashlib
import json
import os
import shutil
import subprocess
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TINY_QWEN3 = dict(  # head_dim 32: vLLM's CPU attention takes head sizes 32, 64, 80, ... only
    vocab_size=49152,  # SmolLM2's tokenizer, saved beside the weights
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,  # more than the 5 spread layers, so the spread rule has to choose
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_QWEN3_SEED = 0


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smollm2_dir) -> Path:
    """A second architecture: a tiny Qwen3 target with random weights (Qwen3ForCausalLM, 8 layers,
    hidden 64) and SmolLM2's tokenizer and chat template, built offline once per machine under
    ``$DSPARK_CACHE/targets/tiny-qwen3-<hash of its recipe>`` (written to a temporary name,
    renamed when complete)."""
    import torch
    from filelock import FileLock
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark.core.files import atomic_path
    from dspark.core.target import cache_root

    recipe = json.dumps({"config": TINY_QWEN3, "seed": TINY_QWEN3_SEED, "tokenizer": TOKENIZER_FILES}, sort_keys=True)
    out = cache_root() / "targets" / f"tiny-qwen3-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not (out / "config.json").is_file():
            with atomic_path(out) as tmp:
                torch.manual_seed(TINY_QWEN3_SEED)
                model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).float()
                model.save_pretrained(str(tmp), safe_serialization=True)
                for name in TOKENIZER_FILES:
                    if (smollm2_dir / name).exists():
                        shutil.copy(smollm2_dir / name, tmp / name)
    return out


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
