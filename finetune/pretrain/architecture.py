"""The transformer a pretraining run trains: its shapes, its from-scratch initialisation, and the
fp8 (torchao float8) conversion of its linear layers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.layers import RMSNorm
from krea2_diffusers.tiny import tiny_transformer_config

from ..config import ConfigError
from .config import ArchitectureConfig, PretrainModelConfig, StageConfig

# Layers whose weights start at zero in a from-scratch model: the output projection (the first
# prediction is 0) and the shared modulation projection (every residual gate starts at 0, so each
# block starts as the identity), as the released model's zero-centred tables imply.
ZERO_INIT_MODULES = ("final_layer.linear", "time_mod_proj")
# Linear layers kept in high precision under fp8 (first/last layers, as in the report's recipe).
FP8_EXCLUDED = ("img_in", "final_layer.linear", "time_embed", "time_mod_proj", "text_fusion.projector")
# torchao's float8 matmuls need both dimensions divisible by 16.
FP8_DIM_MULTIPLE = 16


def transformer_config(model: PretrainModelConfig) -> dict:
    """``Krea2Transformer2DModel`` keyword arguments for ``model.architecture``."""
    arch = model.architecture
    if arch == "tiny":
        return tiny_transformer_config()
    if arch == "krea2":
        arch = ArchitectureConfig()
    config = dataclasses.asdict(arch)
    config["axes_dims_rope"] = tuple(config["axes_dims_rope"])
    return config


def init_from_scratch_(transformer: nn.Module) -> None:
    """Re-initialise every parameter: linear layers by their default (Kaiming-uniform) rule, norm
    scales and modulation tables at 0 (zero-centred: scale 1, no shift), :data:`ZERO_INIT_MODULES`
    at 0. Works on materialised FSDP2 shards too (DTensor init ops draw per shard)."""
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
            if isinstance(module, RMSNorm) or name in ZERO_INIT_MODULES:
                for param in module.parameters(recurse=False):
                    param.zero_()
        for name, param in transformer.named_parameters():
            if name.endswith("scale_shift_table"):
                param.zero_()


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def build_transformer(model: PretrainModelConfig, seed: int, device: torch.device | str = "cpu") -> Krea2Transformer2DModel:
    """The float32 transformer: from scratch (seeded, same on every process) or from ``init`` weights."""
    if model.init != "scratch":
        path = Path(model.init)
        if path.is_file() or path.name.endswith(".index.json"):
            transformer = Krea2Transformer2DModel.from_single_file(str(path), torch_dtype=torch.float32)
        elif path.is_dir():
            sub = "transformer" if (path / "transformer").is_dir() else None
            transformer = Krea2Transformer2DModel.from_pretrained(str(path), subfolder=sub, torch_dtype=torch.float32)
        else:
            raise ConfigError(f"model.init {model.init!r} is neither 'scratch' nor a transformer file/folder")
        expected = transformer_config(model)
        differs = {k: (transformer.config[k], v) for k, v in expected.items() if _as_tuple(transformer.config[k]) != _as_tuple(v)}
        if differs:
            raise ConfigError(f"model.init {model.init}: its shapes differ from model.architecture (file vs config): {differs}")
        return transformer.to(device)
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = Krea2Transformer2DModel(**transformer_config(model))
    init_from_scratch_(transformer)
    return transformer


def check_fp8_available(stages: list[StageConfig], device: torch.device) -> None:
    """Refuse ``precision: fp8`` before any work when this machine cannot run it."""
    fp8 = [s.name for s in stages if s.precision == "fp8"]
    if not fp8:
        return
    if device.type != "cuda":
        raise ConfigError(f"stage(s) {fp8}: precision fp8 needs a CUDA GPU with fp8 tensor cores (compute capability "
                          f">= 8.9, e.g. H100/L40/RTX 4090); this run is on {device.type}. Use precision: bf16.")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"stage(s) {fp8}: precision fp8 needs compute capability >= 8.9, this GPU has {major}.{minor}")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"stage(s) {fp8}: precision fp8 needs torchao (pip install torchao)") from None


def convert_to_fp8_(transformer: nn.Module, scaling: str) -> None:
    """Swap eligible ``nn.Linear`` layers for torchao ``Float8Linear`` (tensorwise or rowwise
    scaling); parameter names are unchanged, so checkpoints load either way. Call before FSDP."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and not any(name.startswith(p) for p in FP8_EXCLUDED)
                and module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0)

    convert_to_float8_training(transformer, config=Float8LinearConfig.from_recipe_name(scaling), module_filter_fn=eligible)
