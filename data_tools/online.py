"""Online training's producer: a vLLM engine answers the train prompts in order, from a cursor,
and hands each finished sequence (prompt + answer + captured states) to the trainer through a
bounded buffer in memory (:class:`dspark.core.stream.BoundedBuffer`) instead of Parquet shards.

The capture path is offline extraction's: :func:`data_tools.extract.plan_requests` fits each
prompt to the window and :func:`data_tools.extract.capture_rows` runs a batch through the engine
with the hidden-states connector. The connector's per-request files pass through
``data.online.work_dir`` (default: a directory in /dev/shm, i.e. memory) and are deleted as soon
as they are read; nothing else is written.

On one machine the engine is started in the trainer's process (vLLM runs the model in its own
engine-core process) and a background thread feeds it, ``data.batch_size`` prompts per call.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from data_tools.extract import capture_rows, engine_kwargs, make_engine, plan_requests
from data_tools.prompts import Conversation, dedupe_and_split, load_source
from dspark.core.config import RunConfig
from dspark.core.stream import BoundedBuffer, StreamClosed, StreamItem, StreamStats
from dspark.core.target import read_config

log = logging.getLogger(__name__)


def default_work_dir(cfg: RunConfig) -> Path:
    """``data.online.work_dir``, else a directory in /dev/shm (memory) named after the checkpoint
    directory, so a rerun of a killed run clears what the killed one left."""
    if cfg.data.online.work_dir:
        return Path(cfg.data.online.work_dir).expanduser()
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() else Path(tempfile.gettempdir())
    key = hashlib.sha256(str(Path(cfg.train.checkpoint_dir).expanduser().resolve()).encode()).hexdigest()[:12]
    return root / f"dspark-online-{key}"


class VllmSource:
    """A :class:`~dspark.core.stream.SequenceSource` over a vLLM engine in this process."""

    def __init__(self, cfg: RunConfig, target_dir: Path, *, llm: Any = None):
        from transformers import AutoTokenizer

        self.data, target = cfg.data, cfg.target
        conversations = load_source(self.data.source, split=self.data.hf_split)
        self.splits = dedupe_and_split(conversations, val_fraction=self.data.val_fraction, limit=self.data.num_prompts)
        self.train_prompts: list[Conversation] = self.splits["train"]
        if not self.train_prompts:
            raise ValueError(
                f"data.source={self.data.source}: no train prompts after the split (data.num_prompts="
                f"{self.data.num_prompts}, data.val_fraction={self.data.val_fraction})"
            )
        self.num_prompts = len(self.train_prompts)
        _, _, _, text_cfg = read_config(target_dir)
        self.layer_ids = target.capture_layer_ids(int(text_cfg["num_hidden_layers"]))
        self.hidden_size = int(text_cfg["hidden_size"])
        self.store_dtype = self.data.store_dtype
        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=target.trust_remote_code)
        self.work = default_work_dir(cfg)
        shutil.rmtree(self.work, ignore_errors=True)  # request files of a killed run
        self.llm = (
            llm
            if llm is not None
            else make_engine(engine_kwargs(target, target_dir, self.layer_ids, self.data, self.work), self.data)
        )
        self.buffer = BoundedBuffer(self.data.online.buffer_size)
        self._stats = StreamStats()
        self.skipped: Counter = Counter()
        self._thread: Optional[threading.Thread] = None
        log.info(
            "online: %d train / %d val prompts, %d per engine call, buffer %d sequences, connector files in %s",
            self.num_prompts,
            len(self.splits["val"]),
            self.data.batch_size,
            self.data.online.buffer_size,
            self.work,
        )

    def _capture(self, indexes: list[int], convs: list[Conversation]) -> list[tuple[int, dict]]:
        """One engine call for these prompts: (index, row) for each that fits the window."""
        planned = []
        for i, conv in zip(indexes, convs):  # one by one: which index each request belongs to
            requests, skipped = plan_requests([conv], self.tokenizer, self.data)
            self.skipped.update(skipped)
            planned += [(i, r) for r in requests]
        if not planned:
            return []
        t0 = time.perf_counter()
        rows = capture_rows(
            self.llm, [r for _, r in planned], self.data, n_layers=len(self.layer_ids), hidden=self.hidden_size
        )
        self._stats.engine_s += time.perf_counter() - t0
        self._stats.sequences += len(rows)
        self._stats.tokens += sum(r["num_tokens"] for r in rows)
        return [(i, row) for (i, _), row in zip(planned, rows)]

    def val_rows(self) -> list[dict[str, Any]]:
        """The validation split, generated once (before training starts), kept in memory."""
        val, bs = self.splits["val"], self.data.batch_size
        return [
            row for b in range(0, len(val), bs) for _, row in self._capture(list(range(b, b + bs)), val[b : b + bs])
        ]

    def start(self, cursor: int) -> None:
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._produce, args=(cursor,), name="online-producer", daemon=True)
        self._thread.start()

    def _produce(self, cursor: int) -> None:
        n, bs = self.num_prompts, self.data.batch_size
        empty_run = 0  # prompts in a row that gave no sequence: a whole pass of them is an error
        try:
            while not self.buffer.closed:
                indexes = list(range(cursor, cursor + bs))
                got = self._capture(indexes, [self.train_prompts[i % n] for i in indexes])
                empty_run = 0 if got else empty_run + bs
                if empty_run >= n:
                    raise ValueError(
                        f"online: none of the {n} train prompts fits data.max_seq_len={self.data.max_seq_len} "
                        f"(skipped: {dict(self.skipped)})"
                    )
                for i, row in got:
                    self._stats.blocked_s += self.buffer.put(StreamItem(i, row))
                cursor += bs
        except StreamClosed:
            return
        except BaseException as e:  # handed to the trainer, which raises it
            log.error("online producer stopped: %s: %s", type(e).__name__, e)
            self.buffer.fail(e)

    def get(self) -> StreamItem:
        return self.buffer.get()

    def stats(self) -> StreamStats:
        return self._stats

    def close(self) -> None:
        """Stop the producer (it finishes the engine call it is in) and shut the engine down."""
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=600)
            self._thread = None
        if self.llm is not None:
            self.llm = None
            gc.collect()
        shutil.rmtree(self.work, ignore_errors=True)
