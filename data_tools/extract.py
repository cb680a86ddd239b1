"""Stage 1: on-policy answers and hidden-state capture inside vLLM, to Parquet shards.

    python -m data_tools.extract +experiment=smollm2_cpu_demo
    python -m data_tools.extract +experiment=kimi_k3_gb300 data.rank=3 data.world_size=8

One vLLM engine does both jobs in one pass: the target answers each prompt (greedy or sampled,
through its chat template) while vLLM's ``extract_hidden_states`` speculative method stores the
states of the chosen layers for prompt + answer; the hidden-states KV connector writes one
safetensors file per request, which is packed into a shard and deleted.

``data.engine=transformers`` answers the same planned requests with the target in transformers
instead (:mod:`data_tools.generate`, no vLLM) and writes token-id shards: ids and loss mask, no
states (``layer_ids: []``), for ``data.mode=colocated``. Resume, splitting and the manifest are
the same for both engines.

Resumable: a shard is written under a temporary name, renamed when complete, then recorded
in a sidecar; a rerun skips shards with a sidecar and redoes the rest. Work is split by shard
across ``data.rank``/``data.world_size`` (default: the Slurm array index and count).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
import torch
from filelock import FileLock
from omegaconf import DictConfig
from tqdm import tqdm

from data_tools.prompts import Conversation, dedupe_and_split, load_source
from data_tools.shard_writer import ShardWriter, complete_shard, finalize
from data_tools.storage import StorageEstimate, sequence_tokens, storage_estimate
from dspark.config import ConfigError, DataConfig, RunConfig, TargetConfig, load_config
from dspark.config.wandb_run import init_wandb
from dspark.core.atomic_files import foreign_listing, unwritable_cause
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.core.file_reads import file_sha256, text_sha256
from dspark.core.layer_ids import CONVENTION, vllm_aux_layer_ids
from dspark.formats.shard_format import SPLITS, DatasetError, Manifest, scale_granularity_of, shard_name
from dspark.formats.shard_rows import encode_hidden_states
from dspark.serving.vllm_engine import generate, run_headless_workers
from dspark.target import read_config, resolve_target

log = logging.getLogger(__name__)

MIN_ANSWER_TOKENS = 8
ESTIMATE_SAMPLE = 64
"""Prompts tokenized for the storage estimate (the mean length is what it needs)."""


@dataclass
class Request:
    """One sequence to capture. ``answer_ids`` is None when the target writes the answer."""

    seq_id: str
    prompt_ids: list[int]
    answer_ids: Optional[list[int]]
    max_new_tokens: int


@dataclass
class Summary:
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    shards_written: int = 0
    shards_resumed: int = 0
    skipped: Counter = field(default_factory=Counter)
    raw_bytes_per_token: int = 0

    def log(self) -> None:
        bpt = self.bytes / max(self.tokens, 1)
        log.info(
            "extract: %d rows, %d tokens, %.0f bytes/token (raw floor %d, ratio %.3f), %.1f tok/s; "
            "shards written %d, already complete %d; skipped prompts: %s",
            self.rows,
            self.tokens,
            bpt,
            self.raw_bytes_per_token,
            bpt / max(self.raw_bytes_per_token, 1),
            self.tokens / max(self.seconds, 1e-9),
            self.shards_written,
            self.shards_resumed,
            dict(self.skipped) or "none",
        )


# --- prompts -> token ids --------------------------------------------------------------------


def tokenize(conv: Conversation, tokenizer: Any, *, regenerate: bool) -> tuple[list[int], Optional[list[int]]]:
    messages, answer = conv.prompt_and_answer(regenerate=regenerate)
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
    if answer is None:
        return prompt_ids, None
    full_text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError(f"chat template renders the answer of {conv.seq_id} without the generation prompt as prefix")
    return prompt_ids, tokenizer(full_text[len(prompt_text) :], add_special_tokens=False).input_ids


def plan_requests(convs: list[Conversation], tokenizer: Any, data: DataConfig) -> tuple[list[Request], Counter]:
    """Tokenise and fit each conversation to the window; overlong ones are skipped or
    truncated (``data.on_overlong``), never fatal."""
    window, max_new = data.max_seq_len, data.max_new_tokens
    requests, skipped = [], Counter()
    for conv in convs:
        try:
            prompt, answer = tokenize(conv, tokenizer, regenerate=data.regenerate)
        except ValueError as e:
            skipped[str(e).split(":")[0]] += 1
            continue
        if answer is None:  # the target answers: leave room for at least MIN_ANSWER_TOKENS
            if len(prompt) + MIN_ANSWER_TOKENS > window:
                if data.on_overlong == "skip":
                    skipped["prompt longer than window"] += 1
                    continue
                prompt = prompt[-(window - min(max_new, window // 2)) :]  # keep the end: question + generation prompt
            requests.append(Request(conv.seq_id, prompt, None, min(max_new, window - len(prompt))))
        else:
            if len(prompt) + len(answer) > window:
                if data.on_overlong == "skip" or len(prompt) + MIN_ANSWER_TOKENS > window:
                    skipped["sequence longer than window"] += 1
                    continue
                answer = answer[: window - len(prompt)]
            requests.append(Request(conv.seq_id, prompt, answer, 1))
    return requests, skipped


# --- the vLLM engine -------------------------------------------------------------------------


def engine_kwargs(
    target: TargetConfig, target_path: Path, capture_ids: list[int], data: DataConfig, work_dir: Path
) -> dict[str, Any]:
    """Arguments for ``vllm.LLM``/``EngineArgs``: the target plus hidden-state capture."""
    on_cpu = not torch.cuda.is_available()
    connector: dict[str, Any] = {
        "kv_connector": "CPUHiddenStatesConnector" if on_cpu else "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(work_dir)},
    }
    if on_cpu:  # the stock connector copies through pinned CUDA memory
        connector["kv_connector_module_path"] = "data_tools.cpu_connector"
    extra = dict(data.vllm.engine_kwargs)
    return dict(
        model=str(target_path),
        dtype=target.dtype,
        tensor_parallel_size=target.tensor_parallel_size,
        pipeline_parallel_size=target.pipeline_parallel_size,
        max_model_len=data.max_seq_len + 1,
        trust_remote_code=target.trust_remote_code,
        enforce_eager=True,
        enable_chunked_prefill=False,  # capture needs each prompt in one prefill
        seed=data.seed,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(capture_ids)}},
        },
        kv_transfer_config=connector,
        **extra,
    )


def make_engine(kwargs: dict[str, Any], data: DataConfig):
    from dspark.serving.vllm_engine import make_llm

    return make_llm(
        kwargs,
        cpu_kvcache_gib=data.vllm.cpu_kvcache_gib,
        start_timeout_s=data.vllm.start_timeout_s,
        timeout_key="data.vllm.start_timeout_s",
    )


def capture_rows(
    llm: Any,
    requests: list[Request],
    data: DataConfig,
    *,
    n_layers: int,
    hidden: int,
    rerun: str = "the complete shards are kept: rerun the same command to resume",
) -> list[dict]:
    """Run one batch through vLLM and return finished shard rows in request order; ``rerun`` is
    what an engine death's error tells the user to do."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    params = [
        SamplingParams(
            max_tokens=r.max_new_tokens,
            temperature=data.temperature,
            seed=data.seed + int(r.seq_id[:8], 16) if data.temperature > 0 else None,
            extra_args={"kv_transfer_params": {"include_output_tokens": True}},
        )
        for r in requests
    ]
    prompts = [{"prompt_token_ids": r.prompt_ids + (r.answer_ids or [])} for r in requests]
    outputs = generate(
        llm,
        prompts,
        params,
        use_tqdm=False,
        what=f"extracting {len(requests)} sequences ({requests[0].seq_id}...)",
        rerun=rerun,
    )
    rows = []
    for req, out in zip(requests, outputs):
        if req.answer_ids is None:
            ids = req.prompt_ids + list(out.outputs[0].token_ids)
            mask = [0] * len(req.prompt_ids) + [1] * (len(ids) - len(req.prompt_ids))
        else:  # the one generated token is not part of the sequence
            ids = req.prompt_ids + req.answer_ids
            mask = [0] * len(req.prompt_ids) + [1] * len(req.answer_ids)
        path = out.kv_transfer_params["hidden_states_path"]
        saved = load_hidden_states(path)
        states = saved["hidden_states"][: len(ids) - 1]  # [T-1, n_layers, H]
        if saved["token_ids"][: len(ids) - 1].tolist() != ids[:-1] or states.shape != (len(ids) - 1, n_layers, hidden):
            raise RuntimeError(
                f"vLLM returned states {tuple(states.shape)} for {req.seq_id}, expected ({len(ids) - 1}, {n_layers}, "
                f"{hidden})"
            )
        cleanup_hidden_states(path)
        rows.append(
            {
                "seq_id": req.seq_id,
                "num_tokens": len(ids),
                "input_ids": ids,
                "loss_mask": mask,
                "hidden_states": encode_hidden_states(states, data.store_dtype),
            }
        )
    return rows


