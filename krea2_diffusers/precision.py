"""The compute-dtype policy: which floating dtype the models compute in when nobody says.

bfloat16 on CUDA GPUs with bf16 units (compute capability 8.0, Ampere, or later; ROCm), float16 on
older ones for inference (diffusers' choice on a T4 or V100) and float32 for training there (float16
autocast needs loss scaling, which the training engine does not do); on a CPU, bfloat16 only where
the CPU has bf16 matrix units (x86
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
class Bf16Units:
    """Whether a device (a CPU, a CUDA GPU) computes bf16 natively, and why we think so."""

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
def detected_cpu_bf16() -> Bf16Units:
    """What ``/proc/cpuinfo`` says, read once per process."""
    try:
        units = cpu_bf16_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return Bf16Units(False, f"no {CPUINFO} to find bf16 units in")
    if units:
        return Bf16Units(True, f"this CPU has {' and '.join(units)}")
    return Bf16Units(False, f"this CPU has no bf16 units ({' / '.join(CPU_BF16_FLAGS.values())}): bf16 would be emulated")


def cpu_bf16() -> Bf16Units:
    """The detection, unless ``KREA2_CPU_BF16`` (``0`` or ``1``) overrides it."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is None or forced == "":
        return detected_cpu_bf16()
    if forced not in ("0", "1"):
        raise ValueError(f"{CPU_BF16_ENV} must be 0 (no bf16 units) or 1 (bf16 units), got {forced!r}")
    return Bf16Units(forced == "1", f"{CPU_BF16_ENV}={forced}")


def cpu_has_bf16() -> bool:
    return cpu_bf16().available


def cuda_bf16(device: torch.device) -> Bf16Units:
    """Whether the CUDA ``device`` has bf16 units (``available``) and why we think so. Without a GPU
    here (a dry run planning for one) the answer is yes: the GPUs runs are planned for have them.

    The test is ``torch.cuda.is_bf16_supported(including_emulation=False)``'s, compute capability 8
    or more (ROCm: always), asked of ``device`` rather than the current device; with its default
    ``including_emulation=True`` that function says yes wherever a bf16 tensor can be made, on a V100
    or a T4 too, which emulate bf16 matmuls slowly."""
    if torch.version.hip:
        return Bf16Units(True, "ROCm")
    if not torch.cuda.is_available():
        return Bf16Units(True, "CUDA")
    major, minor = torch.cuda.get_device_capability(device)
    gpu = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    if major >= 8:
        return Bf16Units(True, f"CUDA, {gpu}")
    return Bf16Units(False, f"CUDA, {gpu}: no bf16 units (they came with 8.0, Ampere)")


def choose_compute_dtype(device: str | torch.device) -> ComputeDtype:
    """The dtype ``auto`` means on ``device``: bf16 on a CUDA GPU or a CPU with bf16 units, float16
    on an older CUDA GPU, else float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        gpu = cuda_bf16(torch.device(device))
        return ComputeDtype(torch.bfloat16 if gpu.available else torch.float16, gpu.reason)
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
        if chosen.dtype == torch.float16:  # float16 autocast would need a gradient scaler: train in float32
            return ComputeDtype(torch.float32, f"{where}: auto, {chosen.reason}; float16 training needs loss scaling")
        return ComputeDtype(chosen.dtype, f"{where}: auto, {chosen.reason}")
    return ComputeDtype(torch.bfloat16 if mixed_precision == "bf16" else torch.float32, f"{where}: {mixed_precision}")


def resolve_dtype(dtype, torch_dtype):
    """The dtype a loader was asked for: diffusers (0.42) calls it ``dtype`` and deprecates its older
    ``torch_dtype``; both are taken here (a user's ``torch_dtype`` reaches diffusers as ``dtype``, so
    it raises no deprecation warning from inside our loader), but not together."""
    if dtype is not None and torch_dtype is not None:
        raise ValueError(f"pass dtype or torch_dtype, not both (got dtype={dtype}, torch_dtype={torch_dtype})")
    return dtype if dtype is not None else torch_dtype
