"""What gets trained: PEFT LoRA / LoKr / LoHa adapters on the blocks' projections (over a frozen
base that may be stored quantized), or every weight."""

from __future__ import annotations

import difflib
import re

import torch
from torch import nn

from .config import ConfigError, LoRAConfig

ADAPTER_NAME = "default"
_BLOCK = r"transformer_blocks\.\d+"
_TEXT_FUSION_BLOCK = r"text_fusion\.(?:layerwise|refiner)_blocks\.\d+"


def lora_target_names(transformer: nn.Module, config: LoRAConfig) -> list[str]:
    """Full names of the ``nn.Linear`` modules that get adapters, e.g. ``transformer_blocks.0.attn.to_q``."""
    heads = [_BLOCK] + ([_TEXT_FUSION_BLOCK] if config.train_text_fusion else [])
    suffixes = "|".join(re.escape(s) for s in config.target_modules)
    pattern = re.compile(rf"^(?:{'|'.join(heads)})\.(?:{suffixes})$")
    linear = {n for n, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    unknown = [n for n in config.extra_modules if n not in linear]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(linear), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"lora.extra_modules: {unknown[0]!r} is not a linear layer of the transformer{hint}")
    names = sorted(n for n in linear if pattern.match(n)) + list(config.extra_modules)
    if not names:
        raise ValueError(f"lora.target_modules {config.target_modules} match no linear layer in the transformer")
    return names


def adapter_config(config: LoRAConfig, target_modules: list[str]):
    """PEFT's config for ``lora.type``: LoRA, LoKr or LoHa on ``target_modules``, each scaling its
    delta by ``alpha / rank`` and starting at zero (one factor zero-initialised), so training
    starts exactly at the base model."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if config.type == "lokr":
        return LoKrConfig(r=config.rank, alpha=config.alpha, target_modules=target_modules, decompose_factor=config.factor,
                          init_weights=True)  # w1 = 0; w2 (or w2_a, w2_b) ~ Kaiming
    if config.type == "loha":
        return LoHaConfig(r=config.rank, alpha=config.alpha, target_modules=target_modules, init_weights=True)  # hada_w2_b = 0
    return LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=target_modules,
                      use_dora=config.use_dora, init_lora_weights=True)  # A ~ Kaiming, B = 0


def add_lora(transformer: nn.Module, config: LoRAConfig, adapter_names: tuple[str, ...] = (ADAPTER_NAME,)) -> list[nn.Parameter]:
    """Freeze the transformer and attach a PEFT adapter of ``config.type`` (LoRA, LoKr or LoHa; one
    per name, same settings: LoRA distillation trains a second, the fake score); returns the
    trainable parameters.

    Adapter weights are kept in float32 even when the base is bf16: they are the only thing being
    updated and low-precision updates of small values stall.
    """
    from krea2_diffusers.loaders.lora import ADAPTER_PREFIXES

    transformer.requires_grad_(False)
    peft_config = adapter_config(config, lora_target_names(transformer, config))
    for name in adapter_names:
        transformer.add_adapter(peft_config, adapter_name=name)
    params = [p for n, p in transformer.named_parameters() if any(f".{prefix}" in n for prefix in ADAPTER_PREFIXES)]
    for param in params:
        param.data = param.data.float()
        param.requires_grad_(True)
    return params


def quantize_base(transformer: nn.Module, mode: str, compute_dtype: torch.dtype) -> int:
    """Store the frozen base's block matrices as ``fp8`` (per-row scale), ``int8`` or ``nf4``
    (bitsandbytes; an error, never a silent fallback, where it cannot run). The precision-sensitive
    layers (``krea2_diffusers.quantization.bnb.TRANSFORMER_KEEP``) stay in full precision. Returns layers replaced:
    0 when the loader already streamed the base in quantized (``finetune.model.load_pipeline``)."""
    from krea2_diffusers.loaders.quantized import quantize_storage_

    if mode == "none":
        return 0
    if any(type(m).__name__ == "PackedLinear" for m in transformer.modules()):
        raise ValueError(f"model.quantize={mode!r}: the base is a GGUF file, already quantized (it stays packed); use quantize: none")
    return quantize_storage_(transformer, mode, compute_dtype)


def check_quantize(mode: str, device: torch.device) -> None:
    """Refuse a base that bitsandbytes cannot store here (``int8`` / ``nf4``) before any model
    loads: bitsandbytes must import and a small layer of that mode must run on ``device`` (a
    build without this device's backend fails there). A :class:`ConfigError` naming the mode."""
    if mode not in ("int8", "nf4"):
        return
    from krea2_diffusers.quantization.bnb import BitsAndBytesUnavailable, quantize_linears_

    probe = nn.Sequential(nn.Linear(64, 64))
    try:
        quantize_linears_(probe, mode, compute_dtype=torch.float32)
        with torch.no_grad():
            probe.to(device)(torch.ones(1, 64, device=device))
    except BitsAndBytesUnavailable as err:
        raise ConfigError(f"model.quantize={mode!r}: {err}") from err
    except Exception as err:  # noqa: BLE001 - whatever the backend raises, said in one line
        raise ConfigError(f"model.quantize={mode!r}: bitsandbytes cannot run {mode} layers on {device} here "
                          f"({type(err).__name__}: {err}); use model.quantize: fp8 or none") from err


def trainable_parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
