"""The serving format: the directory vLLM loads as a draft model, declared once.

* ``dspark``: ``architectures: ["Qwen3DSparkModel"]``, served by vLLM's ``dspark`` method. Both
  block layouts serve (``sample_from_anchor`` true: the anchor predicts; false: fill-in), so the
  field is always written -- vLLM's speculators path defaults it to false and the dense path to
  true, and a drafter served with the wrong one accepts almost nothing.
* ``dflash``: ``architectures: ["DFlashDraftModel"]`` with ``dflash_config``, served by vLLM's
  ``dflash`` method: the fill-in (bonus-anchor) layout without a Markov head. vLLM on CPU serves
  this one, so it checks the backbone export end to end on any machine.

Files: ``config.json`` (what vLLM reads), ``model.safetensors`` (weights without a ``model.``
prefix and without the embedding, LM head and target norm, which vLLM shares from the target),
``export.json`` (where the export came from). Layer ids go through :mod:`dspark.core.layer_ids`
(vLLM captures id+1 for each ``target_layer_ids`` entry). :func:`read_export` reads an export
back for the reference loop and the validator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

from dspark.checkpoint import SHARED_FROM_TARGET, CheckpointError, TrainingCheckpoint, check_weights
from dspark.core.config import DSparkConfig
from dspark.core.files import read_json
from dspark.core.layer_ids import CONVENTION, from_vllm_draft_target_layer_ids, vllm_draft_target_layer_ids
from dspark.core.serving import BY_LAYOUT, LAYOUTS
from dspark.model import DrafterDims

log = logging.getLogger(__name__)

ARCHITECTURES = {layout: m.architecture for layout, m in BY_LAYOUT.items()}
WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE = "model.safetensors", "config.json", "export.json"
EXPORT_FORMAT_VERSION = 1


class ExportError(CheckpointError):
    """An export directory that cannot be written or served; the message says which file,
    field or tensor, and what was expected."""


def draft_config(ckpt: TrainingCheckpoint, layout: str, target_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json for ``layout``: a Qwen3 config plus the drafter fields vLLM reads."""
    cfg, dims = ckpt.drafter, ckpt.dims
    vllm_ids = vllm_draft_target_layer_ids(ckpt.context_layer_ids)
    base = {
        "model_type": "qwen3",
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": int(target_config.get("max_position_embeddings") or 32768),
        "vocab_size": dims.vocab_size,
        "draft_vocab_size": dims.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": dtype,
        "target_hidden_size": dims.target_hidden_size,
        "block_size": cfg.block_size,
        "mask_token_id": dims.mask_token_id,
        "sample_from_anchor": cfg.sample_from_anchor,
    }
    if layout == "dflash":
        return {
            "architectures": [ARCHITECTURES[layout]],
            **base,
            "dflash_config": {
                "target_layer_ids": vllm_ids,
                "mask_token_id": dims.mask_token_id,
                "sample_from_anchor": False,
            },
        }
    return {
        "architectures": [ARCHITECTURES[layout]],
        **base,
        "target_layer_ids": vllm_ids,
        "markov_rank": max(cfg.markov_rank, 1),  # rank 0 is served as a zero rank-1 head (same logits)
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.enable_confidence_head
        and cfg.confidence_head_with_markov
        and cfg.markov_rank > 0,
    }


def layout_problem(cfg: DSparkConfig, layout: str) -> Optional[str]:
    """Why ``layout`` cannot serve this drafter (what each vLLM method can serve), or None."""
    if layout not in LAYOUTS:
        return f"layout {layout!r}: expected one of {LAYOUTS}"
    if layout == "dflash":
        if cfg.sample_from_anchor:
            return (
                "layout 'dflash' serves the fill-in (bonus-anchor) block only; this drafter was trained "
                "with drafter.sample_from_anchor=true. Export it with --layout dspark, or train with "
                "drafter.sample_from_anchor=false"
            )
        if cfg.markov_rank > 0:
            return (
                f"layout 'dflash' has no Markov head; this drafter has markov_rank={cfg.markov_rank}. "
                "Export it with --layout dspark, or train the ablation with drafter.markov_rank=0"
            )
    elif cfg.markov_rank > 0 and cfg.markov_head_type != "vanilla":
        return (
            f"vLLM serves the vanilla Markov head only; this drafter uses markov_head_type="
            f"{cfg.markov_head_type!r} (evaluate it with the reference loop: eval.reference)"
        )
    return None


def check_layout(cfg: DSparkConfig, layout: str) -> None:
    """Refuse a layout that cannot serve this drafter rather than serve something else."""
    problem = layout_problem(cfg, layout)
    if problem is not None:
        raise ExportError(problem)
    if layout == "dflash" and cfg.enable_confidence_head:
        log.info("layout 'dflash' has no confidence head: it is left out of the export")


def drafter_layouts(cfg: DSparkConfig) -> list[str]:
    """The layouts this drafter can be served in (every one :func:`check_layout` accepts), in
    :data:`LAYOUTS`' order. None fits: the first layout's refusal (:class:`ExportError`)."""
    fits = [x for x in LAYOUTS if layout_problem(cfg, x) is None]
    if not fits:
        check_layout(cfg, LAYOUTS[0])
    return fits


