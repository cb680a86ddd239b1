"""The one layer-id convention, and a transformers reference for it.

Convention ``hf_hidden_states``: layer id L names transformers' ``output_hidden_states[L]``,
the *input* of decoder layer L (id 0 is the embedding output). Id ``num_hidden_layers`` is the
final state *before* the final norm (transformers' last ``hidden_states`` entry is after it).

* vLLM's ``eagle_aux_hidden_state_layer_ids`` (used by ``extract_hidden_states``) count the same
  way: aux id L == ``output_hidden_states[L]`` (checked to ~1e-6 relative in fp32).
* vLLM's DSpark/DFlash drafter config ``target_layer_ids`` is one lower: vLLM captures id+1
  for each entry, so our ids [1, 15, 28] are written as [0, 14, 27].

:func:`spread_layer_ids` is the default choice of layers for a target that names none
(``target=hf``).

Imports torch only: the extractor (vLLM env) and the trainer both use it.
"""

from __future__ import annotations

from typing import Sequence

import torch

CONVENTION = "hf_hidden_states"
SPREAD_K = 5
"""Context layers :func:`spread_layer_ids` picks by default: DSpark's and DFlash's 5."""


def spread_layer_ids(num_hidden_layers: int, k: int = SPREAD_K) -> list[int]:
    """The default capture layers of a ``num_hidden_layers``-layer target: ``k`` ids spread evenly
    over its depth, from 1 (the first state a decoder layer computed) to ``num_hidden_layers - 1``
    (the input of the last layer), rounded half up. The final state (id ``num_hidden_layers``)
    is captured in addition, so the drafter sees the whole depth.

    This is the rule of the embedded SmolLM2 preset: 30 layers -> [1, 8, 15, 22, 29]; 36 layers
    (Qwen3-8B) -> [1, 10, 18, 27, 35]. DFlash's reference helper (``build_target_layer_ids``) spreads
    the same way over 0-based layer *outputs* 1 .. L-3, which are our ids 2 .. L-2 (SmolLM2:
    [2, 9, 15, 21, 28]); the Kimi K3 preset's ids are its own choice and stay explicit. A target
    with fewer than ``k`` such layers gets them all (8 layers, k=5 -> [1, 3, 4, 6, 7]; 4 -> [1, 2, 3]);
    ``k=1`` takes the middle layer; a one-layer target gets [0], the embedding output.
    """
    if k < 1 or num_hidden_layers < 1:
        raise ValueError(f"spread_layer_ids needs num_hidden_layers >= 1 and k >= 1, got {num_hidden_layers}, {k}")
    last = num_hidden_layers - 1
    n = min(k, last)
    if n == 0:
        return [0]
    if n == 1:
        return [max(1, num_hidden_layers // 2)]
    # round(1 + i * (last - 1) / (n - 1)) half up, in integers: exact for any depth
    return [(2 * ((n - 1) + i * (last - 1)) + (n - 1)) // (2 * (n - 1)) for i in range(n)]


def vllm_aux_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """Ids for vLLM's ``eagle_aux_hidden_state_layer_ids`` (extraction): the same numbering."""
    return [int(i) for i in layer_ids]


def vllm_draft_target_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """Ids for the ``target_layer_ids`` field of an exported drafter config (vLLM adds 1)."""
    if any(i < 1 for i in layer_ids):
        raise ValueError(
            f"vLLM drafter configs cannot express layer id 0 (the embedding output); got {list(layer_ids)}"
        )
    return [int(i) - 1 for i in layer_ids]


def from_vllm_draft_target_layer_ids(target_layer_ids: Sequence[int]) -> list[int]:
    return [int(i) + 1 for i in target_layer_ids]


@torch.no_grad()
def reference_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Recompute states in this convention with a transformers causal LM.

    input_ids: [T] token ids. Returns [T, len(layer_ids), H] in the model's dtype.
    """
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    captured: dict[str, torch.Tensor] = {}
    norm = model.get_decoder().norm
    handle = norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    states = []
    for i in layer_ids:
        if not 0 <= i <= num_layers:
            raise ValueError(f"layer id {i} outside [0, {num_layers}] for a {num_layers}-layer target")
        states.append(captured["pre_norm"][0] if i == num_layers else out.hidden_states[i][0])
    return torch.stack(states, dim=1)
