"""DeepSpeed's CPU start-up never waits forever on a build lock left by a killed build (issue #17)."""

import logging
import os
import time
from pathlib import Path

import deepspeed.ops
import pytest
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory

from dspark.distributed import prepare_deepspeed_cpu_ops

SHM = get_accelerator().create_op_builder("ShareMemCommBuilder")


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    saved = dict(deepspeed.ops.__compatible_ops__)
    lock = Path(_get_build_directory(SHM.name, verbose=False)) / "lock"
    assert lock.is_relative_to(tmp_path)
    yield lock
    deepspeed.ops.__compatible_ops__.clear()
    deepspeed.ops.__compatible_ops__.update(saved)


def test_one_process_neither_builds_nor_waits(ext_dir):
    from deepspeed.comm.torch import build_shm_op

    ext_dir.touch()  # a lock that would make torch wait forever
    prepare_deepspeed_cpu_ops(world_size=1)
    t0 = time.monotonic()
    assert build_shm_op() is None
    assert time.monotonic() - t0 < 5
    assert ext_dir.exists()  # not ours to remove: this process never took it


def test_several_ranks_remove_a_lock_older_than_any_build(ext_dir, caplog):
    ext_dir.touch()
    old = time.time() - 3600
    os.utime(ext_dir, (old, old))
    with caplog.at_level(logging.WARNING, logger="dspark.distributed"):
        prepare_deepspeed_cpu_ops(world_size=2)
    assert not ext_dir.exists()
    assert f"removed {ext_dir}: a build lock 3600 s old" in caplog.text
    assert deepspeed.ops.__compatible_ops__[SHM.NAME] is True  # the ranks still get the op


def test_several_ranks_wait_for_a_live_build_then_give_up_at_the_bound(ext_dir, caplog):
    ext_dir.touch()
    with caplog.at_level(logging.INFO, logger="dspark.distributed"):
        t0 = time.monotonic()
        prepare_deepspeed_cpu_ops(world_size=2, stale_after_s=1.0, poll_s=0.1)
        waited = time.monotonic() - t0
    assert 0.8 <= waited < 5 and not ext_dir.exists()
    assert f"waiting for {ext_dir}" in caplog.text and "removed" in caplog.text


def test_several_ranks_go_on_when_the_build_finishes(ext_dir):
    import threading

    ext_dir.touch()
    threading.Timer(0.3, ext_dir.unlink).start()  # the other process's build ends
    t0 = time.monotonic()
    prepare_deepspeed_cpu_ops(world_size=2, stale_after_s=60.0, poll_s=0.05)
    assert time.monotonic() - t0 < 5
