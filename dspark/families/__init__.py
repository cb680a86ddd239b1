"""Drafter families, one per served architecture, registered here (base.py says what a family
supplies; docs/architecture.md, "Adding a drafter family", what adding one takes: its module, one
line in :data:`FAMILIES`, its ``conf/drafter/NAME.yaml`` and its tests).

* ``qwen3``: GQA layers, ``Qwen3DSparkModel`` (and ``DFlashDraftModel``): every target's default.
* ``k3_mla``: Kimi K3's multi-head latent attention layers, ``K3DSparkModel``.

A family's own ``drafter.*`` fields are declared in its module (``DrafterFamily.fields``); the
config schema (:class:`dspark.config.DSparkConfig`) and :class:`DrafterDims` below are
composed from the shared fields and every registered family's. The families are a wing of their
own below the config (docs/architecture.md says why): the schema every stage composes is built from
them, so they import only torch, :mod:`dspark.serving` (the layouts) and themselves.
"""

from __future__ import annotations

import typing
from dataclasses import field, fields, make_dataclass

from dspark.families import k3_mla, qwen3
from dspark.families.base import DrafterFamily
from dspark.families.shared import SharedDims, SharedDrafterFields

FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (qwen3.FAMILY, k3_mla.FAMILY)}
"""``drafter.family`` -> the family."""
DEFAULT_FAMILY: str = SharedDrafterFields.family
"""``drafter.family``'s default (the schema's: :class:`SharedDrafterFields`), for whatever needs a
family before a config names one."""


def _own_fields(families: dict[str, DrafterFamily]) -> dict[str, str]:
    """Each family-owned field -> its family; two families may not declare the same name."""
    owner: dict[str, str] = {}
    for fam in families.values():
        for name in fam.config_fields:
            if name in owner:
                raise TypeError(f"drafter field {name!r} is declared by families {owner[name]!r} and {fam.name!r}")
            owner[name] = fam.name
        if set(fam.tag_names) != set(fam.config_fields):
            raise TypeError(f"family {fam.name!r}: tag_names must name each of its fields {fam.config_fields}")
    return owner


FIELD_FAMILY = _own_fields(FAMILIES)
"""Every family-owned ``drafter.*`` field -> the family that reads it."""
FIELD_CLASSES = tuple(dict.fromkeys(f.fields for f in reversed(FAMILIES.values())))
"""The families' field dataclasses, as bases of the composed dataclasses (the last base's fields
come first, so the registry's order is the fields' order)."""


def _family_field_specs() -> list[tuple[str, type, typing.Any]]:
    specs = []
    for cls in reversed(FIELD_CLASSES):
        hints = typing.get_type_hints(cls)
        specs += [(f.name, hints[f.name], field(default=f.default)) for f in fields(cls)]
    return specs


DrafterDims = make_dataclass(
    "DrafterDims",
    [(f.name, f.type, field()) for f in fields(SharedDims)] + _family_field_specs(),
    frozen=True,
    namespace={
        "__doc__": """``DSparkConfig`` with every derived size filled in from the target: the shared
        sizes, then each family's own fields (None for another family's), resolved by its
        ``resolve_dims``. Flat: a checkpoint's ``dims`` is this as a dict.""",
        "__module__": __name__,
    },
)


def get_family(name: str) -> DrafterFamily:
    if name not in FAMILIES:
        raise ValueError(f"drafter.family={name!r}: expected one of {list(FAMILIES)}")
    return FAMILIES[name]


def family_of_architecture(architecture: str) -> tuple[DrafterFamily, str]:
    """config.json's ``architectures[0]`` -> (family, export layout); KeyError when none has it."""
    for fam in FAMILIES.values():
        for layout, arch in fam.architectures.items():
            if arch == architecture:
                return fam, layout
    raise KeyError(architecture)


def served_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.architectures.values()]


def llama_cpp_families() -> list[str]:
    """The families llama.cpp serves (:attr:`DrafterFamily.served_by_llama_cpp`), by name."""
    return [f.name for f in FAMILIES.values() if f.served_by_llama_cpp]


def speculators_families() -> dict[str, DrafterFamily]:
    """speculators' ``transformer_layer_config.model_type`` -> the family whose draft layers it is
    (:attr:`DrafterFamily.speculators_layers`; the first registered where two say the same), for
    the families speculators' DSpark can hold."""
    out: dict[str, DrafterFamily] = {}
    for f in FAMILIES.values():
        if f.speculators_layers is not None:
            out.setdefault(f.speculators_layers, f)
    return out
