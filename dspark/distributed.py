"""Joining the job's process group: the launcher's (torchrun, deepspeed, srun) or, for a plain
``python train.py``, a one-process group of its own; and keeping DeepSpeed's CPU start-up from
waiting forever on a stale JIT-build lock.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from dspark.core.ports import free_port

log = logging.getLogger(__name__)


#: A JIT build of DeepSpeed's shared-memory op takes about a minute here; a build lock older
#: than this was left by a killed build (torch's lock file records no owner to ask).
STALE_BUILD_LOCK_S = 600.0


def prepare_deepspeed_cpu_ops(
    world_size: int, *, stale_after_s: float = STALE_BUILD_LOCK_S, poll_s: float = 2.0
) -> None:
    """Keep DeepSpeed's CPU start-up from waiting forever on a build lock.

    On CPU, ``deepspeed.init_distributed`` JIT-builds its shared-memory all-reduce op under
    torch's lock file ``<torch_extensions>/<py>_cpu/deepspeed_shm_comm/lock``. A process killed
    during that build (Ctrl-C, a timeout, a preemption) leaves the file behind, and torch then
    waits on it forever, printing nothing. Here:

    * one process (``python train.py``) has nobody to talk to: the op is marked unavailable, so
      nothing is built or waited for;
    * several ranks need the op: a lock is waited for at most until it is ``stale_after_s`` old
      (no build takes that long), then removed with a warning that names it.
    """
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    if world_size <= 1:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # read by deepspeed.comm.torch.build_shm_op
        return
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(builder.name, verbose=False)) / "lock"
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after_s:
            lock.unlink(missing_ok=True)
            log.warning(
                "removed %s: a build lock %.0f s old, left by a build that was killed (no build takes %.0f s)",
                lock,
                age,
                stale_after_s,
            )
            return
        if not told:
            log.info(
                "waiting for %s (another process is building DeepSpeed's %s op); it is removed once %.0f s old",
                lock,
                builder.name,
                stale_after_s,
            )
            told = True
        time.sleep(min(poll_s, stale_after_s - age))


def init_distributed(timeout_s: float = 1800) -> tuple[int, int]:
    """Join the launcher's process group (torchrun/deepspeed/srun set RANK etc.), or create a
    one-process group for a plain ``python train.py`` on a free port, which is not exported:
    child processes must not inherit a port this process holds.

    Bounded (``train.dist_timeout_s``): joining waits at most ``timeout_s`` for every rank, then
    :class:`~dspark.core.waits.WaitTimedOut` names the rendezvous (MASTER_ADDR:MASTER_PORT,
    WORLD_SIZE, this RANK) and what to check; each collective afterwards has the same bound (a
    rank that died or hangs ends the others with torch's timeout error instead of a hang)."""
    import datetime

    import deepspeed
    import torch.distributed as dist

    from dspark.core.waits import WaitTimedOut

    prepare_deepspeed_cpu_ops(int(os.environ.get("WORLD_SIZE", "1")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:  # one process: DeepSpeed insists on LOCAL_RANK; harmless for children
        os.environ.setdefault("LOCAL_RANK", "0")  # also when a group exists already (vLLM's, of an earlier job)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            try:
                deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
                if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                    raise
                env = {k: os.environ.get(k, "?") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
                raise WaitTimedOut(
                    f"rank {env['RANK']}: the {env['WORLD_SIZE']} ranks did not all meet at {env['MASTER_ADDR']}:"
                    f"{env['MASTER_PORT']} within train.dist_timeout_s={timeout_s:g} s: "
                    "check that every rank was started (all nodes of the job), that MASTER_ADDR is reachable "
                    "from this node and MASTER_PORT free and open there, then rerun the same command"
                ) from err
        else:
            port = free_port()
            deepspeed.init_distributed(
                dist_backend=backend,
                auto_mpi_discovery=False,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return dist.get_rank(), dist.get_world_size()
