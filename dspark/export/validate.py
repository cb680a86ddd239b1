"""Check an export with vLLM's own code, not with a copy of its rules.

1. vLLM's ``SpeculativeConfig`` parses the directory against the target's ``ModelConfig``
   (method detection, the EAGLE/DFlash config wrapping, vocab checks).
2. vLLM's ``get_eagle3_aux_layers_from_config`` says which target layers serving will capture;
   they must be the layers the drafter was trained on (:mod:`dspark.core.layer_ids`). This is the
   off-by-one check.
3. The layout vLLM will run (``sample_from_anchor`` as its speculator reads it) must be the
   trained one.
4. vLLM's model class is built on CPU and its ``load_weights`` reads our safetensors: every
   drafter parameter it owns must be written (parameters start as NaN), and the fused tensors
   it builds (the drafter family's: ``qkv_proj``/``gate_up_proj`` for Qwen3;
   ``fused_qkv_a_proj``/``gate_up_proj``/``context_kv_proj`` for K3) must equal ours.

vLLM is imported when :func:`validate` runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.core.ports import free_port
from dspark.core.target_dir import read_text_config
from dspark.export.speculators_format import read_drafter_dir, verifier_dir
from dspark.export.vllm_format import ExportError
from dspark.families import get_family
from dspark.serving.layouts import ANCHOR_FIELD, layout_named
from dspark.serving.methods import BY_LAYOUT

SHARED_IN_VLLM = ("model.embed_tokens.", "lm_head.", "model.mask_embedding", "draft_id_to_target_id")


@dataclass
class ValidationReport:
    export_dir: Path
    target_dir: Path
    method: str
    architecture: str
    vllm_aux_layer_ids: list[int]
    trained_layer_ids: list[int]
    sample_from_anchor: bool
    num_speculative_tokens: int
    params_checked: int
    checks: list[str] = field(default_factory=list)

    def render(self) -> str:
        head = (
            f"validated {self.export_dir} against vLLM (target {self.target_dir}): method {self.method}, "
            f"{self.architecture}, {self.params_checked} parameters loaded by vLLM's loader"
        )
        return "\n".join([head] + [f"  ok: {c}" for c in self.checks])


def _vllm_model(vllm_config: Any, cls: type) -> torch.nn.Module:
    """Build vLLM's draft model class in this process (TP=1 group on gloo)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            return cls(vllm_config=vllm_config, prefix="")


def check_target(exp: Any, target_dir: Path) -> None:
    """The export was trained for this target: width, vocabulary and depth. vLLM itself only finds
    a mismatch at the first request (or never, if the widths happen to multiply out)."""
    tcfg = read_text_config(target_dir)
    where = f"{exp.path} vs target {target_dir}"
    if int(tcfg["hidden_size"]) != exp.dims.target_hidden_size:
        raise ExportError(
            f"{where}: the drafter reads target states of width {exp.dims.target_hidden_size} "
            f"(config target_hidden_size), the target's hidden_size is {tcfg['hidden_size']}"
        )
    if int(tcfg["vocab_size"]) != exp.dims.vocab_size:
        raise ExportError(
            f"{where}: vocab_size {exp.dims.vocab_size} in the export, {tcfg['vocab_size']} in the target"
        )
    served = exp.config.get("draft_vocab_size")
    if served is not None and int(served) != (exp.drafter.draft_vocab_size or exp.dims.vocab_size):
        raise ExportError(
            f"{exp.path / 'config.json'}: draft_vocab_size {served}, the drafter drafts over "
            f"{exp.drafter.draft_vocab_size or exp.dims.vocab_size} tokens"
        )
    n = int(tcfg["num_hidden_layers"])
    if max(exp.context_layer_ids) > n:
        raise ExportError(f"{where}: context layers {exp.context_layer_ids} but the target has {n} layers")


