"""Drafter families, one per served architecture, registered here (dspark/families/base.py says
what a family supplies; docs/architecture.md, "Adding a drafter family", what adding one takes).

* ``qwen3``: GQA layers, ``Qwen3DSparkModel`` (and ``DFlashDraftModel``): every target's default.
* ``k3_mla``: Kimi K3's multi-head latent attention layers, ``K3DSparkModel``.
"""

from __future__ import annotations

from dspark.core.config import DRAFTER_FAMILIES
from dspark.families import k3_mla, qwen3
from dspark.families.base import DrafterFamily

FAMILIES: dict[str, DrafterFamily] = {f.name: f for f in (qwen3.FAMILY, k3_mla.FAMILY)}
"""``drafter.family`` -> the family."""
assert {n: f.config_fields for n, f in FAMILIES.items()} == DRAFTER_FAMILIES, (
    "dspark.core.config.DRAFTER_FAMILIES names every registered family and its own drafter fields"
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
