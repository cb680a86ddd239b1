"""Training checkpoint -> a directory vLLM serves as a draft model, and the command line.

    python -m dspark.export export CKPT --out DIR [--layout dspark|dflash]
    python -m dspark.export validate DIR        # vLLM's own config classes and weight loader
    python -m dspark.export export CKPT --out DIR --gguf   # + the drafter GGUF llama.cpp serves (CPU)

What is written is declared in :mod:`dspark.export.vllm_format`; what is read, in
:mod:`dspark.checkpoint_weights`; the vLLM check is :mod:`dspark.export.validate`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import save_file

from dspark.checkpoint_tags import latest_tag
from dspark.checkpoint_weights import TrainingCheckpoint, load_training_checkpoint
from dspark.config import TORCH_DTYPES, TargetConfig
from dspark.core.atomic_files import atomic_path, default_file_mode, remove_stale_temporaries, replace_problem
from dspark.core.disk_space import reporting_disk_full
from dspark.core.errors import exit_on_user_error
from dspark.core.file_reads import read_json
from dspark.core.layer_ids import CONVENTION
from dspark.core.target_dir import read_text_config
from dspark.export.gguf import GGUF_TYPES
from dspark.export.vllm_format import (
    CONFIG_FILE,
    EXPORT_FORMAT_VERSION,
    PROVENANCE_FILE,
    WEIGHTS_FILE,
    ExportError,
    architecture,
    check_layout,
    draft_config,
    reduces_vocab,
    serving_weights,
)
from dspark.families import DEFAULT_FAMILY, get_family
from dspark.families.base import serves_zero_markov_head
from dspark.serving.layouts import layout_named
from dspark.serving.methods import BY_LAYOUT, LAYOUTS

log = logging.getLogger(__name__)

EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE)
"""What an export directory holds (:func:`_write_export`): the only files a replaced export may have."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ExportSummary:
    out_dir: Path
    layout: str
    architecture: str
    method: str  # the vLLM speculative method that serves it
    source: Path
    step: int
    zero_stage: int
    dtype: str
    num_parameters: int
    size_bytes: int
    context_layer_ids: list[int]  # our convention
    vllm_target_layer_ids: list[int]  # as written in config.json
    sample_from_anchor: bool
    markov_rank: int
    confidence_head: bool
    family: str = DEFAULT_FAMILY
    cache_values_per_token: int = 0  # one layer's context cache (KV or latent), values per token
    num_layers: int = 0
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        layout = (
            "anchor predicts (sample_from_anchor=true)"
            if self.sample_from_anchor
            else "fill-in / bonus anchor (sample_from_anchor=false)"
        )
        lines = [
            f"exported {self.source} (step {self.step}, ZeRO-{self.zero_stage}) -> {self.out_dir}",
            f"  serve with: speculative_config={{'method': '{self.method}', 'model': '{self.out_dir}', "
            f"'num_speculative_tokens': N}}",
            f"  architecture {self.architecture} (drafter family {self.family}), layout {layout}",
            f"  target layers {self.context_layer_ids} ({CONVENTION}) -> config target_layer_ids "
            f"{self.vllm_target_layer_ids} (vLLM captures id+1)",
            f"  Markov rank {self.markov_rank}, confidence head {'yes' if self.confidence_head else 'no'}, "
            f"{self.num_parameters / 1e6:.2f}M parameters in {self.dtype}, {self.size_bytes / 2**20:.1f} MiB",
            f"  context cache {self.cache_values_per_token} values per token and layer "
            f"({self.cache_values_per_token * self.num_layers * _BYTES.get(self.dtype, 4) / 1024:.1f} KiB per "
            f"token over {self.num_layers} layers in {self.dtype})",
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _target_config(ckpt: TrainingCheckpoint, target_dir: Optional[Path]) -> tuple[dict[str, Any], Path]:
    if target_dir is None:
        from dspark.target import cache_root, resolve_target

        spec = TargetConfig(**ckpt.run_config["target"])
        cache = Path(ckpt.run_config.get("paths", {}).get("cache_dir") or cache_root()).expanduser()
        target_dir = resolve_target(spec, cache_dir=cache).path
    cfg_file = Path(target_dir) / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{cfg_file}: target config missing (pass --target-dir)")
    return read_text_config(Path(target_dir)), Path(target_dir)


def _target_lm_head(ckpt: TrainingCheckpoint, target_dir: Path) -> Optional[Any]:
    """The target's LM head [V, H] when the drafter's reduced vocabulary exports its own rows of it."""
    if not reduces_vocab(ckpt.drafter, ckpt.dims):
        return None
    from dspark.target import load_target_heads

    head = load_target_heads(target_dir).lm_head
    if tuple(head.shape) != (ckpt.dims.vocab_size, ckpt.dims.hidden_size):
        raise ExportError(
            f"{target_dir}: the target's LM head is {list(head.shape)}, the drafter was trained on "
            f"[{ckpt.dims.vocab_size}, {ckpt.dims.hidden_size}]; pass the run's target (--target-dir)"
        )
    return head


def export(
    checkpoint: Path | TrainingCheckpoint,
    out_dir: Path,
    *,
    layout: str = "dspark",
    dtype: Optional[str] = None,
    target_dir: Optional[Path] = None,
) -> ExportSummary:
    """Write ``out_dir`` (config.json, model.safetensors, export.json) from a training checkpoint
    (its path, or one already read: a ZeRO checkpoint is merged once for several layouts)."""
    out_dir = Path(out_dir).expanduser()
    check_out_dir(out_dir, checkpoint.path if isinstance(checkpoint, TrainingCheckpoint) else Path(checkpoint))
    ckpt = checkpoint if isinstance(checkpoint, TrainingCheckpoint) else load_training_checkpoint(checkpoint)
    check_layout(ckpt.drafter, layout)
    dtype = dtype or str(ckpt.run_config.get("train", {}).get("dtype", "float32"))
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {sorted(TORCH_DTYPES)}")
    tcfg, tdir = _target_config(ckpt, target_dir)
    n_target = int(tcfg["num_hidden_layers"])
    bad = [i for i in ckpt.context_layer_ids if not 1 <= i <= n_target]
    if bad:
        raise ExportError(f"{ckpt.path}: context layer ids {bad} are outside [1, {n_target}] for target {tdir}")
    weights = serving_weights(ckpt, layout, TORCH_DTYPES[dtype], _target_lm_head(ckpt, tdir))
    config = draft_config(ckpt, layout, tcfg, dtype)
    needed = sum(t.numel() * t.element_size() for t in weights.values())
    todo = "free space there or pass another --out, then export again"
    with reporting_disk_full(out_dir.parent, what=f"export {out_dir.name}", needed=needed, todo=todo):
        # a unique temporary directory, renamed when complete: a killed export leaves no half
        # out_dir, and concurrent exports never collide
        remove_stale_temporaries(out_dir)  # a killed export's half directory
        earlier = (out_dir / PROVENANCE_FILE).is_file()
        with atomic_path(out_dir, owner_marker=PROVENANCE_FILE, owned_files=EXPORT_FILES) as tmp:
            tmp.mkdir()
            _write_export(tmp, weights, config, ckpt, layout, dtype, tdir)
    if earlier:  # said once it happened: a refused or failed export replaces nothing
        log.warning("export: replacing the earlier export at %s: done, the new one is in its place", out_dir)
    return _summary(out_dir, ckpt, layout, dtype, sum(t.numel() for t in weights.values()), config)


def exported_layout(path: Path) -> Optional[str]:
    """The layout an export of this project at ``path`` was written in (its export.json), or None
    for a directory that is no such export (a speculators checkpoint, a DeepSpeed run)."""
    prov_file = Path(path) / PROVENANCE_FILE
    if not prov_file.is_file() or not (Path(path) / CONFIG_FILE).is_file():
        return None
    prov = read_json(prov_file, expected="an export's export.json", error=ExportError)
    if isinstance(prov, dict) and prov.get("format", "dspark") != "dspark":
        return None  # converted to another project's format (speculators'): read as a drafter directory
    layout = prov.get("layout") if isinstance(prov, dict) else None
    if layout not in LAYOUTS:
        raise ExportError(f"{prov_file}: field 'layout' is {layout!r}; expected one of {sorted(LAYOUTS)}")
    return layout


def existing_export(ckpt: TrainingCheckpoint, layout: str) -> ExportSummary:
    """The summary of the export ``ckpt`` was read from (``ckpt.path``, written in ``layout``), as
    :func:`export` would give it, with nothing written: an export is evaluated as it is."""
    from safetensors import safe_open

    out_dir = Path(ckpt.path)
    prov = json.loads((out_dir / PROVENANCE_FILE).read_text())
    config = json.loads((out_dir / CONFIG_FILE).read_text())
    with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
        count = 0
        for k in f.keys():
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            count += n
    dtype = str(prov.get("dtype", "float32"))
    return _summary(out_dir, ckpt, layout, dtype, count, config)


def check_out_dir(out_dir: Path, checkpoint: Path) -> None:
    """Refuse an ``--out`` that export may not write: the checkpoint's tag directory, any directory
    above it, anything inside the run's checkpoint directory, or a directory that holds what an
    earlier export did not write (:func:`~dspark.core.atomic_files.replace_problem`). One error each,
    before anything is written."""
    out, tag = out_dir.resolve(), Path(checkpoint).expanduser().resolve()
    if not tag.exists():
        return  # the checkpoint's own error comes first (dspark.checkpoint_weights names it)
    # the run's directory, a tag in it, or a trained drafter's own directory (export.checkpoint may name one)
    run_dir = tag if latest_tag(tag) is not None or (tag / CONFIG_FILE).is_file() else tag.parent
    if out == tag or out in tag.parents:
        raise ExportError(
            f"--out {out_dir}: it holds the checkpoint {tag} being exported; pick a directory outside the run's "
            f"checkpoints ({run_dir})"
        )
    if run_dir in out.parents:
        raise ExportError(
            f"--out {out_dir}: inside the run's checkpoint directory {run_dir}; pick a directory outside it "
            "(the run's later saves and resumes manage that directory)"
        )
    problem = replace_problem(out_dir, PROVENANCE_FILE, EXPORT_FILES)
    if problem:
        raise ExportError(f"--out {out_dir}: {problem}")


def _write_export(
    tmp: Path, weights: dict, config: dict, ckpt: TrainingCheckpoint, layout: str, dtype: str, tdir: Path
) -> None:
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    os.chmod(tmp / WEIGHTS_FILE, default_file_mode())  # safetensors goes through a 0600 tempfile
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    provenance = {
        "format_version": EXPORT_FORMAT_VERSION,
        "layer_id_convention": CONVENTION,
        "context_layer_ids": ckpt.context_layer_ids,
        "drafter": asdict(ckpt.drafter),
        "dims": asdict(ckpt.dims),
        "source": str(ckpt.path),
        "step": ckpt.step,
        "zero_stage": ckpt.zero_stage,
        "layout": layout,
        "dtype": dtype,
        "target": {"name": ckpt.run_config["target"].get("name"), "path": str(tdir)},
        "train_dtype": ckpt.run_config.get("train", {}).get("dtype"),
    }
    (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


def _summary(
    out_dir: Path, ckpt: TrainingCheckpoint, layout: str, dtype: str, num_parameters: int, config: dict
) -> ExportSummary:
    lay = layout_named(layout)
    summary = ExportSummary(
        out_dir,
        layout,
        architecture(ckpt.drafter, layout),
        BY_LAYOUT[layout].vllm_method,
        ckpt.path,
        ckpt.step,
        ckpt.zero_stage,
        dtype,
        num_parameters,
        (out_dir / WEIGHTS_FILE).stat().st_size,
        ckpt.context_layer_ids,
        lay.layer_ids(config),
        ckpt.drafter.sample_from_anchor,
        ckpt.drafter.markov_rank,
        lay.confidence_head and ckpt.drafter.enable_confidence_head,
        ckpt.drafter.family,
        get_family(ckpt.drafter.family).cache_values_per_token(ckpt.dims),
        ckpt.drafter.num_layers,
    )
    if lay.markov_head and serves_zero_markov_head(ckpt.drafter):
        summary.notes.append(
            f"Markov-off drafter: written as a zero rank-1 Markov head (vLLM's {layout} model requires one)"
        )
    if not lay.confidence_head and ckpt.drafter.enable_confidence_head:
        summary.notes.append(f"confidence head left out ({layout} has none)")
    return summary


def _export_gguf(args: argparse.Namespace) -> None:
    """``--gguf``: the drafter GGUF beside ``--out``, checked in llama.cpp unless ``--no-validate``."""
    from dspark.export.gguf import export_gguf

    prov = json.loads((Path(args.out) / PROVENANCE_FILE).read_text())
    target_dir = Path(args.target_dir or prov["target"]["path"])
    ckpt_target = TargetConfig(**load_training_checkpoint(args.checkpoint).run_config["target"])
    embedded = None
    if ckpt_target.source == "embedded_smollm2":
        from dspark.target import embedded_gguf_path

        embedded = embedded_gguf_path()
    draft, check = export_gguf(
        args.out,
        target_dir=target_dir,
        gguf_type=args.gguf_type,
        target=args.gguf_target,
        embedded=embedded,
        check=not args.no_validate,
    )
    print(f"llama.cpp drafter GGUF: {draft}")
    if check is not None:
        print(check.render())


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="training checkpoint -> vLLM draft-model directory")
    e.add_argument("checkpoint", type=Path, help="checkpoint dir (uses 'latest') or a stepNNNNNNNN tag")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--layout", choices=LAYOUTS, default="dspark")
    e.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None, help="default: the run's train.dtype")
    e.add_argument("--target-dir", type=Path, default=None, help="default: resolve the run's target")
    e.add_argument("--no-validate", action="store_true", help="skip the vLLM and llama.cpp checks")
    e.add_argument(
        "--gguf",
        action="store_true",
        help="also write the drafter GGUF llama.cpp serves (DIR.<type>.gguf, llama.cpp's own converter; llama.cpp "
        "is built once per machine if it is not) and check that llama.cpp drafts with it beside the target",
    )
    e.add_argument("--gguf-type", choices=GGUF_TYPES, default="f32", help="the drafter GGUF's weight type")
    e.add_argument(
        "--gguf-target",
        type=Path,
        default=None,
        help="the target GGUF for the llama.cpp check (default: the embedded target's own Q4_1 file, else the "
        "target directory converted at f16)",
    )
    v = sub.add_parser("validate", help="check an export with vLLM's own config classes and weight loader")
    v.add_argument("export_dir", type=Path)
    v.add_argument("--target-dir", type=Path, default=None, help="default: the target recorded in export.json")
    v.add_argument("--num-speculative-tokens", type=int, default=None)
    sp = sub.add_parser("speculators", help="an export -> speculators' DSpark format (vLLM's training library)")
    sp.add_argument("export_dir", type=Path, help="a dspark-layout export (python -m dspark.export export ...)")
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--verifier", type=Path, default=None, help="the target's directory (default: export.json's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with exit_on_user_error():  # CheckpointError (ExportError), TargetError, DiskFullError, NotWritableError: rc 2
        if args.cmd == "export":
            summary = export(
                args.checkpoint, args.out, layout=args.layout, dtype=args.dtype, target_dir=args.target_dir
            )
            print(summary.render())
            if not args.no_validate:
                from dspark.export.validate import validate

                print(validate(args.out, target_dir=args.target_dir).render())
            if args.gguf:
                _export_gguf(args)
        elif args.cmd == "speculators":
            from dspark.export.speculators_format import write_speculators

            out = write_speculators(args.export_dir, args.out, args.verifier)
            print(f"speculators: {out} (config.json for speculators' DSparkDraftModel, the same model.safetensors)")
        else:
            from dspark.export.validate import validate

            print(
                validate(
                    args.export_dir, target_dir=args.target_dir, num_speculative_tokens=args.num_speculative_tokens
                ).render()
            )
    return 0
