"""What a ``bench/full_size.py`` run ran with, recorded beside its figures so that two runs' numbers
can be told apart: threads, the machine's memory and page-cache state, how each quantized layer
class expands its weight, and (``layer_probe``) what that expansion costs on one real layer.

The issue behind it (a fresh machine measured 2-4x the README's s/step with the same bench) could
not be decided from the old JSON: every function here answers one "was it that?" question.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO_FIELDS = ("MemTotal", "MemFree", "MemAvailable", "Cached", "Dirty", "AnonPages")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def threads_record() -> dict:
    """torch's intra- and inter-op thread counts in this process, the variables that set them, and
    the CPUs this process may run on."""
    import torch

    backend = next((line.split(":", 1)[1].strip() for line in torch.__config__.parallel_info().splitlines()
                    if line.startswith("ATen parallel backend")), None)
    return {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
            "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "parallel_backend": backend}


CPU_SYSFS = Path("/sys/devices/system/cpu")


def cpu_record(cpuinfo: Path = Path("/proc/cpuinfo"), sysfs: Path = CPU_SYSFS) -> dict:
    """Which CPU ran: its name, vendor, family and model, its bf16 units (as the compute-dtype
    policy reads them), and its last-level cache in bytes (the distinct level-3 caches, summed).

    Machines sold as the same 2-core kind differ here, and the figures with them (issue 42: a 300 MB
    L3 with AMX, a 32 MB L3 without bf16 units, a 32 MB L3 with AVX512-BF16 only), so every run's
    JSON names its CPU instead of leaving it to the reader's memory of the session."""
    from krea2_diffusers.precision import cpu_bf16_flags

    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block describes them all here
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    caches = {}
    for index in sorted(sysfs.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        caches[shared] = int(size.rstrip("KMG")) * scale
    flags = set(first.get("flags", "").split())
    return {"model_name": first.get("model name"), "vendor": first.get("vendor_id"),
            "family": first.get("cpu family"), "model": first.get("model"),
            "bf16_units": cpu_bf16_flags(text), "amx": sorted(f for f in flags if f.startswith("amx")),
            "l3_bytes": sum(caches.values()) or None, "l3_caches": len(caches)}


def describe_cpu(cpu: dict) -> str:
    """One line for a bench's log, e.g. ``AMD EPYC (family 25, model 17), L3 32 MiB, bf16 units: AVX512-BF16``."""
    l3 = f"L3 {cpu['l3_bytes'] / 2 ** 20:.0f} MiB" if cpu["l3_bytes"] else "L3 unknown"
    units = " and ".join(cpu["bf16_units"]) or "none"
    return f"{cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), {l3}, bf16 units: {units}"


def machine_state() -> dict:
    """Load average, /proc/meminfo's memory and page-cache figures (bytes), and the transparent huge
    page mode: a fresh page costs ~1.6 us to fault in here with 4 KiB pages (bench/bench_dequant.py's
    ``fresh pages`` rows)."""
    meminfo = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in MEMINFO_FIELDS:
            meminfo[key] = int(value.split()[0]) * 1024
    thp = THP.read_text().strip() if THP.exists() else None
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "meminfo": meminfo,
            "transparent_hugepage": thp[thp.index("[") + 1:thp.index("]")] if thp and "[" in thp else thp}


def page_cache(path) -> dict:
    """How much of ``path`` is in the page cache now: ``mincore`` over a read-only mapping of the
    file (mapping it reads nothing; util-linux's ``fincore`` does the same). ``{"bytes",
    "resident_bytes", "resident_fraction"}``."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    size = os.path.getsize(path)
    span = 1 << 30  # mapped a GiB at a time: the residency vector is then 256 KiB
    resident = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in range(0, size, span):
            length = min(span, size - offset)
            address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vector = np.zeros(-(-length // page), dtype=np.uint8)
                if libc.mincore(address, length, vector.ctypes.data) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                resident += int(np.count_nonzero(vector & 1)) * page
            finally:
                libc.munmap(address, length)
    finally:
        os.close(fd)
    resident = min(resident, size)  # the last page counts whole
    return {"bytes": size, "resident_bytes": resident, "resident_fraction": round(resident / size, 4) if size else 0.0}


def _bnb_backend() -> str:
    import bitsandbytes
    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

    native = not isinstance(lib, ErrorHandlerMockBNBNativeLibrary)
    return f"bitsandbytes {bitsandbytes.__version__}, {'native CPU library' if native else 'no native library: torch fallback'}"


def dequant_path(layer) -> str | None:
    """How ``layer`` turns its stored weight into the matmul's (None for a plain float layer)."""
    name = type(layer).__name__
    if name == "PackedLinear":
        expand = (f"GGUF {layer.qtype.name}: krea2_diffusers.quantization.gguf.dequant (float32 chunks of "
                  "CHUNK_VALUES, rounded once) inside chunked_linear's output-row chunks; backward re-expands (training: keeps the recompute's)")
        if layer.in_int4_layout:
            return ("int4 layout: bf16 CPU calls without gradient up to int4_layout.row_limit() rows run "
                    f"aten._weight_int4pack_mm_for_cpu (no expansion); otherwise {expand}")
        return expand
    if name == "Fp8Linear":
        return ("fp8: krea2_diffusers.quantization.fp8.dequantize_weight (a 256-entry table per row, index_select) "
                "inside chunked_linear's output-row chunks; backward re-expands (training: keeps the recompute's)")
    if name == "Int8Linear":
        return (f"int8 ({_bnb_backend()}): inference bitsandbytes int8_linear_matmul (torch._int_mm on the codes, "
                "no expansion); CPU training: codes x SCB / 127 in chunked_linear's output-row chunks")
    if name == "Nf4Linear":
        return (f"nf4 ({_bnb_backend()}): bitsandbytes dequantize_blockwise + dequantize_4bit on row slices "
                "inside chunked_linear's output-row chunks (CPU); backward re-expands (training: keeps the recompute's)")
    if name == "Linear4bit":
        return (f"nf4 ({_bnb_backend()}): bitsandbytes dequantize_4bit of the whole matrix at each call, then "
                "F.linear; backward expands it again")
    return None


