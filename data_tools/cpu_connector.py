"""vLLM's ``ExampleHiddenStatesConnector`` for CPU workers.

The stock connector copies the captured states to pinned host memory on a CUDA stream, which
fails on CPU (``pin_memory=True requires a CUDA ...``). This subclass overrides only that copy:
it slices the states out of the cache and writes the per-request safetensors file
synchronously, then releases the file lock the client waits on. Loaded by vLLM through
``kv_connector_module_path="data_tools.cpu_connector"``; on GPUs the stock connector is used.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA copy event: the write below is synchronous, so it is done."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:  # type: ignore[no-untyped-def]
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # wakes the reader blocked on LOCK_SH
        # get_finished reports the request done (and its KV blocks freed) once this "event"
        # completes; without it the blocks would be held forever.
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
