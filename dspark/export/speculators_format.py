"""Our DSpark export in the format of speculators, vLLM's training library (issue #38, item 1).

speculators 0.9.0 stores a DSpark drafter (``speculators.models.dspark``) as ``config.json``
(``DSparkSpeculatorConfig``: the draft layers' Qwen3 config under ``transformer_layer_config``,
the DSpark fields at the top level, and ``speculators_config`` naming the algorithm, its greedy
proposal and the verifier) and ``model.safetensors``. Its tensor names are ours
(``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``, ``markov_head.markov_w{1,2}``,
``confidence_head.proj``): speculators' DSpark is built on the same vLLM class we export for, and
like ours it keeps the target's embedding and LM head out of the file (it reads them from the
verifier's directory). What differs is the config:

- layer ids: speculators' ``aux_hidden_state_layer_ids`` index Hugging Face ``hidden_states`` (0 is
  the embedding output), which is our ``context_layer_ids`` convention (export.json); vLLM's
  ``target_layer_ids`` in our config.json are those minus one;
- the block: ``block_size`` drafts after the anchor with ``sample_from_anchor`` (the only layout
  converted here; the fill-in layout counts its block differently on the two sides);
- ``speculators_config.verifier``: the target's directory and architectures;
- the attention window (``drafter.attention_window``): ours is ``dflash_config.use_swa`` +
  ``swa_window_size``, speculators' is ``transformer_layer_config.layer_types`` (every layer
  ``sliding_attention``) + ``sliding_window`` with ``sliding_window_non_causal`` true, plus
  ``is_causal: false`` in the layer config, without which vLLM serves a speculators DSpark's
  sliding layers causally. The edge differs in training: speculators masks a block by its anchor
  a (context ``a - W .. a - 1`` for every query), vLLM and we by each query's position p
  (``p - W < p0``), so speculators' query i sees i + 1 more keys than ours (one more at the
  block's first query); the served edge is vLLM's either way.

docs/speculators_notes.md has the full mapping, with file:line on both sides.

    python -m dspark.export speculators EXPORT_DIR --out DIR [--verifier TARGET_DIR]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import load_file

from dspark.checkpoint_weights import check_weights
from dspark.config import DSparkConfig
from dspark.core.atomic_files import atomic_path, remove_stale_temporaries, replace_problem
from dspark.core.file_reads import read_json
from dspark.export.vllm_format import CONFIG_FILE, PROVENANCE_FILE, WEIGHTS_FILE, ExportedDrafter, ExportError
from dspark.families import DEFAULT_FAMILY, DrafterDims, get_family, speculators_families
from dspark.families.base import served_window
from dspark.formats.shard_format import layer_ids_problem

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format this writes (and whose loader the tests run, when installed)."""
SPECULATORS_FILES = (CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE)
"""What a speculators export holds: its config, the weights, and our provenance (ignored by speculators)."""

LAYER_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "tie_word_embeddings",
)
"""Our config.json's keys that are the draft layers' Qwen3 config (``transformer_layer_config``)."""
DSPARK_KEYS = (
    "draft_vocab_size",
    "block_size",
    "mask_token_id",
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
"""DSpark fields with the same name and meaning on both sides."""
SPECULATORS_VERIFIER_TENSORS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "verifier_lm_head.weight",
    "verifier_norm.weight",
)
"""Tensors speculators takes from the verifier (not in its files; dropped if a checkpoint has them)."""


