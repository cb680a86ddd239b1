"""Acceptance and wall clock as llama.cpp serves them, on CPU: ``llama-server`` with the target's
GGUF and one method of :data:`~dspark.serving.methods.LLAMA_CPP_METHODS` (none, its n-gram proposer,
our drafter as ``draft-dspark`` with its Markov head, the Markov-off/fill-in export as
``draft-dflash``, the chain n-gram then dspark), the eval's prompts one at a time (batch size 1).

Every method is counted as the vLLM rows are (:mod:`eval.acceptance`): steps are target forwards
after the prompt (``n_decode_total`` minus the prompt's chunks, checked against
``generated - 1 - accepted``), drafts and accepted tokens from llama.cpp's own counters, read
before and after each prompt so a warm-up request is excluded. Wall clock: llama.cpp's own
decode timing per prompt (``predicted_ms``: the first token's prefill excluded), so the speedup of
a method is its decode tokens/s over ``none``'s, on the same prompts in the same eval. The draft
cost ratio r is the draft pass's own time (the proposer's logged ``dur(b,g,a)``) over the rest of
a step's time, per step.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from dspark.serving.llama_cpp.build import LlamaCpp
from dspark.serving.llama_cpp.server import (
    Server,
    complete,
    counters_after,
    llama_server,
    prompt_chunks,
    proposer_stats,
    proposer_stats_after,
    read_counters,
    server_spec,
    shared_prefix_len,
    slot_action,
    steps_problem,
)
from dspark.serving.methods import LLAMA_CPP_PREFIX, LlamaCppMethod
from dspark.serving.server_lifecycle import ServerError, choose_port
from eval.acceptance import AcceptanceCounts

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class LlamaCppServing:
    """What every llama.cpp row of one eval is served from."""

    tree: LlamaCpp
    target_gguf: Path
    ctx: int
    gamma: int
    max_new_tokens: int
    temperature: float
    seed: int
    threads: int = 0
    p_min: Optional[float] = None
    timeout_s: float = 3600
    start_timeout_s: float = 600


@dataclass(frozen=True)
class SharedPrefill:
    """Each prompt's prefill shared by the eval's llama.cpp servers through saved slots (issue #60):
    the ``none`` server (the first row) prefills a prompt's first ``prefixes[prompt_id]`` tokens,
    saves that slot and completes the prompt from it; every other server erases its slot, restores
    the file and processes only the rest, which :func:`shared_prefix_len` makes long enough for the
    drafter's window and aligned with a whole prefill's micro-batches: the same outputs and counts
    as a whole prefill (``tests/eval/test_llama_cpp.py``). A missing or unreadable slot file: that
    prompt is prefilled whole, as without sharing."""

    slot_dir: Path
    prefixes: dict[str, int]
    source: str
    """What the saved caches are of (the target GGUF and cache type), in every file's name, so a slot
    of another target is never restored."""

    @classmethod
    def of(cls, slot_dir: Path, target_gguf: Path, prompts: list, drafts: list[Path]) -> Optional[SharedPrefill]:
        """Sharing for these rows, or None when nothing can be shared (a drafter that attends to the
        whole context needs the whole prompt processed in its own server)."""
        from dspark.export.gguf import gguf_fields

        windows = []
        for d in drafts:  # the sliding window as llama.cpp reads it from the drafter GGUF
            fields = gguf_fields(d)
            windows.append(fields.get(f"{fields.get('general.architecture')}.attention.sliding_window"))
        if any(w is None for w in windows):
            log.info("llama.cpp rows: a drafter attends to the whole context; every row prefills every prompt")
            return None
        window = max(windows, default=0)
        prefixes = {p.prompt_id: shared_prefix_len(len(p.prompt_token_ids), window) for p in prompts}
        if not any(prefixes.values()):
            return None
        st = target_gguf.stat()
        return cls(slot_dir, prefixes, f"{target_gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}")

    def filename(self, ids: list[int], n: int) -> str:
        h = hashlib.sha256(self.source.encode())
        h.update(array("q", ids[:n]).tobytes())
        return f"prefix-{n}-{h.hexdigest()[:20]}.bin"

    def prepare(self, server: Server, prompt: Any, *, build: bool, seed: int, timeout_s: float) -> int:
        """Put the prompt's shared prefix in the server's slot (``build``: prefill it and save it;
        else restore it); the tokens the next request reuses (0: the whole prompt is processed)."""
        ids, n = list(prompt.prompt_token_ids), self.prefixes.get(prompt.prompt_id, 0)
        if n <= 0:
            return 0
        name = self.filename(ids, n)
        slot_action(server, "erase", timeout_s=timeout_s)  # the drafter's cache too
        if build:
            before = read_counters(server)
            complete(server, ids[:n], n_predict=0, temperature=0.0, seed=seed, timeout_s=timeout_s)
            counters_after(server, before, 1)  # its counters are in before the prompt's own are read
            try:
                saved = slot_action(server, "save", name, timeout_s=timeout_s).get("n_saved")
            except ServerError as e:
                log.warning(
                    "llama.cpp: could not save prompt %s's prefill (%s); later rows prefill it whole",
                    prompt.prompt_id,
                    e,
                )
                return n
            if saved != n:
                log.warning(
                    "llama.cpp: saved %s tokens of prompt %s's prefill, expected %d", saved, prompt.prompt_id, n
                )
            return n
        if not (self.slot_dir / name).is_file():
            log.info("llama.cpp: no saved prefill for prompt %s (%s); prefilled whole", prompt.prompt_id, name)
            return 0
        try:
            restored = slot_action(server, "restore", name, timeout_s=timeout_s).get("n_restored")
        except ServerError as e:
            restored = f"none ({e})"
        if restored != n:
            log.warning(
                "llama.cpp: restored %s tokens of prompt %s's prefill, expected %d; prefilled whole",
                restored,
                prompt.prompt_id,
                n,
            )
            slot_action(server, "erase", timeout_s=timeout_s)
            return 0
        return n

    def remove(self) -> None:
        """The saved slots (a few hundred MB): once every row has run."""
        shutil.rmtree(self.slot_dir, ignore_errors=True)


def serve_prompts(
    s: LlamaCppServing,
    method: LlamaCppMethod,
    draft: Optional[Path],
    prompts: list,
    log_path: Path,
    shared: Optional[SharedPrefill] = None,
) -> list[dict[str, Any]]:
    """One server for ``method``, the prompts one at a time: one record per prompt with its
    counters (``asdict(AcceptanceCounts)``), output ids, decode timing and each proposer's share.
    ``shared``: each prompt's prefill shared with the other rows (``none`` saves, the others restore)."""
    if shared is not None:
        shared.slot_dir.mkdir(parents=True, exist_ok=True)  # llama-server refuses a missing --slot-save-path
    spec = server_spec(
        s.target_gguf,
        method,
        s.gamma,
        s.ctx,
        draft_gguf=draft,
        threads=s.threads,
        p_min=s.p_min,
        seed=s.seed,
        slot_dir=shared.slot_dir if shared is not None else None,
    )
    host = "127.0.0.1"
    what = f"llama.cpp {method.name}"
    out = []
    with llama_server(
        s.tree,
        spec,
        host=host,
        port=choose_port(host, 0, setting=None),
        log_path=log_path,
        timeout_s=s.start_timeout_s,
        what=what,
        timeout_key="eval.llama_cpp_timeout_s",
    ) as server:
        warm = list(prompts[0].prompt_token_ids[-64:])
        before, stats_before = read_counters(server), proposer_stats(log_path)
        c = complete(server, warm, n_predict=WARMUP_TOKENS, temperature=0.0, seed=s.seed, timeout_s=s.timeout_s)
        # the warm-up's counters and statistics lines are in before the first prompt reads its own:
        # llama-server logs a request's statistics as its slot is released, after the response
        counters_after(server, before, len(c.tokens))
        proposer_stats_after(log_path, stats_before, method.spec_types)
        for i, p in enumerate(prompts):
            reused = 0
            if shared is not None:
                reused = shared.prepare(server, p, build=method.name == "none", seed=s.seed, timeout_s=s.timeout_s)
            before, stats_before = read_counters(server), proposer_stats(log_path)
            c = complete(
                server,
                list(p.prompt_token_ids),
                n_predict=s.max_new_tokens,
                temperature=s.temperature,
                seed=s.seed,
                timeout_s=s.timeout_s,
                cache_prompt=reused > 0,
            )
            d = counters_after(server, before, len(c.tokens))
            processed = int(c.timings.get("prompt_n", len(p.prompt_token_ids) - reused))
            steps = d.decodes - prompt_chunks(processed)
            problem = steps_problem(steps, len(c.tokens), d.accepted, s.gamma)
            if problem:
                raise RuntimeError(f"{what}, prompt {p.prompt_id}: {problem}; its log: {log_path}")
            per_pos = (d.accepted_per_pos + [0] * s.gamma)[: s.gamma]
            counts = AcceptanceCounts(s.gamma, d.drafts, d.draft_tokens, d.accepted, per_pos, steps)
            stats = proposer_stats_after(log_path, stats_before, method.spec_types)
            out.append(
                {
                    "prompt_id": p.prompt_id,
                    "bin": p.bin,
                    **asdict(counts),
                    "output_ids": c.tokens,
                    "decode_tokens": max(int(c.timings.get("predicted_n", 0)) - 1, 0),
                    "decode_ms": float(c.timings.get("predicted_ms", 0.0)),
                    "prompt_reused": int(c.timings.get("cache_n", 0)),
                    "draft_ms": sum(v.draft_ms for v in stats.values()),
                    "proposers": {k: asdict(v) for k, v in stats.items()},
                }
            )
            log.info(
                "%s prompt %d/%d (bin %d): %d tokens in %d steps, %d drafts, %d accepted, %.1f tok/s",
                what,
                i + 1,
                len(prompts),
                p.bin,
                len(c.tokens),
                steps,
                d.drafts,
                d.accepted,
                c.decode_tokens_per_s,
            )
    return out


def decode_tokens_per_s(per_prompt: list[dict[str, Any]]) -> float:
    """Decode tokens/s over prompts: their decode tokens over their decode seconds."""
    ms = sum(p["decode_ms"] for p in per_prompt)
    return 1e3 * sum(p["decode_tokens"] for p in per_prompt) / ms if ms else float("nan")


def draft_cost_ratio(per_prompt: list[dict[str, Any]]) -> Optional[float]:
    """r: the draft passes' time over the rest of the decode time (the target's verification and
    the drafter's intake of its states), over every step; None without drafting."""
    draft = sum(p["draft_ms"] for p in per_prompt)
    rest = sum(p["decode_ms"] for p in per_prompt) - draft
    return draft / rest if draft > 0 and rest > 0 else None


# --- the eval's llama.cpp rows -------------------------------------------------------------------


def llama_cpp_wanted(cfg: Any) -> bool:
    """``eval.llama_cpp``: auto = no GPU here (vLLM serves dspark there) and llama.cpp is built."""
    import torch

    from dspark.serving.llama_cpp.build import BUILT_MARKER, cache_dir

    use = cfg.eval.llama_cpp
    if use == "never" or not cfg.eval.llama_cpp_methods:
        return False
    if use == "always":
        return True
    if torch.cuda.is_available():
        return False
    if not (cache_dir() / BUILT_MARKER).is_file():  # built, if damaged: ensure_built builds it again
        log.info(
            "llama.cpp is not built here: no llama.cpp rows (build it once: python -m dspark.serving.llama_cpp build; "
            "or eval.llama_cpp=always)"
        )
        return False
    return True


def target_gguf_for(cfg: Any, tree: LlamaCpp, target_dir: Path) -> Path:
    """``eval.llama_cpp_target`` as a file (``auto``: :func:`dspark.export.gguf.target_gguf_type`)."""
    from dspark.export.gguf import target_gguf, target_gguf_type
    from dspark.target import cache_root, embedded_gguf_path

    embedded = embedded_gguf_path() if cfg.target.source == "embedded_smollm2" else None
    kind = target_gguf_type(cfg.eval.llama_cpp_target, embedded)
    return target_gguf(tree, target_dir, kind, cache=cache_root(), embedded=embedded)


def llama_cpp_results(cfg: Any, target_dir: Path, prompts: list, out_dir: Path, exports: dict, parts: Any) -> list[Any]:
    """The rows of ``eval.llama_cpp_methods`` (our export; its Markov-off ablation as dspark),
    each one server over the eval set; a method already measured by a killed run is kept
    (``parts``). ``none`` is measured first: every row's speedup is over it, in this eval."""
    from dspark.export.gguf import check_pair, convert_export, export_problem
    from dspark.serving.llama_cpp.build import ensure_built
    from dspark.serving.methods import LLAMA_CPP_BY_NAME
    from eval.engine_args import vllm_max_model_len
    from eval.results import DrafterResult

    e = cfg.eval
    tree = ensure_built()
    target = target_gguf_for(cfg, tree, target_dir)
    serving = LlamaCppServing(
        tree,
        target,
        ctx=vllm_max_model_len(cfg, prompts),
        gamma=e.gamma,
        max_new_tokens=e.max_new_tokens,
        temperature=e.temperature,
        seed=e.seed,
        threads=e.llama_cpp_threads,
        p_min=e.confidence_threshold,
        timeout_s=e.llama_cpp_timeout_s,
        start_timeout_s=e.llama_cpp_timeout_s,
    )
    runs: list[tuple[str, LlamaCppMethod, Optional[Path]]] = []
    methods = ["none"] + [m for m in e.llama_cpp_methods if m != "none"]
    for who, ex in exports.items():
        for name in methods if who == "ours" else ["dspark"]:
            m = LLAMA_CPP_BY_NAME[name]
            if m.layout is None:
                if who == "ours":
                    runs.append((LLAMA_CPP_PREFIX + name, m, None))
                continue
            if m.layout not in ex:
                log.info("llama.cpp %s: the %s export has no %s layout; not served", name, who, m.layout)
                continue
            problem = export_problem(ex[m.layout].out_dir)
            if problem:
                log.warning("llama.cpp %s: the %s export is not served: %s", name, who, problem)
                continue
            draft = convert_export(tree, ex[m.layout].out_dir, target_dir, e.llama_cpp_draft_type)
            label = name if who == "ours" else "markov-off"
            runs.append((LLAMA_CPP_PREFIX + label, m, draft))
    shared = None
    if e.llama_cpp_share_prefill:
        shared = SharedPrefill.of(out_dir / "llama.cpp" / "slots", target, prompts, [d for _, _, d in runs if d])
    checked: set[Path] = set()
    out: list[DrafterResult] = []
    plain: Optional[float] = None
    for name, m, draft in runs:
        if draft is not None and draft not in checked:  # a drafter that does not fit is one clear error
            check_pair(tree, target, draft, layout=m.layout or "dspark", gamma=e.gamma, log_dir=out_dir / "llama.cpp")
            checked.add(draft)

        def serve(name: str = name, m: LlamaCppMethod = m, draft: Optional[Path] = draft) -> list[DrafterResult]:
            per_prompt = serve_prompts(serving, m, draft, prompts, out_dir / "llama.cpp" / f"{name}.log", shared)
            return [_row(name, m, draft, target, per_prompt, e.gamma, tree)]

        (row,) = parts.get_or_run(name, serve)
        if m.name == "none":
            plain = row.tokens_per_s
        row.baseline_tokens_per_s = plain
        out.append(row)
    if shared is not None:
        shared.remove()
    return out


def _row(
    name: str, m: LlamaCppMethod, draft: Optional[Path], target: Path, per_prompt: list, gamma: int, tree: LlamaCpp
) -> Any:
    from eval.acceptance import AcceptanceCounts, per_bin_summary
    from eval.results import DrafterResult

    bins = [p["bin"] for p in per_prompt]
    overall, per_bin = per_bin_summary(bins, [AcceptanceCounts.from_dict(p) for p in per_prompt], gamma)
    spec = ",".join(m.spec_types) or "no speculation"
    return DrafterResult(
        name,
        "llama.cpp",
        m.name,
        overall,
        per_bin,
        draft_cost_ratio=draft_cost_ratio(per_prompt),
        tokens_per_s=decode_tokens_per_s(per_prompt),
        notes=f"llama.cpp {tree.info().get('build')} llama-server --spec-type {spec}; target {target.name}"
        + (f"; drafter {draft.name}" if draft else "")
        + "; decode phase only (llama.cpp's predicted_ms); steps from n_decode_total",
        per_prompt=per_prompt,
    )
