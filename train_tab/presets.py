"""Card-sized LoRA presets and the config mapping of a Train-tab run.

A preset names the card it is made for; its settings are the community's starting points for
Krea 2 RAW (rank 16-32, lr 1e-4, 1024 px) with the storage and block swap that fit that card
(``krea2 train --dry-run`` figures for the full-size model: r32 at 1024 px is 17.7 GiB on fp8 and
12.6 GiB on NF4). On ``tiny-random`` (and any test-sized base: :func:`is_test_model`) the
resolution drops to :data:`TINY_RESOLUTION` and the model stays in float32 (a CPU run that proves
the plumbing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from krea2_diffusers.cpu_threads import transformer_width
from krea2_diffusers.models.tiny import is_tiny

TINY_RESOLUTION = 64
KEEP_CHECKPOINTS = 8
"""Checkpoints a run keeps (``checkpointing.keep_last``): the default four sample sets' and a few
more (Stop, "Save now"); about 1 GB each for rank 32 on the full-size model."""
TEST_MODEL_WIDTH = 256
"""A base transformer narrower than this (heads x head dim; tiny-random's is 64, the released
model's 6144) is a test model, trained with tiny-random's settings."""


def is_test_model(base_model: str) -> bool:
    """``tiny-random``, or a file or folder whose transformer is narrower than :data:`TEST_MODEL_WIDTH`
    (read from its header or config, no weights; a hub id or an unreadable model is not one)."""
    width = None if is_tiny(base_model) else transformer_width(base_model)
    return is_tiny(base_model) or (width is not None and width < TEST_MODEL_WIDTH)


@dataclass(frozen=True)
class TrainPreset:
    card_gib: int
    """The card the preset is made for (the plan compares against it when no GPU is found)."""
    quantize: str
    """``model.quantize`` of the frozen base: none | fp8 | int8 | nf4."""
    rank: int
    resolution: int
    offload_blocks: int
    """``training.offload_blocks``: blocks whose frozen weights stream from CPU memory."""
    steps: int
    dtype: str = "bfloat16"


TRAIN_PRESETS: dict[str, TrainPreset] = {
    "16gb": TrainPreset(card_gib=16, quantize="nf4", rank=16, resolution=1024, offload_blocks=8, steps=1500),
    "24gb": TrainPreset(card_gib=24, quantize="fp8", rank=32, resolution=1024, offload_blocks=0, steps=1500),
    "48gb+": TrainPreset(card_gib=48, quantize="none", rank=32, resolution=1024, offload_blocks=0, steps=1500),
}


# The optimizer choice of a Train-tab run: ``adamw`` (8-bit on a GPU) at the preset's rate, or
# ``prodigy``, which estimates its own step size (``learning_rate`` 1.0 multiplies the estimate).
TRAIN_OPTIMIZERS = ("adamw", "prodigy")


def optimizer_section(name: str, tiny: bool) -> dict:
    """The ``optimizer`` section of a run with optimizer ``name`` (one of :data:`TRAIN_OPTIMIZERS`)."""
    if name == "prodigy":
        return {"name": "prodigy", "learning_rate": 1.0}
    return {"name": "adamw" if tiny else "adamw8bit", "learning_rate": 3e-3 if tiny else 1e-4}


def run_config(run_dir: Path, manifest: Path, preset_name: str, base_model: str, trigger_word: str, steps: int,
               sample_every: int, validation_prompt: str, masks: bool = False, regularization: Path | None = None,
               references: list[str] | None = None, optimizer: str = "adamw", *, prior_share: float = 0.5,
               text_encoder: str | None = None, vae: str | None = None) -> dict:
    """The ``krea2 train`` config (a YAML mapping) of a run in ``run_dir`` on ``manifest``
    (a ``.jsonl`` of image paths and captions). ``masks``: each image's loss mask is
    ``NAME.mask.png`` beside it (``data.masks: true``); ``regularization``: a manifest of
    regularisation images, trained beside ``manifest`` at ``training.prior_loss_weight`` 1 and drawn
    for ``prior_share`` of the samples (the datasets' ``weight``: ``1 - prior_share`` and ``prior_share``).
    ``references``: a pairs run (``data.references``; the manifest rows hold their references),
    these the validation sample's reference images. ``text_encoder`` / ``vae``: the model section's
    (None: the trainer's defaults). Paths are written as given: the Train tab gives them absolute."""
    preset = TRAIN_PRESETS[preset_name]
    tiny = is_test_model(base_model)
    resolution = TINY_RESOLUTION if tiny else preset.resolution
    every = max(1, int(sample_every))
    data = {"path": str(manifest)} if regularization is None else {
        "datasets": [{"path": str(manifest), "weight": round(1.0 - prior_share, 6)},
                     {"path": str(regularization), "is_regularization": True, "weight": round(prior_share, 6)}]}
    encoders = {k: v for k, v in (("text_encoder", text_encoder), ("vae", vae)) if v is not None}
    return {
        "output_dir": str(run_dir),
        "model": {"pretrained_model_name_or_path": base_model, **encoders, "dtype": "float32" if tiny else preset.dtype,
                  "quantize": preset.quantize},
        "data": {**data, "masks": bool(masks), "resolution": resolution, "caption_dropout": 0.05,
                 "num_workers": 0 if tiny else 2,
                 # Pairs: each reference's latents at most the training resolution's area, its own aspect.
                 **({"references": {"max_pixels": resolution * resolution}} if references else {})},
        "training": {"method": "lora", "max_steps": int(steps), "batch_size": 1,
                     "mixed_precision": "no" if tiny else "bf16", "activation_checkpointing": "none" if tiny else "full",
                     "offload_blocks": 0 if tiny else preset.offload_blocks},
        "lora": {"rank": preset.rank, "alpha": float(preset.rank),
                 **({"train_text_fusion": True, "extra_modules": ["img_in", "final_layer.linear"]} if tiny else {})},
        "optimizer": optimizer_section(optimizer, tiny),
        # A checkpoint at every sample set, so the checkpoint the report recommends (it measures
        # those samples) can be exported; Stop and "Save now" add theirs.
        "checkpointing": {"every_n_steps": every, "keep_last": KEEP_CHECKPOINTS},
        "validation": {"every_n_steps": every, "prompts": [validation_prompt], "height": resolution, "width": resolution,
                       "num_inference_steps": 4 if tiny else 28,
                       **({"reference_images": [list(references)]} if references else {})},
        "export": {"formats": ["diffusers", "comfyui", "kohya"], "trigger_words": [trigger_word] if trigger_word else []},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