def speculators_config(
    export_dir: Path, verifier: Optional[Path] = None, prov: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """speculators' ``config.json`` for our DSpark export at ``export_dir``; ``verifier``: the
    target's directory (default: the one export.json records); ``prov``: export.json, when the
    caller has read it. One :class:`ExportError` naming the file and field for what speculators'
    DSpark cannot hold."""
    export_dir = Path(export_dir)
    ours = read_json(export_dir / CONFIG_FILE, expected="an export's config.json", error=ExportError)
    if prov is None:
        prov = read_json(export_dir / PROVENANCE_FILE, expected="an export's export.json", error=ExportError)
    where = export_dir / CONFIG_FILE
    held = [[f.architectures["dspark"]] for f in speculators_families().values() if "dspark" in f.architectures]
    if ours.get("architectures") not in held:
        raise ExportError(
            f"{where}: architectures is {ours.get('architectures')}, expected {' or '.join(map(str, held))} "
            "(speculators' DSpark has Qwen3-style draft layers: a K3 MLA drafter or a dflash-layout export has no "
            "speculators form)"
        )
    if ours.get("sample_from_anchor") is not True:
        raise ExportError(f"{where}: sample_from_anchor is {ours.get('sample_from_anchor')}, expected true")
    if ours.get("markov_head_type", "vanilla") != "vanilla":
        raise ExportError(f"{where}: markov_head_type is {ours['markov_head_type']!r}, expected 'vanilla'")
    missing = [k for k in (*LAYER_CONFIG_KEYS, *DSPARK_KEYS, "rope_theta") if k not in ours]
    if missing:
        raise ExportError(f"{where}: missing {missing}; export again with this version of dspark.export")
    if ours["draft_vocab_size"] != ours["vocab_size"]:
        raise ExportError(
            f"{where}: draft_vocab_size is {ours['draft_vocab_size']}, expected the full vocabulary "
            f"({ours['vocab_size']}): a reduced draft vocabulary is not converted to speculators' format yet (its t2d "
            "buffer is not written); serve the export itself, which vLLM and llama.cpp load with its d2t"
        )
    layer_ids = prov.get("context_layer_ids")
    if prov.get("layer_id_convention") != "hf_hidden_states" or not isinstance(layer_ids, list):
        raise ExportError(
            f"{export_dir / PROVENANCE_FILE}: layer_id_convention is {prov.get('layer_id_convention')!r} with "
            f"context_layer_ids {layer_ids!r}, expected 'hf_hidden_states' and a list"
        )
    verifier = Path(verifier or (prov.get("target") or {}).get("path") or "")
    target_config = verifier / CONFIG_FILE
    if not target_config.is_file():
        raise ExportError(f"{target_config}: the verifier's config is missing (pass --verifier TARGET_DIR)")
    architectures = read_json(target_config, expected="a model's config.json", error=ExportError).get("architectures")
    layers = {k: ours[k] for k in LAYER_CONFIG_KEYS}
    layers["rope_parameters"] = {"rope_theta": ours["rope_theta"], "rope_type": "default"}
    window = served_window(ours)
    layers["layer_types"] = ["sliding_attention" if window else "full_attention"] * int(ours["num_hidden_layers"])
    if window:
        # speculators reads the window per layer (layer_types + sliding_window) and masks its blocks
        # non-causally with sliding_window_non_causal; vLLM serves a speculators DSpark's
        # sliding layers causal unless the layer config says is_causal false (_dflash_layer_causal);
        # transformers' Qwen3Config keeps sliding_window only with use_sliding_window
        layers.update(use_sliding_window=True, sliding_window=window, is_causal=False)
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "dtype": ours.get("torch_dtype", "float32"),
        "tie_word_embeddings": False,
        "transformer_layer_config": layers,
        **{k: ours[k] for k in DSPARK_KEYS},
        "target_hidden_size": ours.get("target_hidden_size"),
        "aux_hidden_state_layer_ids": list(layer_ids),
        "sliding_window_non_causal": bool(window),
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(ours["block_size"]),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier.resolve()), "architectures": architectures},
        },
    }


