"""What the trainer trains: the pipeline (through the library's one loader,
:func:`krea2_diffusers.loaders.assembly.load_pipeline`), the transformer built sharded from the meta
device for a full fine-tune, and the Turbo transformer for validation."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
from krea2_diffusers.loaders.assembly import LOAD
from krea2_diffusers.loaders.assembly import load_pipeline as assemble_pipeline
from krea2_diffusers.loaders.assembly import load_transformer as assemble_transformer
from krea2_diffusers.models.tiny import is_tiny

from .config import ModelConfig, TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pipeline(config: ModelConfig, device: torch.device, transformer=LOAD) -> Krea2Pipeline:
    """The RAW pipeline; text encoder and VAE on ``device`` (for caching), the transformer (if
    loaded) stays on the CPU until it is wrapped. ``transformer=None`` leaves it out. With
    ``model.quantize`` the transformer is read block by block and each block quantized as it
    arrives (the full-precision base never exists whole); GGUF files stay packed."""
    gguf = str(config.pretrained_model_name_or_path).endswith(".gguf")
    quantization = None if config.quantize == "none" or gguf else config.quantize
    pipe = assemble_pipeline(Krea2Pipeline, config.pretrained_model_name_or_path, text_encoder=config.text_encoder,
                             vae=config.vae, torch_dtype=DTYPES[config.dtype], transformer=transformer,
                             quantization=quantization if transformer is LOAD else None)
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder.to(device)
    pipe.vae.to(device)
    return pipe


def release_encoders(pipe: Krea2Pipeline, keep: bool) -> None:
    """After caching: with ``keep`` (validation samples need them) the text encoder and VAE leave
    the accelerator for the host; without, they are dropped, before the transformer loads."""
    from krea2_diffusers.heap import release_freed_memory

    if keep:
        pipe.text_encoder.to("cpu")
        pipe.vae.to("cpu")
    else:
        pipe.register_modules(text_encoder=None, vae=None)
    # the encoders' tensors are freed now, not at some later collection, and their heap pages
    # go back to the OS before the transformer loads on top of them
    release_freed_memory()


def load_transformer(config: ModelConfig) -> Krea2Transformer2DModel:
    """The transformer to put a LoRA on, through the library's loader: with ``model.quantize`` read
    block by block and each block quantized as it arrives; GGUF files stay packed."""
    gguf = str(config.pretrained_model_name_or_path).endswith(".gguf")
    return assemble_transformer(config.pretrained_model_name_or_path, torch_dtype=DTYPES[config.dtype],
                                quantization=None if config.quantize == "none" or gguf else config.quantize)


def transformer_weights(config: ModelConfig):
    """(transformer config kwargs, weight source) without reading any weight."""
    from krea2_diffusers.loaders.single_file import locate_transformer_tensors

    from .engine.weights import FileWeights, MemoryWeights

    name = config.pretrained_model_name_or_path
    if is_tiny(name):
        from krea2_diffusers.models.tiny import tiny_components

        transformer = tiny_components(tokenizer=False)["transformer"]
        return _plain_config(transformer), MemoryWeights(transformer.state_dict())
    transformer_config, locations = locate_transformer_tensors(name)
    return transformer_config, FileWeights(locations)


def _plain_config(transformer: nn.Module) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(transformer.config).items() if not k.startswith("_")}


def build_sharded_transformer(config: TrainConfig, runtime, *, trainable: bool = True,
                              assemble: Callable[[Callable[[], nn.Module]], nn.Module] | None = None) -> nn.Module:
    """A full fine-tune's transformer (or a frozen copy of it), never whole on one rank.

    meta-device build -> activation checkpointing -> per-block compile -> ``fully_shard`` per block
    then root (with more than one process) -> ``to_empty`` -> each rank reads its own rows of every
    tensor from the file.

    Args:
        trainable: float32 master weights that train. ``False``: a frozen copy (post-training's
            reference / teacher) stored in ``model.dtype``, ``requires_grad`` off, in eval mode,
            without activation checkpointing; sharded the same way (so it holds 1/N of the
            weights per rank and nothing in the optimizer) and with the trained copy's
            mixed-precision policy (sharded, both compute in the same parameter dtype and agree
            bit for bit while their weights are equal), each block gathered for
            its forward only. Its caller reshards the root after each forward (FSDP2 keeps a root
            gathered after forward, expecting a backward).
        assemble: builds the root from a factory of meta-device transformers, for a module that
            trains several copies at once (distillation's student and fake score); each copy is
            filled from the same weights. The root must list every copy's blocks in
            ``transformer_blocks``. Default: one transformer.
    """
    from .engine.parallel import fully_shard_blocks, prepare_blocks
    from .engine.weights import load_local_shards_

    transformer_config, source = transformer_weights(config.model)
    dtype = torch.float32 if trainable else DTYPES[config.model.dtype]

    def make() -> Krea2Transformer2DModel:
        with torch.device("meta"):
            return Krea2Transformer2DModel(**transformer_config).to(dtype)

    model = assemble(make) if assemble is not None else make()
    model.requires_grad_(trainable)
    blocks = list(model.transformer_blocks)
    training = config.training
    prepare_blocks(blocks, training.activation_checkpointing if trainable else "none", training.compile)
    if runtime.strategy == "fsdp":
        fully_shard_blocks(model, blocks, runtime.mixed_precision)
    model.to_empty(device=runtime.device)
    try:
        for copy in [m for m in model.modules() if isinstance(m, Krea2Transformer2DModel)]:
            load_local_shards_(copy, source, where=config.model.pretrained_model_name_or_path)
    finally:
        source.close()
    return model.train(trainable)


def load_turbo_pipeline(name_or_path: str, raw: Krea2Pipeline, dtype: str) -> Krea2Pipeline:
    """A Turbo pipeline sharing the RAW pipeline's text encoder and VAE (only the transformer differs)."""
    loaded = assemble_pipeline(Krea2Pipeline, name_or_path, text_encoder=raw.text_encoder, vae=raw.vae,
                               torch_dtype=DTYPES[dtype], is_distilled=True)
    device = next(raw.vae.parameters()).device
    turbo = Krea2Pipeline(
        scheduler=raw.scheduler, vae=raw.vae, text_encoder=raw.text_encoder, tokenizer=raw.tokenizer,
        transformer=loaded.transformer.to(device), text_encoder_select_layers=raw.config.text_encoder_select_layers,
        is_distilled=True,
    )
    turbo.set_progress_bar_config(disable=True)
    return turbo
