"""The serving format: the directory vLLM loads as a draft model, declared once.

The layout (below) is the vLLM method; the drafter family (:mod:`dspark.families`) says which
vLLM class serves it (``architectures[0]``), the config.json that class reads and the names
its loader reads. For the default family, ``qwen3``:

* ``dspark``: ``architectures: ["Qwen3DSparkModel"]``, served by vLLM's ``dspark`` method. Both
  block layouts serve (``sample_from_anchor`` true: the anchor predicts; false: fill-in), so the
  field is always written -- vLLM's speculators path defaults it to false and the dense path to
  true, and a drafter served with the wrong one accepts almost nothing.
* ``dflash``: ``architectures: ["DFlashDraftModel"]`` with ``dflash_config``, served by vLLM's
  ``dflash`` method: the fill-in (bonus-anchor) layout without a Markov head. vLLM on CPU serves
  this one, so it checks the backbone export end to end on any machine.

The ``k3_mla`` family has the ``dspark`` layout only: ``architectures: ["K3DSparkModel"]``
(vLLM's ``K3DSparkForCausalLM``; GPU only).

Files: ``config.json`` (what vLLM reads), ``model.safetensors`` (weights without a ``model.``
prefix and without the embedding, LM head and target norm, which vLLM shares from the target),
``export.json`` (where the export came from). A reduced draft vocabulary (``draft_vocab_size`` N
below the target's V, :mod:`dspark.data.draft_vocab`) adds what vLLM's ``Qwen3DSparkForCausalLM`` and
``DFlashQwen3ForCausalLM`` then require: ``lm_head.weight`` [N, H] (the target's rows of the kept
tokens: the head cannot be shared) and ``d2t`` [N] int64 offsets (``target = draft + d2t[draft]``);
``markov_head.markov_w2`` is [N, r]. With N = V the map is the identity and the export is the full
vocabulary's. Layer ids go through :mod:`dspark.core.layer_ids`
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

from dspark.checkpoint_tags import CheckpointError
from dspark.checkpoint_weights import DRAFT_MAP, SHARED_FROM_TARGET, TrainingCheckpoint, check_weights
from dspark.config import DSparkConfig
from dspark.core.file_reads import read_json
from dspark.core.layer_ids import CONVENTION, from_vllm_draft_target_layer_ids, vllm_draft_target_layer_ids
from dspark.data.draft_vocab import target_ids
from dspark.families import family_of_architecture, get_family, served_architectures
from dspark.families.base import (
    confidence_zero_columns,
    missing_served_fields,
    served_window,
    without_zero_markov_head,
    zero_markov_head,
)
from dspark.model import DrafterDims
from dspark.serving.layouts import layout_named
from dspark.serving.methods import LAYOUTS

log = logging.getLogger(__name__)

WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE = "model.safetensors", "config.json", "export.json"
EXPORT_FORMAT_VERSION = 1


class ExportError(CheckpointError):
    """An export directory that cannot be written or served; the message says which file,
    field or tensor, and what was expected."""


def architecture(cfg: DSparkConfig, layout: str) -> str:
    """``architectures[0]`` of this drafter's config.json in ``layout`` (its family's vLLM class)."""
    return get_family(cfg.family).architectures[layout]


def draft_config(ckpt: TrainingCheckpoint, layout: str, target_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json for ``layout``: the drafter family's config plus the drafter fields vLLM reads,
    checked to carry the fields every DSpark-family class reads (:func:`served_fields`)."""
    family = get_family(ckpt.drafter.family)
    config = family.config_json(
        ckpt.drafter,
        ckpt.dims,
        layout,
        target_layer_ids=vllm_draft_target_layer_ids(ckpt.context_layer_ids),
        max_position_embeddings=int(target_config.get("max_position_embeddings") or 32768),
        dtype=dtype,
    )
    wrong = missing_served_fields(config, ckpt.drafter, ckpt.dims, dtype)
    if wrong:
        raise ExportError(
            f"drafter family {family.name!r} wrote a {layout} config.json without the fields every DSpark "
            f"class reads ({'; '.join(wrong)}): its config_json should include base.served_fields(...)"
        )
    return config


