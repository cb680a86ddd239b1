"""The serving methods, declared once: what vLLM can serve a target with, which export layout
(:mod:`dspark.export.vllm_format`) its draft model is, and whether it needs a GPU.

Read by the config's choices (``serve_bench.configs``), the export (``--layout``, the
architecture written into config.json), the export check, the eval's vLLM runs, ``python -m
eval.serve --method`` and the serving benchmark. A new method or drafter family is one line of
:data:`METHODS` (plus its export layout and the vLLM class that loads it).

:func:`export_method` decides how this run's export is served on this machine (``dspark`` on a
GPU, the ``dflash`` export on CPU); the eval and the serving benchmark both ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from dspark.serving.layouts import DFLASH, DSPARK
from dspark.serving.layouts import LAYOUTS as LAYOUT_RECORDS


@dataclass(frozen=True)
class ServingMethod:
    name: str
    """What configs and command lines call it."""
    vllm_method: Optional[str]
    """vLLM's ``speculative_config["method"]``; None: no speculation."""
    layout: Optional[str] = None
    """The export layout its draft model is (a :data:`dspark.serving.layouts.LAYOUTS` name); None: it
    serves no drafter of ours. The vLLM class (``architectures[0]`` of its config.json) is the
    drafter family's (:mod:`dspark.families`)."""
    needs_gpu: bool = False
    """vLLM serves it on GPUs only (its runner needs Triton)."""


METHODS = (
    ServingMethod("none", None),
    ServingMethod("ngram", "ngram"),
    ServingMethod("dflash", "dflash", layout=DFLASH.name),
    ServingMethod("dspark", "dspark", layout=DSPARK.name, needs_gpu=True),
)
"""Every method, in the order reports list them."""

BY_NAME = {m.name: m for m in METHODS}
SPECULATIVE = tuple(m.name for m in METHODS if m.vllm_method is not None)
"""The methods that speculate (``python -m eval.serve --method``)."""
BY_LAYOUT = {m.layout: m for m in METHODS if m.layout is not None}
LAYOUTS = tuple(LAYOUT_RECORDS)
"""The export layouts' names by preference (:data:`dspark.serving.layouts.LAYOUTS`' order): this run's
export is written in this order and served in the first one the machine can serve and the drafter
fits (:func:`export_method`; dspark fits every drafter vLLM can serve at all). ``python -m
dspark.export export --layout`` offers them."""
assert set(LAYOUTS) == set(BY_LAYOUT), "LAYOUTS orders the layouts of METHODS"
OURS = "ours"
"""The serving benchmark's name for this run's export, served as :func:`export_method` says."""
BASELINES = tuple(m.name for m in METHODS if m.vllm_method is not None and m.layout is None)
"""``eval.baselines`` choices: the methods that speculate without a drafter of ours."""
BENCH_CONFIGS = (*(m.name for m in METHODS if m.layout is None), OURS, *(m.name for m in METHODS if m.layout))
"""``serve_bench.configs`` choices, in the report's order: the methods without a drafter, ours,
then each method with a drafter by name; llama.cpp's methods follow (below)."""

PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 2, 4
"""vLLM ``ngram``'s n-gram lengths, for the served baseline and the reference loop's lookup alike."""


@dataclass(frozen=True)
class LlamaCppMethod:
    """A way llama.cpp's ``llama-server`` serves the target (CPU machines, where vLLM cannot serve
    ``dspark``)."""

    name: str
    """What configs and reports call it; the reference loop's proposer of the same name is its twin."""
    spec_types: tuple[str, ...]
    """``--spec-type``, in llama.cpp's precedence: a draftless proposer first, the drafter where it has
    no match (llama.cpp: "the draftless decoding has higher precedence")."""
    layout: Optional[str] = None
    """The export layout its drafter GGUF is converted from; None: no drafter."""


LLAMA_CPP_NGRAM = "ngram-simple"
"""llama.cpp's n-gram proposer closest to vLLM's prompt lookup: the last n tokens looked up in the
prompt and output so far, the tokens after their most recent earlier occurrence proposed (vLLM
tries n = 4 down to 2; llama.cpp's ``ngram-map-*`` add hit statistics, ``ngram-mod`` a hash pool
shared across requests, ``ngram-cache`` corpus statistics)."""
LLAMA_CPP_NGRAM_N = 3
"""Its key length, one fixed n (``--spec-ngram-simple-size-n``), in vLLM's range 2-4."""

LLAMA_CPP_METHODS = (
    LlamaCppMethod("none", ()),
    LlamaCppMethod("ngram", (LLAMA_CPP_NGRAM,)),
    LlamaCppMethod("dspark", (DSPARK.llama_cpp_spec_type,), layout=DSPARK.name),
    LlamaCppMethod("dflash", (DFLASH.llama_cpp_spec_type,), layout=DFLASH.name),
    LlamaCppMethod("ngram-then-dspark", (LLAMA_CPP_NGRAM, DSPARK.llama_cpp_spec_type), layout=DSPARK.name),
)
"""Every llama.cpp method, in the order reports list them (``eval.llama_cpp_methods``)."""
LLAMA_CPP_BY_NAME = {m.name: m for m in LLAMA_CPP_METHODS}
LLAMA_CPP_PREFIX = "llama.cpp-"
"""The serving benchmark's and the eval's names for llama.cpp's methods: ``llama.cpp-dspark``."""
BENCH_CONFIGS = (*BENCH_CONFIGS, *(LLAMA_CPP_PREFIX + m.name for m in LLAMA_CPP_METHODS))


def llama_cpp_method(row: str) -> LlamaCppMethod:
    """The llama.cpp method a row or configuration named ``llama.cpp-METHOD`` serves."""
    return LLAMA_CPP_BY_NAME[row.removeprefix(LLAMA_CPP_PREFIX)]


def export_method(*, gpu: bool, has_layout: Callable[[str], bool]) -> Optional[ServingMethod]:
    """How this run's export is served here: ``dspark`` on a GPU, on CPU the ``dflash`` export
    when the drafter has that layout (``has_layout``); None when vLLM can serve it neither way."""
    for layout in LAYOUTS:
        m = BY_LAYOUT[layout]
        if (gpu or not m.needs_gpu) and has_layout(layout):
            return m
    return None


def speculative_config(method: Optional[str], draft: Optional[Path], gamma: int) -> Optional[dict[str, Any]]:
    """vLLM's ``speculative_config`` for one of :data:`SPECULATIVE` (None: no speculation)."""
    if method is None:
        return None
    if method not in SPECULATIVE:
        raise ValueError(f"method {method!r}: expected one of {SPECULATIVE}")
    m = BY_NAME[method]
    if m.name == "ngram":
        return {
            "method": m.vllm_method,
            "num_speculative_tokens": gamma,
            "prompt_lookup_max": PROMPT_LOOKUP_MAX,
            "prompt_lookup_min": PROMPT_LOOKUP_MIN,
        }
    if draft is None:
        raise ValueError(f"method {method!r} needs --draft (an export directory from dspark.export)")
    return {"method": m.vllm_method, "model": str(draft), "num_speculative_tokens": gamma}
