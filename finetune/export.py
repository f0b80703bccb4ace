"""Writing the result: LoRA files in the three formats other tools load, or full weights in the
diffusers and original layouts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from krea2_diffusers.convert import convert_diffusers_to_original
from krea2_diffusers.lora import lora_layers_from_diffusers_state_dict, lora_metadata, save_lora_file

from .config import TrainConfig

logger = logging.getLogger("finetune")

LORA_FILE_NAMES = {
    "diffusers": "lora_diffusers.safetensors",
    "comfyui": "lora_comfyui.safetensors",
    "kohya": "lora_kohya.safetensors",
}


def export_lora(trainable_state: dict[str, torch.Tensor], config: TrainConfig, out_dir: Path, steps: int) -> list[Path]:
    """``trainable_state``: the adapter's parameters by PEFT name
    (``transformer_blocks.0.attn.to_q.lora_A.default.weight`` ...)."""
    layers = lora_layers_from_diffusers_state_dict(trainable_state, alpha=config.lora.alpha, rank=config.lora.rank)
    base = config.export.base_model or config.model.pretrained_model_name_or_path
    written = []
    for fmt in config.export.formats:
        if fmt not in LORA_FILE_NAMES:
            continue
        if fmt != "diffusers" and config.lora.use_dora:
            # DoRA magnitudes have no agreed spelling in these formats; better no file than a wrong one.
            logger.warning("export: DoRA LoRAs are written in the diffusers format only; skipping %s", fmt)
            continue
        meta = lora_metadata(layers, fmt, base, trained_alpha=config.lora.alpha,
                             trigger_words=config.export.trigger_words, steps=steps)
        written.append(save_lora_file(out_dir / LORA_FILE_NAMES[fmt], layers, fmt, meta))
    return written


def export_full(state: dict[str, torch.Tensor], transformer_config: dict, config: TrainConfig, out_dir: Path, steps: int,
                metadata: dict[str, str] | None = None) -> list[Path]:
    """Full fine-tune: ``transformer/`` (diffusers folder) and/or ``krea2_original.safetensors``;
    ``metadata`` is added to both files' headers (e.g. ``krea2.is_distilled``)."""
    meta = {"format": "pt", "krea2.base_model": config.export.base_model or config.model.pretrained_model_name_or_path,
            "krea2.steps": str(steps), **(metadata or {})}
    state = {k: v.contiguous() for k, v in state.items()}
    written = []
    if "diffusers" in config.export.formats:
        folder = out_dir / "transformer"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / "diffusion_pytorch_model.safetensors"), metadata=meta)
        config_dict = {k: (list(v) if isinstance(v, tuple) else v) for k, v in transformer_config.items()
                       if not k.startswith("_")}
        config_dict["_class_name"] = "Krea2Transformer2DModel"
        (folder / "config.json").write_text(json.dumps(config_dict, indent=2))
        written.append(folder)
    if "original" in config.export.formats:
        path = out_dir / "krea2_original.safetensors"
        original = {k: v.contiguous() for k, v in convert_diffusers_to_original(state).items()}
        save_file(original, str(path), metadata=meta)
        written.append(path)
    return written