def layout_problem(cfg: DSparkConfig, layout: str) -> Optional[str]:
    """Why ``layout`` cannot serve this drafter (what each vLLM method can serve), or None."""
    if layout not in LAYOUTS:
        return f"layout {layout!r}: expected one of {LAYOUTS}"
    family = get_family(cfg.family)
    if layout not in family.architectures:
        return (
            f"layout {layout!r}: drafter.family={cfg.family!r} is served by vLLM's "
            + ", ".join(f"{a} (layout {x!r})" for x, a in family.architectures.items())
            + f" only; export it with --layout {next(iter(family.architectures))}"
        )
    lay = layout_named(layout)
    if cfg.sample_from_anchor and not lay.anchor_block:
        return (
            f"layout {layout!r} serves the fill-in (bonus-anchor) block only; this drafter was trained "
            "with drafter.sample_from_anchor=true. Export it with --layout dspark, or train with "
            "drafter.sample_from_anchor=false"
        )
    if cfg.markov_rank > 0 and not lay.markov_head:
        return (
            f"layout {layout!r} has no Markov head; this drafter has markov_rank={cfg.markov_rank}. "
            "Export it with --layout dspark, or train the ablation with drafter.markov_rank=0"
        )
    if cfg.markov_rank > 0 and cfg.markov_head_type != "vanilla":
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
    if cfg.enable_confidence_head and not layout_named(layout).confidence_head:
        log.info("layout %r has no confidence head: it is left out of the export", layout)


def drafter_layouts(cfg: DSparkConfig) -> list[str]:
    """The layouts this drafter can be served in (every one :func:`check_layout` accepts), in
    :data:`LAYOUTS`' order. None fits: the first layout's refusal (:class:`ExportError`)."""
    fits = [x for x in LAYOUTS if layout_problem(cfg, x) is None]
    if not fits:
        check_layout(cfg, LAYOUTS[0])
    return fits


def reduces_vocab(cfg: DSparkConfig, dims: DrafterDims) -> bool:
    """Whether the drafter drafts over fewer tokens than the target has (its export carries
    ``d2t`` and its own ``lm_head``)."""
    return cfg.draft_vocab_size is not None and cfg.draft_vocab_size < dims.vocab_size


def serving_weights(
    ckpt: TrainingCheckpoint, layout: str, dtype: torch.dtype, target_lm_head: Optional[torch.Tensor] = None
) -> dict[str, torch.Tensor]:
    """Tensors as vLLM names and expects them (the family's names). The confidence head stays
    fp32 (vLLM keeps it fp32). A reduced draft vocabulary needs ``target_lm_head`` [V, H] (the
    target's head): its kept rows are the exported ``lm_head.weight``."""
    family, lay = get_family(ckpt.drafter.family), layout_named(layout)
    out = {}
    for name, t in ckpt.weights.items():
        if not lay.confidence_head and name.startswith("confidence_head."):
            continue
        if name == DRAFT_MAP:
            continue
        keep_fp32 = name.startswith("confidence_head.")
        out[family.to_serving(name)] = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
    if reduces_vocab(ckpt.drafter, ckpt.dims):
        if target_lm_head is None:
            raise ExportError(f"{ckpt.path}: a reduced draft vocabulary's export needs the target's LM head")
        d2t = ckpt.weights[DRAFT_MAP].to(torch.int64)
        out[DRAFT_MAP] = d2t.contiguous()
        out["lm_head.weight"] = target_lm_head[target_ids(d2t)].to(dtype).contiguous()
    if lay.markov_head:
        out.update(zero_markov_head(ckpt.drafter, ckpt.dims, dtype))
    pad = confidence_zero_columns(ckpt.drafter) if lay.pads_confidence_head else 0
    if pad:
        name = family.to_serving(CONFIDENCE_WEIGHT)
        w = out[name]
        out[name] = torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1).contiguous()
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
    weights: dict[str, torch.Tensor]  # our names (the checkpoint's), fp32

    @property
    def architecture(self) -> str:
        return architecture(self.drafter, self.layout)


