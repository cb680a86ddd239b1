"""Starting vLLM engines, shared by extraction (stage 1) and serving in eval (stage 3).

vLLM is imported inside the functions only: importing this module costs nothing, and the
training side never needs vLLM installed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any, Iterator, Optional

log = logging.getLogger(__name__)


#: vLLM 0.32 bounds only the last step of an engine's start: ``VLLM_ENGINE_READY_TIMEOUT_S``
#: (600 s) once the engine core has said hello. The handshake before it (the engine core loading
#: weights, workers of a multi-node engine joining) has no bound of vLLM's: ``make_llm`` adds one.
ENGINE_READY_TIMEOUT_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"


def make_llm(
    kwargs: dict[str, Any],
    *,
    cpu_kvcache_gib: int,
    start_timeout_s: Optional[float] = None,
    timeout_key: Optional[str] = None,
):
    """``vllm.LLM(**kwargs)``; on CPU its KV cache is ``cpu_kvcache_gib`` GiB unless
    ``VLLM_CPU_KVCACHE_SPACE`` is already set.

    With ``start_timeout_s`` the start is bounded: vLLM's own ready timeout is set to it (unless
    ``VLLM_ENGINE_READY_TIMEOUT_S`` is set) and, past it, the engine core and workers are killed,
    which ends vLLM's wait; :class:`~dspark.core.waits.WaitTimedOut` then names the bound (the
    caller's setting, ``timeout_key``, which a bounded start needs) and what to do. (An engine run
    inside this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, has no process to kill and is not
    bounded.)"""
    from dspark.core.waits import bounded_start

    if start_timeout_s and not timeout_key:
        raise TypeError("make_llm: a bounded start (start_timeout_s) needs the timeout_key that set the bound")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_gib))
    if start_timeout_s:
        os.environ.setdefault(ENGINE_READY_TIMEOUT_ENV, str(int(start_timeout_s)))  # read when vllm is imported
    from vllm import LLM

    return bounded_start(
        lambda: LLM(**kwargs),
        timeout_s=start_timeout_s,
        what=f"starting vLLM's engine for {kwargs.get('model')}",
        todo="see vLLM's log above for the step it was on (loading weights, compiling, a multi-node peer that "
        "never joined: check master_addr/master_port and that every node was started), then rerun; a larger "
        f"{timeout_key} if it was only slow",
    )


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
        with _noting_interrupts() as interrupted:
            return llm.generate(prompts, params, **kwargs)
    except EngineDeadError as e:
        if interrupted.is_set():  # Ctrl-C reached the engine core too, and it shut down first
            raise KeyboardInterrupt from None
        raise EngineDied(
            f"{what}: vLLM's engine core process died (killed, or out of memory: see the engine's log above); {rerun}"
        ) from e
    finally:
        done.set()


@contextlib.contextmanager
def _noting_interrupts() -> Iterator[threading.Event]:
    """Note a SIGINT (Ctrl-C) that arrives during an engine call: a terminal's Ctrl-C reaches the
    engine core's process group too, which shuts down and fails the call before this process sees
    its own KeyboardInterrupt; the call is then an interruption, not an engine death. Only the main
    thread can install the handler; elsewhere nothing is noted."""
    noted = threading.Event()
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous == signal.SIG_IGN:  # not the main thread, or Ctrl-C ignored (nohup, &)
        yield noted
        return

    def note(signum: int, frame: Any) -> None:
        noted.set()
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


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


def interrupt_generate(llm: Any, error: BaseException) -> bool:
    """Make a ``generate`` running in another thread raise ``error`` now, instead of after the
    rest of its engine call (minutes at long sequences): the error is handed to the queue its
    ``get_output`` waits on (vLLM 0.32's multiprocess client; thread-safe). The requests stay in
    the engine until it is shut down. False where the client has no such queue (an engine in this
    process), which then finishes the call."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    q = getattr(client, "outputs_queue", None)
    if q is None:
        return False
    q.put_nowait(error)
    return True


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
