"""The export layouts, one record each: what a layout decides about the directory vLLM (and
llama.cpp's converter) reads, declared once.

A layout's name is what configs, ``python -m dspark.export export --layout`` and export.json
write (``dspark``, ``dflash``); everything the export, its read-back, its checks and llama.cpp's
flags decide by the layout is an attribute of its :class:`Layout` (:func:`layout_named`), never a
comparison of its name. The vLLM class that serves a layout is the drafter family's
(:attr:`dspark.families.base.DrafterFamily.architectures`, keyed by the layout's name: one
layout is ``Qwen3DSparkModel`` or ``K3DSparkModel`` by family), its vLLM method the serving
method's (:data:`dspark.serving.methods.METHODS`).

A new layout: its record in :data:`LAYOUTS`, its :class:`~dspark.serving.methods.ServingMethod`
(and a ``LlamaCppMethod`` where llama.cpp serves it), and in each family that serves it an
``architectures`` entry and its ``config_json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dspark.core.errors import UserError

LAYER_IDS_FIELD = "target_layer_ids"
"""The config.json field of the context layers' ids (vLLM's convention: :mod:`dspark.core.layer_ids`)."""
ANCHOR_FIELD = "sample_from_anchor"
"""The config.json field of the block layout (true: the anchor predicts; false: fill-in)."""


class UnknownLayout(UserError):
    """A layout name no record has; the message names the known ones."""


@dataclass(frozen=True)
class Layout:
    name: str
    """What configs, ``--layout`` and export.json call it (a key of each family's ``architectures``)."""
    anchor_block: bool
    """It serves the block whose anchor predicts (``sample_from_anchor`` true); False: the fill-in
    (bonus-anchor) block only, and a drafter trained the other way does not fit it."""
    markov_head: bool
    """It carries a Markov head (vanilla only): a drafter without one is served with a zero rank-1
    head (:func:`dspark.families.base.zero_markov_head`), dropped again when read back; False:
    no Markov head, and a drafter with one does not fit it."""
    confidence_head: bool
    """It carries the confidence head (and llama.cpp's ``--spec-draft-p-min`` applies); False: a
    drafter's confidence head is left out of the export and reads back as none."""
    config_section: Optional[str]
    """The config.json object vLLM's class reads the layout's own fields from (the context layer ids,
    the block layout, the mask id), or None: the top level."""
    anchor_default: bool
    """The block layout vLLM serves when config.json does not say (the export always says)."""
    gamma_within_block: bool
    """vLLM drafts at most ``block_size`` tokens a step in it: a larger ``num_speculative_tokens``
    is refused."""
    llama_cpp_spec_type: str
    """llama-server's ``--spec-type`` for a drafter GGUF converted from this layout (whether llama.cpp
    serves a drafter at all is its family's: ``served_by_llama_cpp``)."""

    @property
    def layer_ids_key(self) -> tuple[str, ...]:
        """Where config.json holds the context layers' ids (a path of keys)."""
        return self._path(LAYER_IDS_FIELD)

    @property
    def anchor_key(self) -> tuple[str, ...]:
        """Where vLLM reads the block layout (``sample_from_anchor``) in config.json (a path of keys)."""
        return self._path(ANCHOR_FIELD)

    @property
    def pads_confidence_head(self) -> bool:
        """The confidence head is served over [state; Markov embedding], zero columns added for a
        head trained on the state alone (:func:`dspark.families.base.confidence_zero_columns`)."""
        return self.confidence_head and self.markov_head

    def _path(self, field: str) -> tuple[str, ...]:
        return (field,) if self.config_section is None else (self.config_section, field)

    def layer_ids(self, config: dict[str, Any]) -> Any:
        """The context layers' ids written in ``config`` (vLLM's convention); KeyError or TypeError
        when it lacks them."""
        value: Any = config
        for key in self.layer_ids_key:
            value = value[key]
        return value


DSPARK = Layout(
    "dspark",
    anchor_block=True,
    markov_head=True,
    confidence_head=True,
    config_section=None,
    anchor_default=True,  # what vLLM's DSparkSpeculator reads when absent
    gamma_within_block=True,
    llama_cpp_spec_type="draft-dspark",
)
DFLASH = Layout(
    "dflash",
    anchor_block=False,
    markov_head=False,
    confidence_head=False,
    config_section="dflash_config",
    anchor_default=False,
    gamma_within_block=False,
    llama_cpp_spec_type="draft-dflash",
)

LAYOUTS: dict[str, Layout] = {x.name: x for x in (DSPARK, DFLASH)}
"""Every layout by name, in preference order (:data:`dspark.serving.methods.LAYOUTS`): this
run's export is written in this order and served in the first one the machine can serve and the
drafter fits."""


def layout_named(name: str) -> Layout:
    """The record of the layout called ``name``; :class:`UnknownLayout` naming the known ones."""
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise UnknownLayout(f"layout {name!r}: expected one of {tuple(LAYOUTS)}") from None