CONFIDENCE_WEIGHT = "confidence_head.proj.weight"  # our name

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
    try:
        family, layout = family_of_architecture(arch)
    except KeyError:
        raise ExportError(
            f"{path / CONFIG_FILE}: field 'architectures' is {config.get('architectures')}, expected one of "
            f"{served_architectures()}"
        ) from None
    if "sample_from_anchor" not in config:
        raise ExportError(f"{path / CONFIG_FILE}: field 'sample_from_anchor' missing; vLLM would pick a default layout")
    lay = layout_named(layout)
    try:
        vllm_ids = lay.layer_ids(config)
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
        if not lay.confidence_head:
            drafter = DSparkConfig(**{**prov["drafter"], "enable_confidence_head": False})
        dims = DrafterDims(**prov["dims"])
    except (TypeError, ValueError) as e:  # ConfigError too
        raise ExportError(
            f"{path / PROVENANCE_FILE}: fields 'drafter'/'dims' do not fit this code ({e}); {REEXPORT.format(dir=path)}"
        ) from None
    if drafter.family != family.name:
        raise ExportError(
            f"{path / CONFIG_FILE}: architecture {arch} is drafter family {family.name!r}, but export.json's "
            f"drafter is family {drafter.family!r}; {REEXPORT.format(dir=path)}"
        )
    if bool(config["sample_from_anchor"]) != drafter.sample_from_anchor:
        raise ExportError(
            f"{path / CONFIG_FILE}: sample_from_anchor={config['sample_from_anchor']} but the drafter was "
            f"trained with sample_from_anchor={drafter.sample_from_anchor}"
        )
    if served_window(config) != drafter.attention_window:
        raise ExportError(
            f"{path / CONFIG_FILE}: serves attention window {served_window(config)} (dflash_config.use_swa/"
            f"swa_window_size; None = full attention), but the drafter was trained with drafter.attention_window="
            f"{drafter.attention_window}; {REEXPORT.format(dir=path)}"
        )
    try:
        weights = {family.from_serving(k): v for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ExportError(f"{path / WEIGHTS_FILE}: cannot be read as safetensors ({type(e).__name__}: {e})") from e
    weights = draft_vocab_weights(weights, drafter, dims, where=path / WEIGHTS_FILE)
    if lay.markov_head:
        weights = without_zero_markov_head(weights, drafter)
    pad = confidence_zero_columns(drafter) if lay.pads_confidence_head else 0
    if pad and CONFIDENCE_WEIGHT in weights:  # served over [state; Markov embedding]: back to the state alone
        w = weights[CONFIDENCE_WEIGHT]
        if w.shape[-1] != dims.hidden_size + pad or torch.count_nonzero(w[:, dims.hidden_size :]):
            raise ExportError(
                f"{path / WEIGHTS_FILE}: tensor {family.to_serving(CONFIDENCE_WEIGHT)} has shape {list(w.shape)}; "
                f"expected [1, {dims.hidden_size} + {pad}] with zeros in its last {pad} columns (a confidence head "
                f"trained on the draft state alone); {REEXPORT.format(dir=path)}"
            )
        weights[CONFIDENCE_WEIGHT] = w[:, : dims.hidden_size].contiguous()
    check_weights(weights, drafter, dims, where=str(path / WEIGHTS_FILE))
    return ExportedDrafter(path, config, prov, layout, drafter, dims, ctx_ids, weights)


def draft_vocab_weights(
    weights: dict[str, torch.Tensor], cfg: DSparkConfig, dims: DrafterDims, *, where: Path
) -> dict[str, torch.Tensor]:
    """Served weights read back as ours: fp32, the map ``d2t`` kept int64 (the identity's zeros when
    the draft vocabulary is the target's whole one, which vLLM needs no map for), the draft's
    ``lm_head`` and speculators' ``t2d`` dropped (the target's rows at ``d2t`` and the map's mask:
    rebuilt from the target and the map). A reduced vocabulary without ``d2t`` or ``lm_head``, which
    vLLM refuses to load, is an :class:`ExportError`."""
    if reduces_vocab(cfg, dims):
        missing = [k for k in (DRAFT_MAP, "lm_head.weight") if k not in weights]
        if missing:
            raise ExportError(
                f"{where}: tensor(s) {missing} missing; a draft vocabulary of {cfg.draft_vocab_size} of the target's "
                f"{dims.vocab_size} tokens is served with its d2t map and its own lm_head"
            )
    out = {
        k: (v.float() if v.is_floating_point() else v.to(torch.int64))
        for k, v in weights.items()
        if k not in ("lm_head.weight", "t2d")
    }
    if cfg.draft_vocab_size is not None and DRAFT_MAP not in out:
        out[DRAFT_MAP] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    return out


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
        d2t=exported.weights.get(DRAFT_MAP),
    )
    problem = load_weights_problem(model, exported.weights)
    if problem:
        raise ExportError(f"{exported.path}: {problem}")
    return model.eval()


def _vocab_of(d2t: Optional[torch.Tensor]) -> str:
    if d2t is None:
        return "the full vocabulary"
    head = ", ".join(str(int(i)) for i in target_ids(d2t.cpu())[:4])
    return f"{len(d2t)} tokens (target ids {head}, ...)"


def load_weights_problem(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Optional[str]:
    """Load a drafter's trainable weights into ``model`` (the target's shared tensors stay); what
    did not fit, or None. A draft vocabulary map must be the model's own: its ``lm_head`` and
    Markov output rows were built for that map."""
    ours = getattr(model, DRAFT_MAP, None)
    theirs = weights.get(DRAFT_MAP)
    if (ours is None) != (theirs is None) or (ours is not None and not torch.equal(ours.cpu(), theirs.cpu())):
        return (
            f"weights do not fit the drafter: they draft over {_vocab_of(theirs)} (d2t), this drafter over "
            f"{_vocab_of(ours)}; expected the same draft vocabulary"
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith(SHARED_FROM_TARGET)]
    if missing or unexpected:
        return f"weights do not fit the drafter (missing {missing}, unexpected {unexpected})"
    return None
