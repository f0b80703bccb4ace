"""bitsandbytes NF4 / int8 weight storage for an already-loaded transformer or text encoder.

The ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` route of diffusers and
transformers works with our classes too, but diffusers refuses it without a GPU. This module
swaps the ``nn.Linear`` layers of a loaded model for bitsandbytes layers, which bitsandbytes
(>= 0.45) quantizes on CPU as well as on CUDA. There is no silent fallback: when
bitsandbytes cannot run, :func:`require_bitsandbytes` raises and says why.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..loaders.lora import ADAPTER_PREFIXES  # PEFT adapter sub-modules (lora_A, lokr_w1 ...)

BNB_MODES = ("nf4", "int8")
MIN_BNB_VERSION = (0, 45)  # first release whose 4-bit and int8 layers also run on CPU
# Transformer layers kept in full precision (the community GGUF rules, diffusers names): small,
# and the most sensitive to quantization error.
TRANSFORMER_KEEP = ("img_in", "time_embed", "time_mod_proj", "txt_in", "final_layer", "text_fusion.projector")
# Text encoder layers kept: the LM head (prompt expansion) and the small vision tower.
TEXT_ENCODER_KEEP = ("lm_head", "visual")


class BitsAndBytesUnavailable(RuntimeError):
    """bitsandbytes was asked for but cannot run here."""


def require_bitsandbytes():
    """Import bitsandbytes or raise :class:`BitsAndBytesUnavailable` with the reason and the fix."""
    try:
        import bitsandbytes as bnb
    except Exception as err:  # ImportError, or a broken native library raising at import
        raise BitsAndBytesUnavailable(
            "bitsandbytes needs to be installed and importable for NF4/int8 weights "
            f"(`pip install 'bitsandbytes>={MIN_BNB_VERSION[0]}.{MIN_BNB_VERSION[1]}'`); importing it failed: "
            f"{type(err).__name__}: {err}. Use memory presets without bitsandbytes, fp8 layerwise casting, "
            "or a GGUF file instead."
        ) from err
    version = tuple(int(p) for p in bnb.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_BNB_VERSION:
        raise BitsAndBytesUnavailable(
            f"bitsandbytes {bnb.__version__} is too old: NF4/int8 here needs >= "
            f"{MIN_BNB_VERSION[0]}.{MIN_BNB_VERSION[1]} (CPU and CUDA backends)"
        )
    return bnb


def keep_filter(keep: tuple[str, ...]) -> Callable[[str], bool]:
    def skip(name: str) -> bool:
        parts = name.split(".")
        if any(part.startswith(ADAPTER_PREFIXES) for part in parts):
            return True  # a loaded adapter's own small matrices stay in full precision
        return any(name == k or name.startswith(k + ".") or f".{k}." in f".{name}." for k in keep)
    return skip


def _replacement(bnb, linear: nn.Linear, mode: str, compute_dtype: torch.dtype) -> nn.Module:
    from .bnb_packing import quantize_int8, quantize_nf4

    weight = linear.weight.data
    bias = linear.bias
    on_cpu = weight.device.type == "cpu"
    if mode == "nf4":
        from .bnb_nf4 import Nf4Linear

        new = Nf4Linear(linear.in_features, linear.out_features, bias=bias is not None,
                                compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        # bitsandbytes >= 0.49 repacks the weight in place, with a bf16 absmax, at the first no-grad
        # eval forward on CPUs with AVX512-BF16: the numerics (and in_features < 64, a crash) would
        # depend on the machine, and the stored bytes would no longer be the ones we wrote.
        new.support_avx512bf16_for_cpu = False
        if on_cpu:  # the same bytes as bitsandbytes' own quantizer, with chunk-sized temporaries
            packed, state = quantize_nf4(weight)
            new.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4",
                                           module=new, bnb_quantized=True)
        else:
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    else:
        from .bnb_int8 import Int8Linear

        new = Int8Linear(linear.in_features, linear.out_features, bias=bias is not None,
                         has_fp16_weights=False, device="meta")
        if on_cpu:
            codes, scales = quantize_int8(weight)
            new.weight = bnb.nn.Int8Params(codes, requires_grad=False, has_fp16_weights=False, CB=codes, SCB=scales)
        else:
            new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        new.bias = nn.Parameter(bias.data.to(device=weight.device, dtype=compute_dtype), requires_grad=False)
    # elsewhere bitsandbytes quantizes when the parameter is moved to the device
    return new if on_cpu else new.to(weight.device)


def quantize_linears_(module: nn.Module, mode: str, *, keep: tuple[str, ...] = (),
                      compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every plain ``nn.Linear`` of ``module`` (in place) by a bitsandbytes layer.

    Args:
        mode: ``"nf4"`` (4-bit NormalFloat, ~0.53 bytes/weight) or ``"int8"`` (LLM.int8, ~1 byte/weight).
        keep: module names (or name parts) left in full precision.
        compute_dtype: dtype NF4 layers compute in (int8 layers compute in the input's dtype).
    Returns:
        number of layers replaced.
    Raises:
        ValueError: unknown mode. BitsAndBytesUnavailable: bitsandbytes cannot run here.
    """
    if mode not in BNB_MODES:
        raise ValueError(f"unknown bitsandbytes mode {mode!r}; choose one of {BNB_MODES}")
    bnb = require_bitsandbytes()
    skip = keep_filter(keep)
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear and not skip(name)]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, _replacement(bnb, child, mode, compute_dtype))
    return len(targets)


def quantize_transformer_(transformer: nn.Module, mode: str, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """NF4/int8 for the Krea 2 transformer's block matrices (embeddings and projections kept)."""
    return quantize_linears_(transformer, mode, keep=TRANSFORMER_KEEP, compute_dtype=compute_dtype)


def quantize_text_encoder_(text_encoder: nn.Module, mode: str, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """NF4/int8 for the Qwen3-VL language layers (LM head and vision tower kept)."""
    return quantize_linears_(text_encoder, mode, keep=TEXT_ENCODER_KEEP, compute_dtype=compute_dtype)