def validate(
    export_dir: Path, *, target_dir: Optional[Path] = None, num_speculative_tokens: Optional[int] = None
) -> ValidationReport:
    """Steps 1-4 of the module docstring; the first failure raises :class:`ExportError`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    exp = read_drafter_dir(export_dir)  # our own reading (an export, or speculators' format): files, fields, shapes
    if target_dir is None:
        recorded = verifier_dir(exp)
        if not recorded:
            raise ExportError(
                f"{exp.path}: no target directory recorded (export.json 'target.path'); pass --target-dir"
            )
        target_dir, source = Path(recorded), "recorded beside the drafter"
    else:
        source = "--target-dir"
    target_dir = Path(target_dir).expanduser()
    if not (target_dir / "config.json").is_file():
        raise ExportError(
            f"{target_dir}: target directory ({source}) has no config.json, expected the target's HF directory; "
            "pass --target-dir"
        )
    check_target(exp, target_dir)
    n_spec = num_speculative_tokens or exp.drafter.block_size
    rep = ValidationReport(
        exp.path,
        target_dir,
        BY_LAYOUT[exp.layout].vllm_method,
        exp.architecture,
        [],
        exp.context_layer_ids,
        exp.drafter.sample_from_anchor,
        n_spec,
        0,
    )
    mc, pc, sc = _speculative_config(exp, target_dir, n_spec, rep)
    _check_layers_and_layout(exp, sc, n_spec, rep)
    _check_weights_in_vllm(exp, mc, pc, sc, rep)
    return rep


def _speculative_config(exp: Any, target_dir: Path, n_spec: int, rep: ValidationReport) -> tuple[Any, Any, Any]:
    """1. vLLM's own SpeculativeConfig parses the export against the target."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    dtype = exp.config.get("torch_dtype") or exp.config.get("dtype") or "float32"
    layers = exp.config.get("transformer_layer_config") or exp.config  # speculators' format nests them
    mc = ModelConfig(
        model=str(target_dir),
        dtype=dtype,
        max_model_len=min(2048, int(layers["max_position_embeddings"])),
        enforce_eager=True,
    )
    pc = ParallelConfig()
    try:
        sc = SpeculativeConfig(
            method=rep.method,
            model=str(exp.path),
            num_speculative_tokens=n_spec,
            target_model_config=mc,
            target_parallel_config=pc,
        )
    except Exception as e:  # noqa: BLE001 - pydantic/vLLM raise many types; the message is what matters
        raise ExportError(f"{exp.path}: vLLM's SpeculativeConfig rejects the export: {e}") from e
    rep.checks.append(f"vLLM SpeculativeConfig accepts it as method {sc.method!r}")
    if sc.method != rep.method:
        raise ExportError(f"{exp.path}: vLLM resolves method {sc.method!r}, expected {rep.method!r}")
    return mc, pc, sc