def write_speculators(export_dir: Path, out_dir: Path, verifier: Optional[Path] = None) -> Path:
    """Write ``out_dir`` in speculators' format from our export at ``export_dir``: the translated
    config, the same weights file, and export.json with ``"format": "speculators"``. As
    ``dspark.export``: a directory holding anything but an earlier export is refused, and a
    killed write leaves the old one."""
    export_dir, out_dir = Path(export_dir), Path(out_dir).expanduser()
    if out_dir.resolve() == export_dir.resolve():
        raise ExportError(f"--out {out_dir}: it is the export being converted; pick another directory")
    problem = replace_problem(out_dir, PROVENANCE_FILE, SPECULATORS_FILES)
    if problem:
        raise ExportError(f"--out {out_dir}: {problem}")
    provenance = read_json(export_dir / PROVENANCE_FILE, expected="an export's export.json", error=ExportError)
    config = speculators_config(export_dir, verifier, provenance)
    provenance = {**provenance, "format": "speculators", "converted_from": str(export_dir)}
    remove_stale_temporaries(out_dir)
    with atomic_path(out_dir, owner_marker=PROVENANCE_FILE, owned_files=SPECULATORS_FILES) as tmp:
        tmp.mkdir()
        shutil.copyfile(export_dir / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return out_dir


def read_speculators(path: Path) -> ExportedDrafter:
    """A speculators DSpark checkpoint (ours converted, or one speculators trained) as our
    :class:`~dspark.export.vllm_format.ExportedDrafter`: the drafter's config and sizes from its
    config.json, the context layers from ``aux_hidden_state_layer_ids`` (our numbering already),
    the weights by their (shared) names. The eval's reference loop and ``train.init_from`` take it
    as they take our export. What our drafter cannot be (another architecture, the fill-in layout,
    a reduced draft vocabulary, a Markov head other than vanilla) is one :class:`ExportError`."""
    path = Path(path).expanduser()
    where = path / CONFIG_FILE
    cfg = read_json(where, expected="a speculators checkpoint's config.json", error=ExportError)
    if not isinstance(cfg, dict) or cfg.get("speculators_model_type") != "dspark":
        got = cfg.get("speculators_model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise ExportError(f"{where}: speculators_model_type is {got!r}, expected 'dspark'")
    layers = cfg.get("transformer_layer_config") or {}
    held = speculators_families()
    # which family's layers: a config without model_type is read as the default family's
    model_type = layers.get("model_type", get_family(DEFAULT_FAMILY).speculators_layers)
    if model_type not in held:
        raise ExportError(
            f"{where}: transformer_layer_config.model_type is {model_type!r}, expected {' or '.join(map(repr, held))}"
        )
    for key, want in (("sample_from_anchor", True), ("markov_head_type", "vanilla")):
        if cfg.get(key, want) != want:
            raise ExportError(f"{where}: {key} is {cfg[key]!r}, expected {want!r}")
    vocab = int(layers.get("vocab_size") or 0)
    if cfg.get("draft_vocab_size") not in (None, vocab):
        raise ExportError(
            f"{where}: draft_vocab_size is {cfg['draft_vocab_size']}, expected the full vocabulary ({vocab}): "
            "a reduced draft vocabulary is not read from speculators' format yet (our own export carries one)"
        )
    if cfg.get("mask_token_id") is None:
        raise ExportError(f"{where}: mask_token_id is null, expected the token id the block's masked slots embed")
    window = _speculators_window(cfg, layers, where)
    ids = cfg.get("aux_hidden_state_layer_ids")
    problem = (
        layer_ids_problem("", ids, "aux_hidden_state_layer_ids")
        if isinstance(ids, list) and ids
        else f"'aux_hidden_state_layer_ids' is {ids!r}, expected a list of integers >= 0"
    )
    if problem:
        raise ExportError(f"{where}: {problem}")
    try:
        weights = {k: v.float() for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ExportError(f"{path / WEIGHTS_FILE}: cannot be read as safetensors ({type(e).__name__}: {e})") from e
    try:
        hidden, rank = int(layers["hidden_size"]), int(cfg.get("markov_rank", 0))
        rope = layers.get("rope_parameters") or {}
        drafter = DSparkConfig(
            family=held[model_type].name,
            num_layers=int(layers["num_hidden_layers"]),
            block_size=int(cfg["block_size"]),
            hidden_size=hidden,
            intermediate_size=int(layers["intermediate_size"]),
            num_attention_heads=int(layers["num_attention_heads"]),
            num_key_value_heads=int(layers["num_key_value_heads"]),
            head_dim=int(layers.get("head_dim") or hidden // int(layers["num_attention_heads"])),
            rope_theta=float(rope.get("rope_theta", layers.get("rope_theta", 10000.0))),
            rms_norm_eps=float(layers["rms_norm_eps"]),
            sample_from_anchor=True,
            markov_rank=rank,
            markov_head_type="vanilla",
            mask_token_id=int(cfg["mask_token_id"]),
            enable_confidence_head=bool(cfg.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", rank > 0)),
            attention_window=window,
        )
        fc_in = int(weights["fc.weight"].shape[1])
        dims = DrafterDims(
            hidden_size=hidden,
            intermediate_size=drafter.intermediate_size,
            num_heads=drafter.num_attention_heads,
            num_kv_heads=drafter.num_key_value_heads,
            head_dim=drafter.head_dim,
            vocab_size=vocab,
            target_hidden_size=int(cfg.get("target_hidden_size") or fc_in // len(ids)),
            num_context_layers=len(ids),
            mask_token_id=drafter.mask_token_id,
        )
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise ExportError(f"{where}: does not describe a DSpark drafter this code builds ({type(e).__name__}: {e})")
    for name in SPECULATORS_VERIFIER_TENSORS:  # the verifier's, if a checkpoint carries them: ours come from the target
        weights.pop(name, None)
    check_weights(weights, drafter, dims, where=str(path / WEIGHTS_FILE))
    return ExportedDrafter(path, cfg, {"format": "speculators"}, "dspark", drafter, dims, list(ids), weights)


def _speculators_window(cfg: dict[str, Any], layers: dict[str, Any], where: Path) -> Optional[int]:
    """The attention window of a speculators DSpark config (``transformer_layer_config.layer_types``
    and ``sliding_window``): None when every layer is full attention. Our drafter has one window for
    every layer and non-causal blocks, so mixed layers or causal sliding blocks are refused."""
    types = layers.get("layer_types") or []
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None
    if not all(sliding):
        raise ExportError(
            f"{where}: transformer_layer_config.layer_types is {types}, expected every layer 'sliding_attention' or "
            "every layer 'full_attention' (drafter.attention_window is one window for all layers)"
        )
    window = layers.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ExportError(f"{where}: transformer_layer_config.sliding_window is {window!r}, expected an int >= 1")
    if not cfg.get("sliding_window_non_causal", False):
        raise ExportError(
            f"{where}: sliding_window_non_causal is {cfg.get('sliding_window_non_causal')!r} with sliding layers, "
            "expected true (a DSpark block is non-causal)"
        )
    return window


def is_speculators(path: Path) -> bool:
    """Whether ``path`` holds a speculators checkpoint (its config.json names a speculators model type)."""
    cfg_file = Path(path).expanduser() / CONFIG_FILE
    if not cfg_file.is_file():
        return False
    try:
        cfg = read_json(cfg_file, expected="a model's config.json", error=ExportError)
    except ExportError:
        return False  # not readable: the reader of our own format names what is wrong with it
    return isinstance(cfg, dict) and "speculators_model_type" in cfg


def read_drafter_dir(path: Path) -> ExportedDrafter:
    """Our export or a speculators DSpark checkpoint, whichever ``path`` holds."""
    from dspark.export.vllm_format import read_export

    return read_speculators(path) if is_speculators(path) else read_export(path)


def verifier_dir(exp: ExportedDrafter) -> Optional[str]:
    """The target directory a drafter directory records: export.json's ``target.path``, or a
    speculators config's ``speculators_config.verifier.name_or_path``."""
    if exp.provenance.get("format") == "speculators" and "speculators_config" in exp.config:
        return ((exp.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return (exp.provenance.get("target") or {}).get("path")
