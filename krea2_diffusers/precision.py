"""The compute-dtype policy: which floating dtype the models compute in when nobody says.

bfloat16 on CUDA; on a CPU, bfloat16 only where the CPU has bf16 matrix units (x86
``avx512_bf16`` or ``amx_bf16``), float32 elsewhere. Measured with torch's CPU matmul on 2
threads: an AMD EPYC with AVX512-BF16 runs bf16 at 300-380 GFLOPS against float32's ~92
(3.3-4.1x); a CPU without bf16 units emulates it at 12.7 GFLOPS against float32's 46 (3.6x
slower). So the choice follows the machine, read once per process from ``/proc/cpuinfo``.

``KREA2_CPU_BF16=1`` / ``=0`` overrides the detection (read at every call, so tests and users can
force either answer). An explicit dtype (``torch_dtype``, ``--dtype``, ``mixed_precision: no|bf16``)
is always obeyed: only ``auto`` comes here.

Every choice carries its reason, printed by the entry points as one line, e.g.
``compute dtype: bfloat16 (this CPU has AVX512-BF16)``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

CPU_BF16_ENV = "KREA2_CPU_BF16"
CPUINFO = Path("/proc/cpuinfo")
# x86 feature flags (as /proc/cpuinfo spells them) of units that run bf16 matmuls natively, and
# their names in messages; AMX first, as the faster of the two.
CPU_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}
MIXED_PRECISION = ("auto", "no", "bf16")


@dataclass(frozen=True)
class CpuBf16:
    """Whether this CPU computes bf16 natively, and why we think so."""

    available: bool
    reason: str


@dataclass(frozen=True)
class ComputeDtype:
    """A chosen compute dtype and the reason, e.g. ``(torch.bfloat16, "this CPU has AVX512-BF16")``."""

    dtype: torch.dtype
    reason: str

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name of this choice for training: ``"bf16"`` (autocast) or ``"no"``."""
        return "bf16" if self.dtype == torch.bfloat16 else "no"

    def describe(self) -> str:
        return f"compute dtype: {str(self.dtype).removeprefix('torch.')} ({self.reason})"


def cpu_bf16_flags(cpuinfo: str) -> list[str]:
    """The bf16 unit names (``CPU_BF16_FLAGS`` values) listed in the first ``flags`` line of a
    ``/proc/cpuinfo`` text; empty when there are none (or no x86 flags line at all)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return [name for flag, name in CPU_BF16_FLAGS.items() if flag in flags]
    return []


@functools.lru_cache(maxsize=1)
def detected_cpu_bf16() -> CpuBf16:
    """What ``/proc/cpuinfo`` says, read once per process."""
    try:
        units = cpu_bf16_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return CpuBf16(False, f"no {CPUINFO} to find bf16 units in")
    if units:
        return CpuBf16(True, f"this CPU has {' and '.join(units)}")
    return CpuBf16(False, f"this CPU has no bf16 units ({' / '.join(CPU_BF16_FLAGS.values())}): bf16 would be emulated")


def cpu_bf16() -> CpuBf16:
    """The detection, unless ``KREA2_CPU_BF16`` (``0`` or ``1``) overrides it."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is None or forced == "":
        return detected_cpu_bf16()
    if forced not in ("0", "1"):
        raise ValueError(f"{CPU_BF16_ENV} must be 0 (no bf16 units) or 1 (bf16 units), got {forced!r}")
    return CpuBf16(forced == "1", f"{CPU_BF16_ENV}={forced}")


def cpu_has_bf16() -> bool:
    return cpu_bf16().available


def choose_compute_dtype(device: str | torch.device) -> ComputeDtype:
    """The dtype ``auto`` means on ``device``: bf16 on CUDA, bf16 on a CPU with bf16 units, else float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return ComputeDtype(torch.bfloat16, "CUDA")
    if kind == "cpu":
        cpu = cpu_bf16()
        return ComputeDtype(torch.bfloat16 if cpu.available else torch.float32, cpu.reason)
    return ComputeDtype(torch.float32, f"{kind}: bf16 is chosen on CUDA and on CPUs with bf16 units only")


def compute_dtype(device: str | torch.device) -> torch.dtype:
    return choose_compute_dtype(device).dtype


def training_precision(mixed_precision: str, device: str | torch.device, where: str = "mixed_precision") -> ComputeDtype:
    """A training config's ``mixed_precision`` (``auto | no | bf16``) on ``device``: ``no`` and
    ``bf16`` as given, ``auto`` by :func:`choose_compute_dtype`. ``.mixed_precision`` is the
    concrete value for Accelerate and FSDP."""
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"{where}: {mixed_precision!r} is not one of {list(MIXED_PRECISION)}")
    if mixed_precision == "auto":
        chosen = choose_compute_dtype(device)
        return ComputeDtype(chosen.dtype, f"{where}: auto, {chosen.reason}")
    return ComputeDtype(torch.bfloat16 if mixed_precision == "bf16" else torch.float32, f"{where}: {mixed_precision}")
