"""One memory knob for the pipeline: ``memory="auto" | "high" | "24gb" | "16gb" | "12gb" | "8gb"``.

:func:`plan_memory` decides from the components' real sizes (so a GGUF or already-quantized
transformer is counted at its packed size) and the accelerator budget; :func:`apply_memory_preset`
applies the plan and returns a sentence saying what it chose. The options, cheapest first:

1. everything resident on the accelerator;
2. model CPU offload: one component (text encoder, transformer, VAE) on the accelerator at a time;
3. + fp8 weight storage for the transformer's block matrices, computed in the policy's dtype
   (:func:`~krea2_diffusers.precision.compute_dtype`: bf16 on CUDA GPUs with bf16 units; the
   project's one fp8 layer, per-row scaled :class:`~krea2_diffusers.quantization.fp8.Fp8Linear`);
4. + bitsandbytes NF4 for the transformer, then also for the text encoder (only when
   bitsandbytes can run; asking for it explicitly where it cannot is an error, see ``quantization.bnb``);
5. fp8 transformer with block-level group offload, and the text encoder group-offloaded too:
   only a block or two of weights on the accelerator.

Full-size Krea 2 in bf16: transformer 25.6 GB, Qwen3-VL-4B text encoder ~8.9 GB, VAE ~0.25 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..precision import compute_dtype
from ..presets import MEMORY_PRESETS

GIB = 1024**3
PRESET_BUDGET_GIB = {"24gb": 24, "16gb": 16, "12gb": 12, "8gb": 8}
# Activations of a 1024x1024 CFG step plus the CUDA context and allocator slack.
ACTIVATION_HEADROOM = 3 * GIB
BF16_BYTES = 2
FP8_RATIO = 0.5  # fp8 storage vs bf16 for the quantized layers (one fp32 scale per row aside)
NF4_RATIO = 0.28  # 4 bits + one fp32 absmax per 64 weights vs 16 bits, kept layers included
# A "16 GB" card exposes a little less, and the CUDA context and fragmentation take their share.
USABLE_FRACTION = 0.9
# Group offload keeps the non-block layers (modulation/text projections, text fusion: ~5% of the
# transformer at full size) plus two fp8 blocks in flight (one computing, one uploading: ~3.5%).
GROUP_OFFLOAD_SHARE = 0.08


@dataclass
class MemoryPlan:
    """What to apply. ``offload``: ``"none" | "model" | "group"``; quantization: ``"fp8" | "nf4" | None``."""

    offload: str = "none"
    transformer_storage: str | None = None
    text_encoder_storage: str | None = None
    estimated_peak: int = 0
    budget: int | None = None
    notes: list[str] = field(default_factory=list)


def component_bytes(module: nn.Module | None) -> int:
    """Accelerator bytes of ``module`` in bf16: floating tensors at 2 bytes, packed/quantized as stored."""
    if module is None:
        return 0
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        size = BF16_BYTES if tensor.is_floating_point() and tensor.element_size() > BF16_BYTES else tensor.element_size()
        total += tensor.numel() * size
    return total


def _already_compact(module: nn.Module) -> bool:
    """True when the transformer is GGUF-packed or bitsandbytes-quantized (no further storage tricks)."""
    return any(not p.is_floating_point() for p in module.parameters())


def plan_memory(transformer: int, text_encoder: int, vae: int, budget: int | None, *, bnb_available: bool,
                transformer_compact: bool = False) -> MemoryPlan:
    """Choose the cheapest combination whose estimated peak fits ``budget`` bytes (None: no limit).

    The estimate is the largest component on the accelerator at once plus activations; group
    offload is the last resort and is returned even if its estimate does not fit (with a note).

    Args:
        transformer, text_encoder, vae: bytes of each component as stored for compute (bf16).
        transformer_compact: the transformer is already quantized (GGUF/bnb): no fp8/NF4 on top.
    """
    if budget is None or transformer + text_encoder + vae + ACTIVATION_HEADROOM <= budget:
        return MemoryPlan(estimated_peak=transformer + text_encoder + vae + ACTIVATION_HEADROOM, budget=budget)
    candidates = [MemoryPlan(offload="model")]
    if not transformer_compact:
        candidates.append(MemoryPlan(offload="model", transformer_storage="fp8"))
        if bnb_available:
            candidates.append(MemoryPlan(offload="model", transformer_storage="nf4"))
            candidates.append(MemoryPlan(offload="model", transformer_storage="nf4", text_encoder_storage="nf4"))
    ratio = {None: 1.0, "fp8": FP8_RATIO, "nf4": NF4_RATIO}
    for plan in candidates:
        largest = max(transformer * ratio[plan.transformer_storage], text_encoder * ratio[plan.text_encoder_storage])
        plan.estimated_peak = int(largest + vae + ACTIVATION_HEADROOM)
        plan.budget = budget
        if plan.estimated_peak <= budget:
            return plan
    plan = MemoryPlan(offload="group", transformer_storage=None if transformer_compact else "fp8", budget=budget)
    plan.estimated_peak = int(transformer * GROUP_OFFLOAD_SHARE + vae + ACTIVATION_HEADROOM)
    if not bnb_available and not transformer_compact:
        plan.notes.append("bitsandbytes is not usable here, so NF4 was not considered")
    if plan.estimated_peak > budget:
        plan.notes.append(f"even group offload is estimated at {plan.estimated_peak / GIB:.1f} GiB; expect out-of-memory")
    return plan


def _bnb_usable() -> bool:
    try:
        from ..quantization.bnb import require_bitsandbytes

        require_bitsandbytes()
        return True
    except Exception:
        return False


def _budget(memory: str, device: torch.device) -> int | None:
    if memory == "high":
        return None
    if memory == "auto":
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory * USABLE_FRACTION)
        return None  # no accelerator: nothing to offload to
    return int(PRESET_BUDGET_GIB[memory] * GIB * USABLE_FRACTION)


def _cast_for_compute(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters to ``dtype`` except the model's keep-in-fp32 modules (norm scales)."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, param in module.named_parameters():
        if param.is_floating_point() and not any(part in keep for part in name.split(".")[:-1]):
            param.data = param.data.to(dtype)


def _describe(memory: str, plan: MemoryPlan, device: torch.device) -> str:
    placement = {
        "none": "all components resident (text encoder kept on the accelerator)" if device.type != "cpu"
                else "all components on the CPU (no accelerator: nothing to offload)",
        "model": "model CPU offload (one component on the accelerator at a time; the text encoder waits on the CPU)",
        "group": "group offload (transformer block by block, text encoder layer groups; both wait on the CPU)",
    }[plan.offload]
    parts = [placement]
    if plan.transformer_storage == "fp8":
        parts.append(f"transformer weights stored fp8 with a scale per row, computed in {str(compute_dtype(device)).removeprefix('torch.')}")
    elif plan.transformer_storage == "nf4":
        parts.append("transformer weights NF4 (bitsandbytes)")
    if plan.text_encoder_storage == "nf4":
        parts.append("text encoder weights NF4 (bitsandbytes)")
    if plan.budget is not None or device.type != "cpu":  # an accelerator estimate (1024 px CFG activations included)
        budget = "(no budget)" if plan.budget is None else f"of {plan.budget / GIB:.0f} GiB"
        parts.append(f"estimated peak {plan.estimated_peak / GIB:.1f} GiB {budget}")
    return f"memory={memory!r} on {device}: " + ", ".join(parts) + "".join(f"; note: {n}" for n in plan.notes)


def release_text_encoder(pipe) -> None:
    """Drop the text encoder (e.g. after encoding all prompts once) to free its ~8.9 GB of RAM.

    Afterwards the pipeline needs ``prompt_embeds``/``prompt_embeds_mask`` (from ``pipe.encode_prompt``).
    """
    if hasattr(pipe, "remove_all_hooks"):
        pipe.remove_all_hooks()  # offload hooks hold a reference to the module
    pipe.register_modules(text_encoder=None)
    from ..heap import release_freed_memory

    release_freed_memory()


def apply_plan(pipe, plan: MemoryPlan, device: torch.device) -> None:
    """Apply ``plan`` to ``pipe`` in place (storage changes first, then placement)."""
    # Quantized storage computes in the policy's dtype (bf16 on CUDA GPUs and CPUs with bf16 units;
    # float16 on an older GPU, float32 on a CPU that would emulate bf16); otherwise the weights keep the dtype they were loaded in.
    compute = compute_dtype(device) if plan.transformer_storage else pipe.transformer.dtype
    if plan.transformer_storage == "fp8":
        from ..quantization.fp8 import quantize_transformer_fp8_

        _cast_for_compute(pipe.transformer, compute)
        quantize_transformer_fp8_(pipe.transformer, compute_dtype=compute)
    elif plan.transformer_storage == "nf4":
        from ..quantization.bnb import quantize_transformer_

        _cast_for_compute(pipe.transformer, compute)
        quantize_transformer_(pipe.transformer, "nf4", compute_dtype=compute)
    if plan.text_encoder_storage == "nf4":
        from ..quantization.bnb import quantize_text_encoder_

        quantize_text_encoder_(pipe.text_encoder, "nf4", compute_dtype=pipe.text_encoder.dtype)
    if plan.offload == "none":
        pipe.to(device)
    elif plan.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    else:
        use_stream = device.type == "cuda"  # overlap the next group's upload with compute
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                                  num_blocks_per_group=1, use_stream=use_stream, exclude_modules=["vae"])
        pipe.vae.to(device)


# Full-size components whose source is a hub id (not on disk to measure): bf16 bytes.
TEXT_ENCODER_BYTES = int(8.9e9)
VAE_BYTES = int(0.25e9)


def _source_bytes(source, default: int) -> int:
    from .host_memory import file_bytes

    if source is not None and str(source) == "tiny-random":
        return 0
    return file_bytes(source) or default


def storage_for_file(model, memory: str, device, text_encoder=None, vae=None) -> str | None:
    """The transformer storage (``"fp8" | "nf4" | None``) ``memory`` will choose for the transformer
    file ``model``, decided from the file's shapes before loading, so the streamed loader stores it
    quantized from the start (the full-precision model never exists whole). None for a GGUF file,
    a folder or hub id (those are quantized in place after loading, as before)."""
    from pathlib import Path

    from ..loaders.single_file import locate_transformer_tensors
    from ..models.transformer import Krea2Transformer2DModel

    if memory not in MEMORY_PRESETS:
        raise ValueError(f"memory={memory!r} is not a memory preset; choose one of {', '.join(MEMORY_PRESETS)}")
    path = Path(str(model))
    if path.suffix == ".gguf" or not (path.is_file() or path.name.endswith(".index.json")):
        return None
    config, _ = locate_transformer_tensors(path)
    with torch.device("meta"):
        transformer = Krea2Transformer2DModel(**config)
    sizes = component_bytes(transformer), _source_bytes(text_encoder, TEXT_ENCODER_BYTES), _source_bytes(vae, VAE_BYTES)
    budget = _budget(memory, torch.device(device))
    fits = budget is None or sum(sizes) + ACTIVATION_HEADROOM <= budget
    return plan_memory(*sizes, budget, bnb_available=not fits and _bnb_usable()).transformer_storage


def apply_memory_preset(pipe, memory: str = "auto", device: str | torch.device | None = None) -> str:
    """Fit ``pipe`` into a memory budget and say how.

    Args:
        pipe: a ``Krea2Pipeline`` (transformer, text_encoder, vae), not yet offloaded.
        memory: one of ``MEMORY_PRESETS``: ``"high"`` keeps everything on the accelerator,
            ``"NNgb"`` fits an NN GB card, ``"auto"`` reads the card's size (no GPU: everything on CPU).
        device: the accelerator (default: CUDA when available, else CPU).
    Returns:
        a one-line description of what was applied.
    """
    if memory not in MEMORY_PRESETS:
        raise ValueError(f"memory={memory!r} is not a memory preset; choose one of {', '.join(MEMORY_PRESETS)}")
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transformer = pipe.transformer
    compact = _already_compact(transformer)
    sizes = component_bytes(transformer), component_bytes(pipe.text_encoder), component_bytes(pipe.vae)
    budget = _budget(memory, device)
    # bitsandbytes is imported only when the budget could call for NF4 (everything resident never does).
    fits = budget is None or sum(sizes) + ACTIVATION_HEADROOM <= budget
    plan = plan_memory(*sizes, budget, bnb_available=not fits and not compact and _bnb_usable(), transformer_compact=compact)
    apply_plan(pipe, plan, device)
    return _describe(memory, plan, device)
