"""Starting vLLM engines, shared by extraction (stage 1) and serving in eval (stage 3).

vLLM is imported inside the functions only: importing this module costs nothing, and the
training side never needs vLLM installed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)


def make_llm(kwargs: dict[str, Any], *, cpu_kvcache_gib: int):
    """``vllm.LLM(**kwargs)``; on CPU its KV cache is ``cpu_kvcache_gib`` GiB unless
    ``VLLM_CPU_KVCACHE_SPACE`` is already set."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
    return LLM(**kwargs)


class EngineDied(RuntimeError):
    """vLLM's engine core process died under a running ``generate`` (killed, out of memory, a
    crashed worker); vLLM notices through its process monitor and fails the call."""


def generate(llm: Any, prompts: list, params: Any, *, what: str, rerun: str, **kwargs: Any) -> list:
    """``llm.generate``, with the engine's death turned into an error that says what was being
    done and what to run next, instead of vLLM's "EngineCore encountered an issue" or a hang."""
    from vllm.v1.engine.exceptions import EngineDeadError

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    done = threading.Event()
    if hasattr(client, "outputs_queue") and hasattr(getattr(client, "resources", None), "engine_dead"):
        threading.Thread(target=_wake_on_engine_death, args=(client, done), daemon=True).start()
    try:
        return llm.generate(prompts, params, **kwargs)
    except EngineDeadError as e:
        raise EngineDied(
            f"{what}: vLLM's engine core process died (killed, or out of memory: see the engine's log above); {rerun}"
        ) from e
    finally:
        done.set()


def _wake_on_engine_death(client: Any, done: threading.Event, poll_s: float = 1.0) -> None:
    """vLLM (0.32) notices a dead engine core: its monitor thread sets ``resources.engine_dead``
    and shuts the client down. But the thread that feeds ``outputs_queue`` then ends without a
    word, so a ``generate`` waiting in ``get_output`` waits forever. Hand it the error vLLM means
    to raise."""
    from vllm.v1.engine.exceptions import EngineDeadError

    while not done.wait(poll_s):
        if client.resources.engine_dead:
            client.outputs_queue.put_nowait(EngineDeadError())
            return


def run_headless_workers(kwargs: dict[str, Any]) -> None:
    """Nodes 1..n-1 of a multi-node (TP across nodes) engine: host this node's workers for the
    engine that node 0 drives, until it shuts down. Same arguments as node 0."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    vllm_config = EngineArgs(**kwargs).create_engine_config(headless=True)
    log.info(
        "node %d/%d: headless vLLM workers for head %s",
        vllm_config.parallel_config.node_rank,
        vllm_config.parallel_config.nnodes,
        vllm_config.parallel_config.master_addr,
    )
    MultiprocExecutor(vllm_config, monitor_workers=False).start_worker_monitor(inline=True)
