"""Mixed precision for the trainer: ``train.autocast`` decided from what the device computes fast.

A CPU multiplies bf16 matrices fast only with ``avx512_bf16`` or AMX (``amx_bf16``): on an AMD EPYC
with ``avx512_bf16`` the demo's products ran 1.56x fp32, while on an AVX2-only CPU bf16 products are
emulated and about 50x slower. So ``auto`` reads the flags (``/proc/cpuinfo`` on Linux) and turns
bf16 autocast on only where they are; the first log line of training says what was chosen and
which flag chose it.

Autocast keeps every weight, gradient and optimizer state in the parameters' dtype (fp32 on CPU):
only the products (and what torch's autocast lists with them) run in bf16. Checkpoints, exports
and validation are therefore what an fp32 run writes: validation runs with autocast off, so its
figures are the exported drafter's. On a GPU the weights themselves are bf16 (``train.dtype``),
and ``auto`` leaves them alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Optional

import torch

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags with native bf16 matrix products (``/proc/cpuinfo``), best first."""
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags (the first ``flags`` line of ``cpuinfo``); empty where the file is
    missing or unreadable (not Linux): nothing is assumed."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


@dataclass(frozen=True)
class Autocast:
    """What the trainer runs its forward and loss under: ``dtype`` None is no autocast; ``reason``
    is the log's account of the choice (the setting and the flag or device that decided it)."""

    device_type: str
    dtype: Optional[torch.dtype]
    reason: str

    def context(self) -> ContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @property
    def label(self) -> str:
        return "off" if self.dtype is None else f"{str(self.dtype).removeprefix('torch.')} autocast"


def resolve_autocast(
    setting: str, device: torch.device, param_dtype: str, flags: Optional[set[str]] = None
) -> Autocast:
    """``train.autocast`` for this device: ``off`` and a non-fp32 ``train.dtype`` (the weights
    are already bf16/fp16) give none; ``bfloat16`` gives bf16; ``auto`` gives bf16 on a CPU with
    one of :data:`CPU_BF16_FLAGS` (``flags``: the CPU's, read from ``/proc/cpuinfo`` when None) and
    on a CUDA device that supports it, none elsewhere."""
    kind = device.type
    if setting == "off":
        return Autocast(kind, None, "train.autocast=off")
    if param_dtype != "float32":
        return Autocast(kind, None, f"train.dtype={param_dtype}: the weights themselves are {param_dtype}")
    if setting == "bfloat16":
        return Autocast(kind, torch.bfloat16, "train.autocast=bfloat16")
    if kind == "cpu":
        have = cpu_flags() if flags is None else flags
        found = [f for f in CPU_BF16_FLAGS if f in have]
        if found:
            return Autocast(kind, torch.bfloat16, f"train.autocast=auto: the CPU has {found[0]}")
        return Autocast(
            kind, None, f"train.autocast=auto: the CPU has none of {', '.join(CPU_BF16_FLAGS)} (bf16 would be emulated)"
        )
    if kind == "cuda" and torch.cuda.is_bf16_supported():
        return Autocast(kind, torch.bfloat16, "train.autocast=auto: the GPU supports bf16")
    return Autocast(kind, None, f"train.autocast=auto: no native bf16 on {kind}")
