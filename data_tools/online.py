"""Online training's producer: a vLLM engine answers the train prompts in order, from a cursor,
and hands each finished sequence (prompt + answer + captured states) to the trainer through a
bounded buffer in memory (:class:`dspark.formats.stream.BoundedBuffer`) instead of Parquet shards.

The capture path is offline extraction's: :func:`data_tools.extract.plan_requests` fits each
prompt to the window and :func:`data_tools.extract.capture_rows` runs a batch through the engine
with the hidden-states connector. The connector's per-request files pass through
``data.online.work_dir`` (default: a directory in /dev/shm, i.e. memory) and are deleted as soon
as they are read; nothing else is written.

On one machine the engine is started in the trainer's process (vLLM runs the model in its own
engine-core process) and a background thread feeds it, ``data.batch_size`` prompts per call.
Across nodes (``data.online.trainer_addr``) this module is the producer's command; it sends to
the trainer's rank 0 over torch.distributed (:class:`dspark.formats.stream_link.StreamLink`):

    python -m data_tools.online +experiment=NAME data.mode=online data.online.trainer_addr=HOST

A multi-node engine (tensor parallel across the extraction nodes) runs as offline extraction's
does: node 0 drives it and streams, nodes 1.. host headless workers (``data.vllm.engine_kwargs``
``nnodes``/``node_rank``/``master_addr``/``master_port``; ``slurm/online.sbatch``).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig

from data_tools.extract import capture_rows, engine_kwargs, make_engine, plan_requests
from data_tools.prompts import Conversation, dedupe_and_split, load_source
from dspark.config import ConfigError, RunConfig, load_config
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.formats.stream import BlockProducer, StreamClosed, StreamMeta
from dspark.formats.stream_remote import stream_to_trainer
from dspark.serving.vllm_engine import interrupt_generate, run_headless_workers
from dspark.target import read_config, resolve_target

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


class VllmSource(BlockProducer):
    """A :class:`~dspark.formats.stream.SequenceSource` over a vLLM engine in this process: its
    producer thread answers ``data.batch_size`` prompts per engine call (this producer's blocks,
    ``data.online.producer_rank`` of ``data.online.producers``)."""

    def __init__(self, cfg: RunConfig, target_dir: Path, *, llm: Any = None):
        from transformers import AutoTokenizer

        self.data, target = cfg.data, cfg.target
        online = self.data.online
        super().__init__(
            block=self.data.batch_size,
            buffer_size=online.buffer_size,
            rank=online.producer_rank,
            producers=online.producers,
        )
        conversations = load_source(self.data.source, split=self.data.hf_split)
        self.splits = dedupe_and_split(conversations, val_fraction=self.data.val_fraction, limit=self.data.num_prompts)
        self.train_prompts: list[Conversation] = self.splits["train"]
        if not self.train_prompts:
            raise ValueError(
                f"data.source={self.data.source}: no train prompts after the split (data.num_prompts="
                f"{self.data.num_prompts}, data.val_fraction={self.data.val_fraction})"
            )
        _, _, _, text_cfg = read_config(target_dir)
        self.meta = StreamMeta(
            layer_ids=target.capture_layer_ids(int(text_cfg["num_hidden_layers"])),
            hidden_size=int(text_cfg["hidden_size"]),
            store_dtype=self.data.store_dtype,
            num_prompts=len(self.train_prompts),
            max_seq_len=self.data.max_seq_len,  # bounds every frame the trainer accepts
        )
        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=target.trust_remote_code)
        self.work = default_work_dir(cfg)
        shutil.rmtree(self.work, ignore_errors=True)  # request files of a killed run
        self.llm = (
            llm
            if llm is not None
            else make_engine(
                engine_kwargs(target, target_dir, list(self.meta.layer_ids), self.data, self.work), self.data
            )
        )
        self.skipped: Counter = Counter()
        log.info(
            "online: %d train / %d val prompts, %d per engine call, buffer %d sequences, producer %d of %d, "
            "connector files in %s",
            self.meta.num_prompts,
            len(self.splits["val"]),
            self.data.batch_size,
            online.buffer_size,
            self.rank,
            self.producers,
            self.work,
        )

    def capture(self, indexes: list[int]) -> list[tuple[int, dict]]:
        """The train prompts at these indexes (counted across passes) through the engine."""
        n = self.meta.num_prompts
        return self._capture(indexes, [self.train_prompts[i % n] for i in indexes])

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
            self.llm,
            [r for _, r in planned],
            self.data,
            n_layers=self.meta.n_layers,
            hidden=self.meta.hidden_size,
            rerun="online training stops; rerun the same command to resume from its last checkpoint",
        )
        self._stats.engine_s += time.perf_counter() - t0
        return [(i, row) for (i, _), row in zip(planned, rows)]

    def val_rows(self) -> list[dict[str, Any]]:
        """The validation split, generated once (before training starts), kept in memory."""
        val, bs = self.splits["val"], self.data.batch_size
        return [
            row for b in range(0, len(val), bs) for _, row in self._capture(list(range(b, b + bs)), val[b : b + bs])
        ]

    def close(self) -> None:
        """Stop the producer and shut the engine down. The producer is usually inside an engine
        call (``data.batch_size`` prompts, minutes at long sequences): that call is interrupted,
        not waited for, since its sequences would be thrown away (the next run starts from the
        checkpoint's cursor)."""

        def interrupt() -> None:
            if interrupt_generate(self.llm, StreamClosed("the trainer closed the stream")):
                log.info("online: interrupted the producer's engine call (the trainer is done)")

        self.stop_thread(interrupt=interrupt)
        if self.llm is not None:
            self.llm = None
            gc.collect()
        shutil.rmtree(self.work, ignore_errors=True)


# --- the producer on its own nodes ---------------------------------------------------------------


def serve(cfg: RunConfig, target_dir: Optional[Path] = None) -> int:
    """Produce for a trainer on other nodes (``data.online.trainer_addr``): the validation set
    once, then train sequences from the cursor the trainer sends, until the trainer closes the
    link (it finished, or was stopped: a rerun of both resumes from its checkpoint)."""
    online = cfg.data.online
    if not online.trainer_addr:
        raise ConfigError(
            "data.online.trainer_addr: not set, expected the host of the trainer's rank 0 for a producer on its own "
            "nodes (one machine: python train.py data.mode=online starts the engine itself)"
        )
    if target_dir is None:
        target_dir = resolve_target(cfg.target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
    if int(cfg.data.vllm.engine_kwargs.get("node_rank", 0)) > 0:  # node 0 drives the engine, we host workers
        _, _, _, text_cfg = read_config(target_dir)
        ids = cfg.target.capture_layer_ids(int(text_cfg["num_hidden_layers"]))
        run_headless_workers(engine_kwargs(cfg.target, target_dir, ids, cfg.data, default_work_dir(cfg)))
        return 0
    source = VllmSource(cfg, target_dir)
    try:
        return stream_to_trainer(source, online.trainer_addr, online.port, timeout_s=online.connect_timeout_s)
    finally:
        source.close()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    task_started()
    with exit_on_user_error():
        serve(load_config(cfg))


if __name__ == "__main__":
    run_hydra_command(main)