def dequant_paths(model) -> dict:
    """``{"<class> [<GGML type>]": {"layers": n, "path": ..., "largest": name}}`` over ``model``'s quantized layers."""
    found: dict[str, dict] = {}
    for name, layer in model.named_modules():
        path = dequant_path(layer)
        if path is None:
            continue
        key = type(layer).__name__ + (f" {layer.qtype.name}" if hasattr(layer, "qtype") else "")
        entry = found.setdefault(key, {"layers": 0, "path": path, "largest": name, "size": 0})
        entry["layers"] += 1
        if layer.in_features * layer.out_features > entry["size"]:
            entry.update(largest=name, size=layer.in_features * layer.out_features)
    for entry in found.values():
        entry.pop("size")
    return found


def expanded_weight(layer, dtype):
    """``layer``'s weight as one ``(out, in)`` ``dtype`` matrix, by the layer's own expansion."""
    if hasattr(layer, "dequantized_weight"):  # PackedLinear, Fp8Linear
        return layer.dequantized_weight(dtype)
    state = getattr(layer.weight, "quant_state", None)
    if state is not None:  # bitsandbytes NF4
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(layer.weight.data, state).to(dtype)
    codes = layer.state.CB if getattr(layer.state, "CB", None) is not None else layer.weight.CB
    scales = layer.state.SCB if getattr(layer.state, "SCB", None) is not None else layer.weight.SCB
    return (codes.float() * scales.float().unsqueeze(1) / 127).to(dtype)


def layer_probe(model, tokens: int, dtype, repeats: int = 3) -> dict:
    """For the largest layer of each quantized class: its forward on ``tokens`` rows against
    ``F.linear`` on its weight expanded once beforehand (the matmul alone), best of ``repeats``
    taken in turns (a neighbour's load hits both alike). ``expansion_share``: the part of the
    layer's forward that is not the matmul."""
    import torch
    import torch.nn.functional as F

    from krea2_diffusers.cpu_usage import Usage

    modules = dict(model.named_modules())
    report = {}
    for key, entry in dequant_paths(model).items():
        layer = modules[entry["largest"]]
        x = torch.randn(1, tokens, layer.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            weight = expanded_weight(layer, dtype)
            bias = None if layer.bias is None else layer.bias.to(dtype)
            best: dict[str, object] = {}
            for _ in range(repeats):
                for name, run in (("forward", lambda: layer(x)), ("matmul", lambda: F.linear(x, weight, bias))):
                    before = Usage.now()
                    run()
                    used = Usage.now() - before
                    if name not in best or used.wall < best[name].wall:
                        best[name] = used
        del weight
        forward, matmul = best["forward"], best["matmul"]
        flops = 2 * tokens * layer.in_features * layer.out_features
        report[key] = {"layer": entry["largest"], "shape": [layer.out_features, layer.in_features], "tokens": tokens,
                       **forward.as_dict("forward_"), "matmul_wall": round(matmul.wall, 4),
                       "forward_gflops": round(flops / forward.wall / 1e9, 1), "matmul_gflops": round(flops / matmul.wall / 1e9, 1),
                       "expansion_share": round(1 - matmul.wall / forward.wall, 3)}
    return report


def probe_layer_paths(quantize: str, dtype) -> dict:
    """The expansion path of the layers ``quantize`` stores a base as (``krea2 train`` builds its
    model in a child, so it is asked of one small layer quantized the same way)."""
    import torch

    from krea2_diffusers.loaders.quantized import quantize_storage_

    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    quantize_storage_(model, quantize, dtype)
    return {key: {"path": entry["path"]} for key, entry in dequant_paths(model).items()}


def machine_probe(config: dict | None = None, peak_size: int | None = None, train_quantize: str | None = None,
                  dtype_name: str = "auto") -> dict:
    """The device a run uses ("cpu" or the GPU's name), the transformer config (default: full
    size), the compute dtype the policy picks and why, this process's threads (as a child starts:
    the run's), the matmul peaks (bench/roofline.py) and, for ``train_quantize``, its layers' path."""
    import torch
    from roofline import machine_peaks

    from krea2_diffusers import Krea2Transformer2DModel
    from krea2_diffusers.precision import choose_compute_dtype

    cuda = torch.cuda.is_available()
    chosen = choose_compute_dtype("cuda" if cuda else "cpu")
    with torch.device("meta"):
        config = dict(Krea2Transformer2DModel(**(config or {})).config)
    dtype = chosen.dtype if dtype_name == "auto" else getattr(torch, dtype_name)
    reason = chosen.reason if dtype_name == "auto" else f"--dtype {dtype_name} given (auto would be {chosen.dtype}: {chosen.reason})"
    probe = dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                 config={k: v for k, v in config.items() if not k.startswith("_")},
                 compute_dtype=str(dtype).removeprefix("torch."), compute_dtype_reason=reason,
                 threads=threads_record(), **machine_peaks("cuda" if cuda else "cpu", peak_size))
    if train_quantize:
        probe["dequant_paths"] = probe_layer_paths(train_quantize, dtype)
    return probe
