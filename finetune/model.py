"""Loading the pipeline to train on (RAW) and, for validation, the Turbo transformer."""

from __future__ import annotations

from pathlib import Path

import torch

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pipeline(name_or_path: str, dtype: str, device: torch.device) -> Krea2Pipeline:
    """``tiny-random``, a diffusers-format folder / hub id, or a single original-layout file."""
    from krea2_diffusers.assembly import load_pipeline as load

    pipe = load(Krea2Pipeline, name_or_path, torch_dtype=DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def load_turbo_pipeline(name_or_path: str, raw: Krea2Pipeline, dtype: str) -> Krea2Pipeline:
    """A Turbo pipeline sharing the RAW pipeline's text encoder and VAE (only the transformer differs)."""
    torch_dtype = DTYPES[dtype]
    if Path(name_or_path).suffix in (".safetensors", ".gguf"):
        transformer = Krea2Transformer2DModel.from_single_file(name_or_path, torch_dtype=torch_dtype)
    elif name_or_path == "tiny-random":
        transformer = Krea2Pipeline.from_pretrained(name_or_path, torch_dtype=torch_dtype).transformer
    else:
        transformer = Krea2Transformer2DModel.from_pretrained(name_or_path, subfolder="transformer", torch_dtype=torch_dtype)
    device = next(raw.vae.parameters()).device
    turbo = Krea2Pipeline(
        scheduler=raw.scheduler, vae=raw.vae, text_encoder=raw.text_encoder, tokenizer=raw.tokenizer,
        transformer=transformer.to(device), text_encoder_select_layers=raw.config.text_encoder_select_layers,
        is_distilled=True,
    )
    turbo.set_progress_bar_config(disable=True)
    return turbo
