"""Training checkpoint -> a directory vLLM serves as a draft model (config.json + model.safetensors).

The checkpoint format on the serving side is declared here, once:

* ``dspark``: ``architectures: ["Qwen3DSparkModel"]``, served by vLLM's ``dspark`` method. Both
  block layouts serve (``sample_from_anchor`` true: the anchor predicts; false: fill-in), so the
  field is always written -- vLLM's speculators path defaults it to false and the dense path to
  true, and a drafter served with the wrong one accepts almost nothing.
* ``dflash``: ``architectures: ["DFlashDraftModel"]`` with ``dflash_config``, served by vLLM's
  ``dflash`` method: the fill-in (bonus-anchor) layout without a Markov head. vLLM on CPU serves
  this one, so it checks the backbone export end to end on any machine.

Layer ids go through :mod:`dspark.layers` (vLLM captures id+1 for each ``target_layer_ids``
entry). Weights carry no ``model.`` prefix and leave out the embedding, LM head and target norm,
which vLLM shares from the target. ``export.json`` records where the export came from.

``python -m dspark.export export CKPT --out DIR [--layout dspark|dflash]`` and
``python -m dspark.export validate DIR`` (vLLM's own config classes and weight loader).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from dspark.config import TORCH_DTYPES, DSparkConfig, TargetConfig
from dspark.layers import CONVENTION, from_vllm_draft_target_layer_ids, vllm_draft_target_layer_ids
from dspark.model import DrafterDims

log = logging.getLogger(__name__)

LAYOUTS = ("dspark", "dflash")
ARCHITECTURES = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel"}
SHARED_FROM_TARGET = ("embed_tokens.", "lm_head.", "target_norm.")  # frozen, not exported
WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE = "model.safetensors", "config.json", "export.json"
EXPORT_FORMAT_VERSION = 1


class ExportError(ValueError):
    """A checkpoint or export directory that cannot be exported/served; the message says which
    file, field or tensor, and what was expected."""


@dataclass
class TrainingCheckpoint:
    """The drafter part of one DeepSpeed checkpoint tag, in fp32."""

    path: Path  # the tag directory
    step: int
    drafter: DSparkConfig
    dims: DrafterDims
    weights: dict[str, torch.Tensor]  # trainable drafter tensors, no "drafter." prefix
    run_config: dict[str, Any]  # resolved Hydra config of the run (run.json)
    zero_stage: int

    @property
    def context_layer_ids(self) -> list[int]:
        """Target layer ids (our convention) the drafter reads as context, in fc input order."""
        tgt = self.run_config["target"]
        return [int(i) for i in (self.drafter.target_layer_ids or tgt["layer_ids"])]


def _tag_dir(path: Path) -> Path:
    """A tag directory from either the tag itself or the checkpoint root (its ``latest``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ExportError(f"{path}: no such checkpoint directory")
    if (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
        path = path / tag
        if not path.is_dir():
            raise ExportError(f"{path.parent / 'latest'} names tag {tag!r}, but {path} does not exist")
    return path


def _model_states_file(tag: Path) -> Path:
    files = sorted(tag.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise ExportError(f"{tag}: not a DeepSpeed checkpoint tag (no *mp_rank_00_model_states.pt); "
                          "pass the checkpoint directory (with 'latest') or one of its stepNNNNNNNN tags")
    return files[0]


def checkpoint_model_file(path: Path) -> Path:
    """The DeepSpeed model-states file of a checkpoint tag, or of the checkpoint directory's
    ``latest`` tag: what an export reads, so what a report that depends on it should hash."""
    return _model_states_file(_tag_dir(path))


def load_training_checkpoint(path: Path) -> TrainingCheckpoint:
    """Read the drafter weights from a DeepSpeed checkpoint (ZeRO 0-3).

    ZeRO 1-3 keep the fp32 master weights partitioned in the optimizer shards; DeepSpeed's own
    ``zero_to_fp32`` reassembles them, so an export never depends on the world size it trained on.
    """
    tag = _tag_dir(path)
    states_file = _model_states_file(tag)
    try:
        states = torch.load(states_file, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise ExportError(f"{states_file}: cannot be read as a DeepSpeed model-states file ({type(e).__name__}: {e})") from e
    for key in ("drafter", "dims", "step"):
        if key not in states:
            raise ExportError(f"{states_file}: field {key!r} missing; expected a checkpoint written by dspark.trainer")
    stage = int((states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    if stage == 0:
        raw = states["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            raw = get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name, exclude_frozen_parameters=True)
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises bare ValueError/FileNotFoundError
            raise ExportError(f"{tag}: ZeRO-{stage} shards could not be merged ({type(e).__name__}: {e})") from e
    weights = {}
    for name, t in raw.items():
        if not name.startswith("drafter."):
            raise ExportError(f"{states_file}: tensor {name!r} is not under 'drafter.'; expected a dspark.trainer checkpoint")
        name = name[len("drafter."):]
        if not name.startswith(SHARED_FROM_TARGET):
            weights[name] = t.detach().float().contiguous()
    run_file = tag / "run.json"
    if not run_file.is_file():
        raise ExportError(f"{run_file}: missing; the checkpoint's run config (target, layer ids) is needed to export")
    run_config = json.loads(run_file.read_text())["config"]
    dims = DrafterDims(**states["dims"])
    ckpt = TrainingCheckpoint(tag, int(states["step"]), DSparkConfig(**states["drafter"]), dims, weights, run_config, stage)
    check_weights(ckpt.weights, ckpt.drafter, dims, where=str(tag))
    return ckpt


def expected_shapes(cfg: DSparkConfig, dims: DrafterDims) -> dict[str, tuple[int, ...]]:
    """Every trainable tensor of the drafter and its shape (our names = vLLM's names)."""
    h, n, kv, d, i = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, dims.num_context_layers * dims.target_hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (n * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, n * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    if cfg.markov_rank > 0:
        shapes |= {"markov_head.markov_w1.weight": (dims.vocab_size, cfg.markov_rank),
                   "markov_head.markov_w2.weight": (dims.vocab_size, cfg.markov_rank)}
        if cfg.markov_head_type == "gated":
            shapes |= {"markov_head.gate.weight": (cfg.markov_rank, h), "markov_head.gate.bias": (cfg.markov_rank,)}
        elif cfg.markov_head_type == "rnn":
            shapes["markov_head.recur.weight"] = (cfg.markov_rank, cfg.markov_rank)
    if cfg.enable_confidence_head:
        width = h + (cfg.markov_rank if cfg.confidence_head_with_markov and cfg.markov_rank > 0 else 0)
        shapes |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return shapes


def check_weights(weights: dict[str, torch.Tensor], cfg: DSparkConfig, dims: DrafterDims, *, where: str) -> None:
    """Names, shapes and finiteness against the drafter config; every problem in one message."""
    want = expected_shapes(cfg, dims)
    problems = [f"missing tensor {k!r} (expected shape {list(s)})" for k, s in want.items() if k not in weights]
    problems += [f"unexpected tensor {k!r}" for k in weights if k not in want]
    problems += [f"tensor {k!r} has shape {list(weights[k].shape)}, expected {list(s)}"
                 for k, s in want.items() if k in weights and tuple(weights[k].shape) != s]
    problems += [f"tensor {k!r} has non-finite values" for k, t in weights.items()
                 if k in want and t.is_floating_point() and not torch.isfinite(t).all()]
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))


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
        return {"architectures": [ARCHITECTURES[layout]], **base,
                "dflash_config": {"target_layer_ids": vllm_ids, "mask_token_id": dims.mask_token_id,
                                  "sample_from_anchor": False}}
    return {"architectures": [ARCHITECTURES[layout]], **base,
            "target_layer_ids": vllm_ids,
            "markov_rank": max(cfg.markov_rank, 1),  # rank 0 is served as a zero rank-1 head (same logits)
            "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.enable_confidence_head and cfg.confidence_head_with_markov and cfg.markov_rank > 0}


def check_layout(cfg: DSparkConfig, layout: str) -> None:
    """What each vLLM method can serve; refuse the rest rather than serve something else."""
    if layout not in LAYOUTS:
        raise ExportError(f"layout {layout!r}: expected one of {LAYOUTS}")
    if layout == "dflash":
        if cfg.sample_from_anchor:
            raise ExportError("layout 'dflash' serves the fill-in (bonus-anchor) block only; this drafter was trained "
                              "with drafter.sample_from_anchor=true. Export it with --layout dspark, or train with "
                              "drafter.sample_from_anchor=false")
        if cfg.markov_rank > 0:
            raise ExportError(f"layout 'dflash' has no Markov head; this drafter has markov_rank={cfg.markov_rank}. "
                              "Export it with --layout dspark, or train the ablation with drafter.markov_rank=0")
        if cfg.enable_confidence_head:
            log.info("layout 'dflash' has no confidence head: it is left out of the export")
    elif cfg.markov_rank > 0 and cfg.markov_head_type != "vanilla":
        raise ExportError(f"vLLM serves the vanilla Markov head only; this drafter uses markov_head_type="
                          f"{cfg.markov_head_type!r} (evaluate it with the reference loop: eval.reference)")


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
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [
            f"exported {self.source} (step {self.step}, ZeRO-{self.zero_stage}) -> {self.out_dir}",
            f"  serve with: speculative_config={{'method': '{self.method}', 'model': '{self.out_dir}', "
            f"'num_speculative_tokens': N}}",
            f"  architecture {self.architecture}, layout {'anchor predicts (sample_from_anchor=true)' if self.sample_from_anchor else 'fill-in / bonus anchor (sample_from_anchor=false)'}",
            f"  target layers {self.context_layer_ids} ({CONVENTION}) -> config target_layer_ids {self.vllm_target_layer_ids} (vLLM captures id+1)",
            f"  Markov rank {self.markov_rank}, confidence head {'yes' if self.confidence_head else 'no'}, "
            f"{self.num_parameters / 1e6:.2f}M parameters in {self.dtype}, {self.size_bytes / 2**20:.1f} MiB",
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _target_config(ckpt: TrainingCheckpoint, target_dir: Optional[Path]) -> tuple[dict[str, Any], Path]:
    if target_dir is None:
        from omegaconf import OmegaConf

        from dspark.config import to_object
        from dspark.target import resolve_target

        spec = to_object(OmegaConf.create(ckpt.run_config["target"]), TargetConfig)
        cache = Path(ckpt.run_config.get("paths", {}).get("cache_dir", "~/.cache/dspark")).expanduser()
        target_dir = resolve_target(spec, cache_dir=cache).path
    cfg_file = Path(target_dir) / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{cfg_file}: target config missing (pass --target-dir)")
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("text_config", cfg), Path(target_dir)


def export(checkpoint: Path, out_dir: Path, *, layout: str = "dspark", dtype: Optional[str] = None,
           target_dir: Optional[Path] = None) -> ExportSummary:
    """Write ``out_dir`` (config.json, model.safetensors, export.json) from a training checkpoint."""
    ckpt = load_training_checkpoint(checkpoint)
    check_layout(ckpt.drafter, layout)
    dtype = dtype or str(ckpt.run_config.get("train", {}).get("dtype", "float32"))
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {sorted(TORCH_DTYPES)}")
    tcfg, tdir = _target_config(ckpt, target_dir)
    n_target = int(tcfg["num_hidden_layers"])
    bad = [i for i in ckpt.context_layer_ids if not 1 <= i <= n_target]
    if bad:
        raise ExportError(f"{ckpt.path}: context layer ids {bad} are outside [1, {n_target}] for target {tdir}")
    weights = serving_weights(ckpt, layout, TORCH_DTYPES[dtype])
    config = draft_config(ckpt, layout, tcfg, dtype)
    out_dir = Path(out_dir).expanduser()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    summary = ExportSummary(
        out_dir, layout, ARCHITECTURES[layout], layout, ckpt.path, ckpt.step, ckpt.zero_stage, dtype,
        sum(t.numel() for t in weights.values()), (tmp / WEIGHTS_FILE).stat().st_size, ckpt.context_layer_ids,
        config.get("target_layer_ids") or config["dflash_config"]["target_layer_ids"], ckpt.drafter.sample_from_anchor,
        ckpt.drafter.markov_rank, layout == "dspark" and ckpt.drafter.enable_confidence_head)
    if layout == "dspark" and ckpt.drafter.markov_rank == 0:
        summary.notes.append("Markov-off drafter: written as a zero rank-1 Markov head (vLLM's dspark model requires one)")
    if layout == "dflash" and ckpt.drafter.enable_confidence_head:
        summary.notes.append("confidence head left out (dflash has none)")
    provenance = {"format_version": EXPORT_FORMAT_VERSION, "layer_id_convention": CONVENTION,
                  "context_layer_ids": ckpt.context_layer_ids, "drafter": asdict(ckpt.drafter), "dims": asdict(ckpt.dims),
                  "source": str(ckpt.path), "step": ckpt.step, "zero_stage": ckpt.zero_stage, "layout": layout,
                  "dtype": dtype, "target": {"name": ckpt.run_config["target"].get("name"), "path": str(tdir)},
                  "train_dtype": ckpt.run_config.get("train", {}).get("dtype")}
    (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return summary


@dataclass
class ExportedDrafter:
    """An export read back: what the reference loop and the validator need."""

    path: Path
    config: dict[str, Any]
    provenance: dict[str, Any]
    layout: str
    drafter: DSparkConfig
    dims: DrafterDims
    context_layer_ids: list[int]  # our convention, from config.json through dspark.layers
    weights: dict[str, torch.Tensor]


def read_export(path: Path) -> ExportedDrafter:
    """Read an export directory; the layer ids come from config.json (what vLLM reads), not
    from export.json, so a reference run uses exactly what serving uses."""
    path = Path(path).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE):
        if not (path / name).is_file():
            raise ExportError(f"{path / name}: missing; expected an export written by dspark.export")
    config = json.loads((path / CONFIG_FILE).read_text())
    prov = json.loads((path / PROVENANCE_FILE).read_text())
    arch = (config.get("architectures") or [None])[0]
    layouts = {v: k for k, v in ARCHITECTURES.items()}
    if arch not in layouts:
        raise ExportError(f"{path / CONFIG_FILE}: field 'architectures' is {config.get('architectures')}, expected one of {list(layouts)}")
    layout = layouts[arch]
    if "sample_from_anchor" not in config:
        raise ExportError(f"{path / CONFIG_FILE}: field 'sample_from_anchor' missing; vLLM would pick a default layout")
    vllm_ids = config["dflash_config"]["target_layer_ids"] if layout == "dflash" else config["target_layer_ids"]
    ctx_ids = from_vllm_draft_target_layer_ids(vllm_ids)
    if ctx_ids != prov["context_layer_ids"]:
        raise ExportError(f"{path / CONFIG_FILE}: target_layer_ids {vllm_ids} name layers {ctx_ids}, but the drafter was "
                          f"trained on {prov['context_layer_ids']} ({CONVENTION}); expected {vllm_draft_target_layer_ids(prov['context_layer_ids'])}")
    drafter = DSparkConfig(**prov["drafter"])
    if layout == "dflash":
        drafter = DSparkConfig(**{**prov["drafter"], "enable_confidence_head": False})
    if bool(config["sample_from_anchor"]) != drafter.sample_from_anchor:
        raise ExportError(f"{path / CONFIG_FILE}: sample_from_anchor={config['sample_from_anchor']} but the drafter was "
                          f"trained with sample_from_anchor={drafter.sample_from_anchor}")
    dims = DrafterDims(**prov["dims"])
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

    model = DSparkDrafter(exported.drafter, exported.dims, embed_tokens=heads.embed_tokens.float(),
                          lm_head=heads.lm_head.float(), target_norm=heads.final_norm.float(),
                          target_norm_eps=heads.rms_norm_eps)
    missing, unexpected = model.load_state_dict(exported.weights, strict=False)
    missing = [m for m in missing if not m.startswith(SHARED_FROM_TARGET)]
    if missing or unexpected:
        raise ExportError(f"{exported.path}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})")
    return model.eval()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="training checkpoint -> vLLM draft-model directory")
    e.add_argument("checkpoint", type=Path, help="checkpoint dir (uses 'latest') or a stepNNNNNNNN tag")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--layout", choices=LAYOUTS, default="dspark")
    e.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None, help="default: the run's train.dtype")
    e.add_argument("--target-dir", type=Path, default=None, help="default: resolve the run's target")
    e.add_argument("--no-validate", action="store_true", help="skip the vLLM config/weight check")
    v = sub.add_parser("validate", help="check an export with vLLM's own config classes and weight loader")
    v.add_argument("export_dir", type=Path)
    v.add_argument("--target-dir", type=Path, default=None, help="default: the target recorded in export.json")
    v.add_argument("--num-speculative-tokens", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cmd == "export":
            summary = export(args.checkpoint, args.out, layout=args.layout, dtype=args.dtype, target_dir=args.target_dir)
            print(summary.render())
            if not args.no_validate:
                from dspark.export_validate import validate

                print(validate(args.out, target_dir=args.target_dir).render())
        else:
            from dspark.export_validate import validate

            print(validate(args.export_dir, target_dir=args.target_dir, num_speculative_tokens=args.num_speculative_tokens).render())
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
