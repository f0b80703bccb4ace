"""The few places where the node pack touches ComfyUI itself.

Every ComfyUI import is guarded, so the pack imports (and its tests run) without ComfyUI:
model folders then come from ``$KREA2_MODELS_DIR`` (default ``./models``, laid out like
``ComfyUI/models``), there is no progress bar and nothing to interrupt.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

try:  # ComfyUI's model-folder registry
    import folder_paths
except ImportError:
    folder_paths = None

try:  # ComfyUI's progress bar and interrupt flag
    import comfy.model_management as model_management
    import comfy.utils as comfy_utils
except ImportError:
    model_management = comfy_utils = None

MODELS_DIR_ENV = "KREA2_MODELS_DIR"
# The Qwen-Image VAE's latent channels: what a Krea 2 LATENT must hold (checked before any loading).
LATENT_CHANNELS = 16


def model_folders(kind: str) -> list[Path]:
    """Folders that hold ``kind`` models ("diffusion_models", "diffusers", "text_encoders", "vae", "loras")."""
    if folder_paths is not None:
        try:
            return [Path(p) for p in folder_paths.get_folder_paths(kind)]
        except KeyError:  # a folder kind this ComfyUI version does not register
            return [Path(folder_paths.models_dir) / kind]
    return [Path(os.environ.get(MODELS_DIR_ENV, "models")) / kind]


def torch_device() -> torch.device:
    """The device ComfyUI samples on (CUDA when present otherwise)."""
    if model_management is not None:
        return model_management.get_torch_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_room() -> None:
    """Before loading Krea 2, ask ComfyUI to unload its own models (ComfyUI does not manage ours)."""
    if model_management is not None:
        model_management.unload_all_models()
        model_management.soft_empty_cache()


def step_callback(total_steps: int):
    """A ``callback_on_step_end`` that advances ComfyUI's progress bar and honours its Cancel button.

    The returned callable also keeps the latest ``latents`` in ``callback.latents``.
    """
    bar = comfy_utils.ProgressBar(total_steps) if comfy_utils is not None else None

    def callback(pipe, step, timestep, callback_kwargs):
        callback.latents = callback_kwargs.get("latents")
        if model_management is not None:
            model_management.throw_exception_if_processing_interrupted()
        if bar is not None:
            bar.update_absolute(step + 1, total_steps)
        return callback_kwargs

    callback.latents = None
    return callback


def on_unload_models(free) -> None:
    """Make ComfyUI's "Unload models" button (``/free``) also call ``free``."""
    if model_management is None or getattr(model_management.unload_all_models, "_krea2_hooked", False):
        return
    unload_all_models = model_management.unload_all_models

    def unload_all_models_and_krea2(*args, **kwargs):
        free()
        return unload_all_models(*args, **kwargs)

    unload_all_models_and_krea2._krea2_hooked = True
    model_management.unload_all_models = unload_all_models_and_krea2


def images_to_comfy(images: np.ndarray) -> torch.Tensor:
    """Pipeline ``np`` output (B, H, W, 3) in [0, 1] -> ComfyUI IMAGE (float32, same layout)."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().clamp(0, 1)


def comfy_to_pil(image: torch.Tensor) -> list:
    """ComfyUI IMAGE (B, H, W, C) in [0, 1] -> one RGB PIL image per batch item."""
    from PIL import Image

    if image.shape[-1] == 1:  # grey
        image = image.expand(*image.shape[:-1], 3)
    pixels = (image[..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return [Image.fromarray(item, "RGB") for item in pixels]


def check_image_latents(latents: torch.Tensor, source: str = "latent") -> torch.Tensor:
    """A ComfyUI LATENT's samples, (B, 16, h, w) or (B, 16, 1, h, w) -> (B, 16, h, w); refuses other
    channels, several frames or sizes that are not whole transformer tokens, naming the shape."""
    from krea2_diffusers.latents import PATCH_SIZE, PIXELS_PER_TOKEN

    if latents.ndim == 5:
        if latents.shape[2] != 1:
            raise ValueError(f"{source}: {latents.shape[2]} frames in shape {tuple(latents.shape)}; Krea 2 takes single images")
        latents = latents[:, :, 0]
    if latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"{source}: shape {tuple(latents.shape)} is not (B, {LATENT_CHANNELS}, [1,] H/8, W/8) "
                         "(the Qwen-Image VAE's 16 latent channels)")
    if latents.shape[-2] % PATCH_SIZE or latents.shape[-1] % PATCH_SIZE:
        raise ValueError(f"{source}: latent size {tuple(latents.shape[-2:])} gives an image that is not a multiple of "
                         f"{PIXELS_PER_TOKEN} pixels")
    return latents