# --- shards and resume -----------------------------------------------------------------------


def assign(units: list[tuple[str, int]], rank: int, world_size: int) -> list[tuple[str, int]]:
    return [u for i, u in enumerate(units) if i % world_size == rank]


def default_rank_world() -> tuple[int, int]:
    """Slurm array index/count when run as an array job, else a single worker."""
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        first = int(os.environ.get("SLURM_ARRAY_TASK_MIN", 0))
        return int(os.environ["SLURM_ARRAY_TASK_ID"]) - first, int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1))
    return 0, 1


def build_manifest(
    target: TargetConfig,
    target_path: Path,
    tokenizer: Any,
    chat_template: Optional[str],
    capture_ids: list[int],
    text_cfg: dict,
    arch: str,
    data: DataConfig,
    prompt_set: str,
) -> Manifest:
    tok_file = target_path / "tokenizer.json"
    tok_hash = file_sha256(tok_file) if tok_file.is_file() else text_sha256(str(sorted(tokenizer.get_vocab().items())))
    return Manifest(
        target=target.name,
        target_path=str(target_path),
        revision=target.revision,
        architecture=arch,
        tokenizer_sha256=tok_hash,
        chat_template_sha256=text_sha256(chat_template),
        layer_ids=capture_ids,
        layer_id_convention=CONVENTION,
        num_hidden_layers=int(text_cfg["num_hidden_layers"]),
        hidden_size=int(text_cfg["hidden_size"]),
        dtype=data.store_dtype,
        scale_granularity=scale_granularity_of(data.store_dtype),
        compression=data.compression,
        prompt_set_sha256=prompt_set,
        rows_per_shard=data.rows_per_shard,
        prompt_settings=prompt_settings(data),
    )


