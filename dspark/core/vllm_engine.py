"""Starting vLLM engines, shared by extraction (stage 1) and serving in eval (stage 3).

vLLM is imported inside the functions only: importing this module costs nothing, and the
training side never needs vLLM installed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def make_llm(kwargs: dict[str, Any], *, cpu_kvcache_gib: int):
    """``vllm.LLM(**kwargs)``; on CPU its KV cache is ``cpu_kvcache_gib`` GiB unless
    ``VLLM_CPU_KVCACHE_SPACE`` is already set."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
    return LLM(**kwargs)


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
