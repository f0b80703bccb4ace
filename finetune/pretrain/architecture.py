"""The transformer a pretraining run trains: its shapes, its from-scratch initialisation, and the
fp8 (torchao float8) conversion of its linear layers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.files import CheckpointError
from krea2_diffusers.models.layers import RMSNorm
from krea2_diffusers.models.tiny import tiny_transformer_config

from ..config import ConfigError
from .config import ArchitectureConfig, PretrainModelConfig, StageConfig
from .repa import PROJECTOR_NAME

# Layers whose weights start at zero in a from-scratch model: the output projection (the first
# prediction is 0) and the shared modulation projection (every residual gate starts at 0, so each
# block starts as the identity), as the released model's zero-centred tables imply.
ZERO_INIT_MODULES = ("final_layer.linear", "time_mod_proj")
# Trained alongside the transformer but not part of its weights (see finetune.pretrain.repa).
AUXILIARY_MODULES = (PROJECTOR_NAME,)
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


def build_meta_transformer(model: PretrainModelConfig) -> Krea2Transformer2DModel:
    """The float32 transformer on the meta device: shapes only, so sharding, fp8 conversion and
    activation checkpointing happen before any rank holds a weight. ``init`` weights that do not
    fit the architecture are refused here, naming what differs."""
    with torch.device("meta"):
        transformer = Krea2Transformer2DModel(**transformer_config(model)).float()
    if model.init != "scratch":
        from ..engine.weights import check_names

        source = init_weights(model)
        try:
            check_names(transformer, source, f"model.init {model.init}")
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
        finally:
            source.close()
    return transformer


def init_weights(model: PretrainModelConfig):
    """The engine's weight source for ``model.init`` (original-layout file, diffusers folder or a
    diffusers-named file such as a PMA file), read as the configured architecture: each rank reads
    only its own rows."""
    from krea2_diffusers.loaders.single_file import locate_transformer_tensors

    from ..engine.weights import FileWeights

    if not Path(model.init).exists():
        raise ConfigError(f"model.init {model.init!r} is neither 'scratch' nor an existing transformer file/folder")
    _, locations = locate_transformer_tensors(model.init, config=transformer_config(model))
    return FileWeights(locations)


def materialize_(transformer: nn.Module, model: PretrainModelConfig, seed: int, device: torch.device | str) -> None:
    """Allocate the (possibly sharded) meta model on ``device`` and fill it: the scratch init under
    ``seed`` (identical on every process), or each rank's rows of the ``init`` weights. Auxiliary
    modules (the REPA projector) are left to their owner."""
    transformer.to_empty(device=device)
    if model.init == "scratch":
        torch.manual_seed(seed)
        init_from_scratch_(transformer)
        return
    from ..engine.weights import load_local_shards_

    auxiliary = {name: transformer._modules.pop(name) for name in AUXILIARY_MODULES if name in transformer._modules}
    source = init_weights(model)
    try:
        load_local_shards_(transformer, source, where=model.init)
    finally:
        source.close()
        transformer._modules.update(auxiliary)


def build_transformer(model: PretrainModelConfig, seed: int, device: torch.device | str = "cpu") -> Krea2Transformer2DModel:
    """An unsharded, materialised transformer (tests, benches, single-process tools)."""
    transformer = build_meta_transformer(model)
    materialize_(transformer, model, seed, device)
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