EXTRACTION_ENTRIES = ("manifest.json", "_work", "train", "val", "validation")
"""What an extraction writes first into its directory (the manifest, its work area, a split's
shards): a directory holding one is an earlier extraction's, to resume."""


def claim_shards_dir(out: Path) -> None:
    """Refuse ``data.shards_dir`` unless it is missing, empty or an earlier extraction's (one of
    :data:`EXTRACTION_ENTRIES`): a user's files there are never written over."""
    if not out.is_dir():
        return  # missing (created below), or a file (mkdir's own error names it)
    shown = foreign_listing(out, EXTRACTION_ENTRIES)
    if shown is None:
        return
    raise ConfigError(
        f"data.shards_dir={out}: holds {shown}, which no extraction wrote (no manifest.json); refusing to write "
        "shards into it: set data.shards_dir to a new or empty directory"
    )


def extract(cfg: RunConfig, target_dir: Optional[Path] = None) -> Summary:
    """Capture the run's prompt set into ``data.shards_dir``; ``target_dir`` is the resolved
    target (resolved here when not given). Shards already complete are skipped."""
    from transformers import AutoTokenizer

    data, target = cfg.data, cfg.target
    rank, world = (data.rank, data.world_size) if data.rank is not None else default_rank_world()
    conversations = load_source(data.source, split=data.hf_split)  # a wrong source fails here, before any work
    out = Path(data.shards_dir).expanduser()
    claim_shards_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        cause = unwritable_cause(e, out)  # a file there, no permission, a read-only filesystem
        if cause is None:
            raise
        raise ConfigError(f"data.shards_dir={data.shards_dir}: {cause}") from e
    if target_dir is None:
        target_dir = resolve_target(target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
    arch, _, _, text_cfg = read_config(target_dir)
    window = text_cfg.get("max_position_embeddings")
    if window and data.max_seq_len + 1 > int(window):  # before vLLM starts and refuses it in a traceback
        raise ConfigError(
            f"data.max_seq_len={data.max_seq_len}: expected at most {int(window) - 1}, the target's window of "
            f"{window} positions ({target_dir / 'config.json'}: max_position_embeddings) less the one token "
            "vLLM's capture generates"
        )
    tokens_only = data.engine == "transformers"  # token-id shards: no layer is captured
    capture_ids = [] if tokens_only else target.capture_layer_ids(int(text_cfg["num_hidden_layers"]))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=target.trust_remote_code)
    splits = dedupe_and_split(conversations, val_fraction=data.val_fraction, limit=data.num_prompts)
    manifest = build_manifest(
        target,
        target_dir,
        tokenizer,
        tokenizer.chat_template,
        capture_ids,
        text_cfg,
        arch,
        data,
        prompt_set_sha256(splits, data),
    )
    open_dataset_dir(out, manifest)
    log.info(estimate_storage(manifest, splits, tokenizer, data).line())
    per = data.rows_per_shard
    units = [(s, k) for s in SPLITS for k in range((len(splits[s]) + per - 1) // per)]
    mine = assign(units, rank, world)
    todo = [(split, k) for split, k in mine if complete_shard(out, split, k) is None]
    summary = Summary(
        raw_bytes_per_token=manifest.bytes_per_token,
        shards_resumed=len(mine) - len(todo),
    )
    log.info(
        "extract rank %d/%d: %d shards, %d already complete, %d to do -> %s",
        rank,
        world,
        len(mine),
        summary.shards_resumed,
        len(todo),
        out,
    )
    work = out / "_work" / f"rank{rank}"
    if tokens_only:
        from data_tools.generate import TransformersAnswers

        def start_engine() -> Any:
            return TransformersAnswers(target_dir, target, data)

    else:
        kwargs = engine_kwargs(target, target_dir, capture_ids, data, work)
        if int(kwargs.get("node_rank", 0)) > 0:  # multi-node engine: node 0 drives, we host workers
            run_headless_workers(kwargs)
            return summary

        def start_engine() -> Any:
            return VllmCapture(kwargs, data, n_layers=len(capture_ids), hidden=manifest.hidden_size)

    if todo:
        capture_shards(todo, splits, tokenizer, data, start_engine, out=out, work=work, summary=summary)
    finalize(out, units)
    summary.log()
    if todo:
        log_to_wandb(cfg, summary, rank=rank, world=world)
    return summary


def log_to_wandb(cfg: RunConfig, summary: Summary, *, rank: int, world: int) -> None:
    """This rank's extraction as a W&B run (job_type extract, in the drafter's group beside its
    train and eval runs): what it wrote and how fast."""
    run = init_wandb(cfg, Path(cfg.paths.output_dir), job_type="extract")
    if run is None:
        return
    run.summary.update(
        {
            "extract/rows": summary.rows,
            "extract/tokens": summary.tokens,
            "extract/bytes": summary.bytes,
            "extract/seconds": summary.seconds,
            "extract/tokens_per_s": summary.tokens / max(summary.seconds, 1e-9),
            "extract/shards_written": summary.shards_written,
            "extract/shards_resumed": summary.shards_resumed,
            "extract/skipped_prompts": sum(summary.skipped.values()),
            "extract/rank": rank,
            "extract/world_size": world,
        }
    )
    run.finish()


def estimate_storage(
    manifest: Manifest, splits: dict[str, list[Conversation]], tokenizer: Any, data: DataConfig
) -> StorageEstimate:
    """The run's storage bill, from the manifest's layout and the mean sequence length of the
    first ``ESTIMATE_SAMPLE`` prompts (tokenized as extraction will)."""
    convs = [c for s in SPLITS for c in splits[s]]
    lengths = []
    for conv in convs[:ESTIMATE_SAMPLE]:
        try:
            prompt, answer = tokenize(conv, tokenizer, regenerate=data.regenerate)
        except ValueError:  # counted as skipped when the shard is planned
            continue
        lengths.append(
            sequence_tokens(
                len(prompt),
                None if answer is None else len(answer),
                max_new_tokens=data.max_new_tokens,
                window=data.max_seq_len,
            )
        )
    return storage_estimate(
        dtype=manifest.dtype,
        n_layers=len(manifest.layer_ids),
        hidden=manifest.hidden_size,
        num_prompts=len(convs),
        tokens_per_prompt=sum(lengths) / max(len(lengths), 1),
    )


PROMPT_SETTINGS = (
    "source",
    "hf_split",
    "num_prompts",
    "val_fraction",
    "regenerate",
    "max_new_tokens",
    "max_seq_len",
    "temperature",
    "seed",
    "on_overlong",
)
"""The data settings that pick the prompts, split them and answer them: recorded in the
manifest so that a refused resume names the ones that changed."""


def prompt_settings(data: DataConfig) -> dict[str, Any]:
    return {f"data.{k}": getattr(data, k) for k in PROMPT_SETTINGS}


def prompt_set_sha256(splits: dict[str, list[Conversation]], data: DataConfig) -> str:
    """The ordered prompt ids per split and the generation settings: a resume with other prompts
    would assign different prompts to the same shard names."""
    ids = ",".join(f"{s}:{c.seq_id}" for s in SPLITS for c in splits[s])
    return text_sha256(
        f"{ids}|{data.regenerate}|{data.max_new_tokens}|{data.max_seq_len}|{data.temperature}|"
        f"{data.seed}|{data.on_overlong}"
    )


def open_dataset_dir(out: Path, manifest: Manifest) -> None:
    """Start ``out`` with this manifest, or check a resumed directory was made the same way
    (refused with the settings that differ and what to do; nothing in it is touched)."""
    with FileLock(str(out / ".manifest.lock")):
        if (out / "manifest.json").is_file():
            diffs = manifest.header_differences(Manifest.load(out))
            if diffs:
                raise DatasetError(
                    f"{out}: refusing to resume into a dataset made differently: {'; '.join(diffs)}. To extract "
                    f"with this run's settings, pass data.shards_dir=<a new directory>, or delete {out} first"
                )
        else:
            manifest.save(out)


class VllmCapture:
    """``data.engine=vllm``: the engine that answers and captures (:func:`capture_rows`)."""

    def __init__(self, kwargs: dict[str, Any], data: DataConfig, *, n_layers: int, hidden: int):
        self.llm, self.data, self.n_layers, self.hidden = make_engine(kwargs, data), data, n_layers, hidden

    def rows(self, requests: list[Request]) -> list[dict]:
        return capture_rows(self.llm, requests, self.data, n_layers=self.n_layers, hidden=self.hidden)

    def close(self) -> None:
        del self.llm  # shuts the engine down before later stages run in this process


def capture_shards(
    todo: list[tuple[str, int]],
    splits: dict[str, list[Conversation]],
    tokenizer: Any,
    data: DataConfig,
    start_engine: Callable[[], Any],
    *,
    out: Path,
    work: Path,
    summary: Summary,
) -> None:
    """Start one engine (``start_engine()``: rows of requests, then ``close``) and write this
    rank's missing shards, one batch of sequences at a time."""
    per = data.rows_per_shard
    shutil.rmtree(work, ignore_errors=True)  # request files of a killed run
    for split, k in todo:  # partial files of this rank's shards from a killed run (not other ranks')
        for stale in (out / split).glob(f".{shard_name(k)}.parquet.tmp-*"):
            stale.unlink()
    engine = start_engine()
    t0 = time.perf_counter()
    bar = tqdm(
        total=sum(len(splits[s][k * per : (k + 1) * per]) for s, k in todo),
        unit="seq",
        desc="extract",
        dynamic_ncols=True,
    )
    for split, k in todo:
        requests, skipped = plan_requests(splits[split][k * per : (k + 1) * per], tokenizer, data)
        bar.update(sum(skipped.values()))
        writer = ShardWriter(out, split, k, data.compression)
        for b in range(0, len(requests), data.batch_size):
            writer.write(engine.rows(requests[b : b + data.batch_size]))
            bar.update(len(requests[b : b + data.batch_size]))
            bar.set_postfix(
                tok_s=f"{(summary.tokens + writer.tokens) / (time.perf_counter() - t0):.0f}", shard=f"{split}/{k}"
            )
        info = writer.finish(skipped)
        summary.rows += info.rows
        summary.tokens += info.tokens
        summary.bytes += info.bytes
        summary.skipped.update(skipped)
        summary.shards_written += 1
        summary.seconds = time.perf_counter() - t0
    bar.close()
    engine.close()
    del engine
    gc.collect()
    shutil.rmtree(work, ignore_errors=True)
    if work.parent.is_dir() and not any(work.parent.iterdir()):
        work.parent.rmdir()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    task_started()
    with exit_on_user_error():  # error: <message> and exit status 2, no traceback
        extract(load_config(cfg))


if __name__ == "__main__":
    run_hydra_command(main)