def _check_layers_and_layout(exp: Any, sc: Any, n_spec: int, rep: ValidationReport) -> None:
    """2-3. The target layers vLLM captures and the block layout it serves are the trained ones."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    aux = list(get_eagle3_aux_layers_from_config(sc) or [])
    rep.vllm_aux_layer_ids = aux
    if aux != exp.context_layer_ids:
        raise ExportError(
            f"{exp.path / 'config.json'}: vLLM will capture target layers {aux}, but the drafter was "
            f"trained on {exp.context_layer_ids} (off by {aux[0] - exp.context_layer_ids[0] if aux else '?'})"
        )
    rep.checks.append(f"vLLM captures target layers {aux} = the trained context layers")
    hf = sc.draft_model_config.hf_config
    lay = layout_named(exp.layout)
    if lay.config_section is None:  # what DSparkSpeculator reads
        served = bool(getattr(hf, ANCHOR_FIELD, lay.anchor_default))
    else:
        served = bool((getattr(hf, lay.config_section, None) or {}).get(ANCHOR_FIELD, lay.anchor_default))
    if served != exp.drafter.sample_from_anchor:
        raise ExportError(
            f"{exp.path / 'config.json'}: vLLM would serve sample_from_anchor={served}, the drafter was "
            f"trained with {exp.drafter.sample_from_anchor}"
        )
    rep.checks.append(f"vLLM serves the trained block layout (sample_from_anchor={served})")
    if lay.gamma_within_block and n_spec > exp.drafter.block_size:
        raise ExportError(f"num_speculative_tokens {n_spec} exceeds the trained block_size {exp.drafter.block_size}")


def _check_weights_in_vllm(exp: Any, mc: Any, pc: Any, sc: Any, rep: ValidationReport) -> None:
    """4. vLLM's model class loads every drafter parameter from the export, and its fused tensors
    equal ours."""
    from safetensors.torch import load_file
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry

    # prefix caching off from the start: vLLM's CPU platform turns it off for an MLA target after a
    # hybrid target's hook (K3's KDA layers) has sized the mamba blocks for it, and VllmConfig then
    # refuses the pair; the draft model class does not read it
    vc = VllmConfig(model_config=mc, parallel_config=pc, cache_config=CacheConfig(enable_prefix_caching=False))
    vc.speculative_config = sc  # VllmConfig refuses dspark on CPU (its runner needs Triton); the model class does not
    cls, _ = ModelRegistry.resolve_model_cls(sc.draft_model_config.hf_config.architectures, sc.draft_model_config)
    model = _vllm_model(vc, cls)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
    served_weights = load_file(str(exp.path / "model.safetensors"))
    try:
        with set_current_vllm_config(vc):
            model.load_weights(iter(served_weights.items()))
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"{exp.path / 'model.safetensors'}: vLLM's {cls.__name__}.load_weights fails: {e}") from e
    params = dict(model.named_parameters())
    unwritten = [
        n
        for n, p in params.items()
        if p.is_floating_point() and not n.startswith(SHARED_IN_VLLM) and torch.isnan(p).any()
    ]
    if unwritten:
        raise ExportError(
            f"{exp.path / 'model.safetensors'}: vLLM's {cls.__name__} has parameters the export does not "
            f"provide: {unwritten[:8]}{' ...' if len(unwritten) > 8 else ''}"
        )
    rep.params_checked = sum(1 for n in params if not n.startswith(SHARED_IN_VLLM))
    rep.checks.append(f"vLLM's loader writes all {rep.params_checked} drafter parameters of {cls.__name__}")
    if "d2t" in served_weights:
        _check_draft_vocab_in_vllm(exp, model, served_weights, cls.__name__, rep)
    _check_window_in_vllm(exp, model, cls.__name__, rep)
    family = get_family(exp.drafter.family)
    ours = {k: v.float() for k, v in served_weights.items()}
    fused = family.vllm_fused(ours, exp.drafter.num_layers)
    for name, want in fused.items():
        got = params[name].detach().float()
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            raise ExportError(f"{exp.path}: vLLM's {name} differs from the exported tensors it fuses")
    ctx = family.context_proj_param
    rep.checks.append(
        f"{len(fused)} fused tensors ({', '.join(sorted({n.split('.')[-2] for n in fused}))}) equal the exported "
        f"ones; {ctx.split('.')[-2]} reads {params[ctx].shape[1]} = {len(rep.vllm_aux_layer_ids)} layers x "
        f"{exp.dims.target_hidden_size}"
    )


def _check_window_in_vllm(exp: Any, model: torch.nn.Module, cls_name: str, rep: ValidationReport) -> None:
    """vLLM's draft layers attend as the drafter was trained: each layer's ``Attention`` built with
    ``drafter.attention_window`` as its sliding window (None: full attention) and non-causal (the
    block sees itself both ways; vLLM's backends then widen the window to W - 1 on either side)."""
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    windows = [getattr(getattr(a, "attn", None), "sliding_window", None) for a in attns]
    causal = [bool(getattr(a, "causal", False)) for a in attns]
    want = exp.drafter.attention_window
    if len(layers) != exp.drafter.num_layers or windows != [want] * len(layers):
        raise ExportError(
            f"{exp.path / 'config.json'}: vLLM's {cls_name} builds {len(layers)} layers with sliding windows "
            f"{windows}, "
            f"the drafter was trained with drafter.attention_window={want} in {exp.drafter.num_layers} layers"
        )
    if any(causal):
        raise ExportError(
            f"{exp.path / 'config.json'}: vLLM's {cls_name} would run layers {[i for i, c in enumerate(causal) if c]} "
            "causally; a DSpark block is non-causal (set is_causal false for sliding layers)"
        )
    rep.checks.append(
        f"vLLM's {len(layers)} draft layers attend "
        + (f"over a sliding window {want}, non-causal" if want else "over the full context, non-causal")
        + " = the trained attention"
    )


def _check_draft_vocab_in_vllm(
    exp: Any, model: torch.nn.Module, served: dict[str, torch.Tensor], cls_name: str, rep: ValidationReport
) -> None:
    """A reduced draft vocabulary: vLLM's own head is the exported [N, H] rows, its map the exported
    d2t, and its ``map_draft_to_target`` turns every draft id into the target id ours does."""
    lm_head, d2t = served["lm_head.weight"], served["d2t"]
    got = model.lm_head.weight.detach()[: lm_head.shape[0]]  # vLLM pads its head's rows (to a multiple of 64)
    if tuple(got.shape) != tuple(lm_head.shape) or not torch.equal(got, lm_head.to(got.dtype)):
        raise ExportError(
            f"{exp.path}: vLLM's {cls_name} lm_head starts with {list(got.shape)} other rows than the exported "
            f"{list(lm_head.shape)}"
        )
    mapped = getattr(model, "draft_id_to_target_id", None)
    if mapped is None or not torch.equal(mapped.detach().cpu(), d2t.to(torch.int64)):
        raise ExportError(f"{exp.path}: vLLM's {cls_name} did not load the exported d2t as its draft_id_to_target_id")
    draft_ids = torch.arange(len(d2t))
    served_ids = draft_ids + mapped.detach().cpu()[draft_ids]  # what map_draft_to_target / compute_logits use
    from dspark.data.draft_vocab import target_ids

    if not torch.equal(served_ids, target_ids(exp.weights["d2t"])):
        raise ExportError(f"{exp.path}: vLLM maps draft ids to other target ids than the drafter was trained with")
    rep.checks.append(
        f"draft vocabulary: vLLM's lm_head [{len(d2t)}, {lm_head.shape[1]}] and d2t are the exported ones; its draft "
        f"ids map to the trained target ids {int(served_ids[0])}..{int(served_ids[-1])} of {exp.dims.vocab_size}"
    )
