"""What a serving benchmark serves and sends: ``serve_bench.configs`` resolved into servers (a
method by name, ``ours`` as the machine serves it, llama.cpp's methods), the exports they serve
(from the export stage's record), and the traffic file, checked line by line before any server
starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from dspark.config import RunConfig
from dspark.core.atomic_files import write_jsonl
from dspark.core.errors import UserError
from dspark.core.file_reads import not_a_file, read_jsonl
from dspark.export.stage import read_exports
from dspark.serving.methods import BY_NAME, LLAMA_CPP_PREFIX, OURS, export_method, llama_cpp_method
from eval.prompts import run_eval_set
from eval.serve_bench.server import Configuration

log = logging.getLogger(__name__)


class ServeBenchError(UserError):
    """Bad input or a drafter it cannot serve: the message names the file, key or log."""


class TrafficFileError(ServeBenchError):
    """A traffic file vLLM's custom dataset cannot read: names the file and line."""


# --- configurations ----------------------------------------------------------------------------


def resolve_configs(cfg: RunConfig, target_dir: Path, *, gpu: bool) -> list[Configuration]:
    """``serve_bench.configs`` as servers: a method by name, and ``ours`` served as
    :func:`~dspark.serving.methods.export_method` says (``dspark`` on GPUs, the ``dflash`` export on
    CPU; left out, with a log line, when the drafter has no dflash layout)."""
    out = []
    exports = ExportsOnce(cfg)
    for name in cfg.serve_bench.configs:
        if name.startswith(LLAMA_CPP_PREFIX):
            out.append(llama_cpp_configuration(cfg, target_dir, name, exports))
            continue
        if name == OURS:
            m = export_method(gpu=gpu, has_layout=lambda x: exports.get(x, required=False) is not None)
        else:
            m = BY_NAME[name]
        if m is None:
            log.info(
                "serve_bench: vLLM on CPU serves only the dflash layout and this drafter has none "
                "(sample_from_anchor or a Markov head); 'ours' is left out. On a GPU it is served as dspark."
            )
            continue
        draft = exports.get(m.layout, required=True) if m.layout is not None else None
        out.append(Configuration.serving(name, m, draft))
    return out


def llama_cpp_configuration(cfg: RunConfig, target_dir: Path, name: str, exports: ExportsOnce) -> Configuration:
    """``llama.cpp-METHOD``: llama-server with that method; a drafter's export converted to GGUF
    by llama.cpp's own converter (``eval.llama_cpp_draft_type``), as the eval serves it."""
    from dspark.export.gguf import convert_export
    from dspark.serving.llama_cpp.build import ensure_built

    m = llama_cpp_method(name)
    draft = None
    if m.layout is not None:
        export = exports.get(m.layout, required=True)
        draft = convert_export(ensure_built(), export, target_dir, cfg.eval.llama_cpp_draft_type)
    return Configuration(name, m.name if m.spec_types else None, draft, engine="llama.cpp")


def serves_exports(cfg: RunConfig) -> bool:
    """Whether ``serve_bench.configs`` serves this run's drafter (``ours``, or a method with a
    layout): the export stage then runs before this one."""
    for name in cfg.serve_bench.configs:
        m = llama_cpp_method(name) if name.startswith(LLAMA_CPP_PREFIX) else BY_NAME.get(name)
        if name == OURS or (m is not None and m.layout is not None):
            return True
    return False


class ExportsOnce:
    """This run's exports, as the export stage's record lists them (the export stage runs before
    this one): the record is read and checked once, at the first configuration that serves one."""

    def __init__(self, cfg: RunConfig) -> None:
        self._cfg = cfg
        self._ours: Optional[dict[str, Any]] = None

    def get(self, layout: str, *, required: bool) -> Optional[Path]:
        """The export in ``layout``; None when the drafter has none and ``required`` is False."""
        if self._ours is None:
            self._ours = read_exports(self._cfg).exports["ours"]
        if layout in self._ours:
            return self._ours[layout].out_dir
        if required:
            raise ServeBenchError(
                f"serve_bench.configs has {layout}, but this drafter has no {layout} export (the dflash layout "
                "needs drafter.sample_from_anchor=false and drafter.markov_rank=0); use 'ours'"
            )
        return None


# --- traffic -----------------------------------------------------------------------------------


def load_traffic(path: Path, *, need_output_tokens: bool = False) -> list[dict[str, Any]]:
    """A traffic file in vLLM's custom-dataset format, checked line by line before any server
    starts: a JSON object per line with a non-empty string ``prompt`` and, optionally (on every
    line with ``need_output_tokens``: serve_bench.output_len=null), a positive integer
    ``output_tokens``."""
    where = f"serve_bench.traffic_file={path}"
    problem = not_a_file(path)
    if problem:
        raise TrafficFileError(f'{where}: {problem}, expected JSONL with one {{"prompt": ...}} per line')
    if path.suffix != ".jsonl":
        raise TrafficFileError(f"{where}: expected a .jsonl file (vLLM's custom dataset reads JSONL only)")
    rows = []
    try:
        for n, rec in read_jsonl(path, error=TrafficFileError):
            if not isinstance(rec, dict):
                raise TrafficFileError(f'{path}:{n}: expected a JSON object with a "prompt" string, got {rec!r:.80}')
            prompt = rec.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise TrafficFileError(f'{path}:{n}: field "prompt" is {prompt!r:.80}, expected a non-empty string')
            tokens = rec.get("output_tokens")
            if "output_tokens" in rec and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
                raise TrafficFileError(f'{path}:{n}: field "output_tokens" is {tokens!r}, expected an integer >= 1')
            if need_output_tokens and "output_tokens" not in rec:
                raise TrafficFileError(
                    f'{path}:{n}: no "output_tokens", expected one on every line with serve_bench.output_len=null'
                )
            rows.append(rec)
    except UnicodeDecodeError as e:
        raise TrafficFileError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise TrafficFileError(f'{where}: no requests in it, expected one {{"prompt": ...}} per line')
    return rows


def answer_len(cfg: RunConfig) -> int:
    """Tokens per answer: serve_bench.output_len, or eval.max_new_tokens where it is null."""
    return cfg.serve_bench.output_len or cfg.eval.max_new_tokens


def eval_set_traffic(cfg: RunConfig, heads: Any, out_dir: Path) -> tuple[Path, int]:
    """The eval set (what the eval measures tau on) as a traffic file: each prompt's tokens (the
    chat template applied already) decoded to text; the longest prompt, in tokens."""
    prompts, _ = run_eval_set(cfg, heads, out_dir)
    path = out_dir / "traffic_eval_set.jsonl"
    tok = heads.tokenizer
    write_jsonl(
        path,
        [{"prompt": tok.decode(list(p.prompt_token_ids)), "output_tokens": answer_len(cfg)} for p in prompts],
    )
    return path, max(p.num_tokens for p in prompts)