def serving_weights(ckpt: TrainingCheckpoint, layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors as vLLM names and expects them. The confidence head stays fp32 (vLLM keeps it fp32)."""
    out = {}
    for name, t in ckpt.weights.items():
        if layout == "dflash" and name.startswith("confidence_head."):
            continue
        keep_fp32 = name.startswith("confidence_head.")
        out[name] = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
    if layout == "dspark" and ckpt.drafter.markov_rank == 0:
        v = ckpt.dims.vocab_size
        out["markov_head.markov_w1.weight"] = torch.zeros(v, 1, dtype=dtype)
        out["markov_head.markov_w2.weight"] = torch.zeros(v, 1, dtype=dtype)
    return out


@dataclass
class ExportedDrafter:
    """An export read back: what the reference loop and the validator need."""

    path: Path
    config: dict[str, Any]
    provenance: dict[str, Any]
    layout: str
    drafter: DSparkConfig
    dims: DrafterDims
    context_layer_ids: list[int]  # our convention, from config.json through dspark.core.layer_ids
    weights: dict[str, torch.Tensor]


REEXPORT = "export it again: python -m dspark.export export CHECKPOINT --out {dir}"


def _read_json_object(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """One of the export's JSON files, with the fields it must have; a damaged or foreign file
    is an :class:`ExportError` naming it."""
    data = read_json(
        path, expected=f"expected the file dspark.export writes; {REEXPORT.format(dir=path.parent)}", error=ExportError
    )
    if not isinstance(data, dict):
        raise ExportError(
            f"{path}: a JSON {type(data).__name__}, expected an object; {REEXPORT.format(dir=path.parent)}"
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise ExportError(
            f"{path}: field(s) {missing} missing, expected an export written by dspark.export; "
            f"{REEXPORT.format(dir=path.parent)}"
        )
    return data


def read_export(path: Path) -> ExportedDrafter:
    """Read an export directory; the layer ids come from config.json (what vLLM reads), not
    from export.json, so a reference run uses exactly what serving uses."""
    path = Path(path).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE):
        if not (path / name).is_file():
            raise ExportError(f"{path / name}: missing; expected an export written by dspark.export")
    config = _read_json_object(path / CONFIG_FILE, ("architectures",))
    prov = _read_json_object(path / PROVENANCE_FILE, ("context_layer_ids", "drafter", "dims"))
    arch = (config.get("architectures") or [None])[0]
    layouts = {v: k for k, v in ARCHITECTURES.items()}
    if arch not in layouts:
        raise ExportError(
            f"{path / CONFIG_FILE}: field 'architectures' is {config.get('architectures')}, expected one of "
            f"{list(layouts)}"
        )
    layout = layouts[arch]
    if "sample_from_anchor" not in config:
        raise ExportError(f"{path / CONFIG_FILE}: field 'sample_from_anchor' missing; vLLM would pick a default layout")
    try:
        vllm_ids = config["dflash_config"]["target_layer_ids"] if layout == "dflash" else config["target_layer_ids"]
    except (KeyError, TypeError):
        raise ExportError(
            f"{path / CONFIG_FILE}: field 'target_layer_ids' missing, expected the target layers the {layout} "
            f"layout reads; {REEXPORT.format(dir=path)}"
        ) from None
    ctx_ids = from_vllm_draft_target_layer_ids(vllm_ids)
    if ctx_ids != prov["context_layer_ids"]:
        raise ExportError(
            f"{path / CONFIG_FILE}: target_layer_ids {vllm_ids} name layers {ctx_ids}, but the drafter was "
            f"trained on {prov['context_layer_ids']} ({CONVENTION}); expected "
            f"{vllm_draft_target_layer_ids(prov['context_layer_ids'])}"
        )
    try:
        drafter = DSparkConfig(**prov["drafter"])
        if layout == "dflash":
            drafter = DSparkConfig(**{**prov["drafter"], "enable_confidence_head": False})
        dims = DrafterDims(**prov["dims"])
    except (TypeError, ValueError) as e:  # ConfigError too
        raise ExportError(
            f"{path / PROVENANCE_FILE}: fields 'drafter'/'dims' do not fit this code ({e}); {REEXPORT.format(dir=path)}"
        ) from None
    if bool(config["sample_from_anchor"]) != drafter.sample_from_anchor:
        raise ExportError(
            f"{path / CONFIG_FILE}: sample_from_anchor={config['sample_from_anchor']} but the drafter was "
            f"trained with sample_from_anchor={drafter.sample_from_anchor}"
        )
    try:
        weights = {k: v.float() for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ExportError(f"{path / WEIGHTS_FILE}: cannot be read as safetensors ({type(e).__name__}: {e})") from e
    if layout == "dspark" and drafter.markov_rank == 0:
        weights = {k: v for k, v in weights.items() if not k.startswith("markov_head.")}
    check_weights(weights, drafter, dims, where=str(path / WEIGHTS_FILE))
    return ExportedDrafter(path, config, prov, layout, drafter, dims, ctx_ids, weights)


def load_drafter(exported: ExportedDrafter, heads: Any) -> torch.nn.Module:
    """Our PyTorch drafter with the exported weights and the target's shared tensors."""
    from dspark.model import DSparkDrafter

    model = DSparkDrafter(
        exported.drafter,
        exported.dims,
        embed_tokens=heads.embed_tokens.float(),
        lm_head=heads.lm_head.float(),
        target_norm=heads.final_norm.float(),
        target_norm_eps=heads.rms_norm_eps,
    )
    missing, unexpected = model.load_state_dict(exported.weights, strict=False)
    missing = [m for m in missing if not m.startswith(SHARED_FROM_TARGET)]
    if missing or unexpected:
        raise ExportError(
            f"{exported.path}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})"
        )
    return model.eval()
