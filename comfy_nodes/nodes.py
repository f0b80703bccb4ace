"""The Krea 2 nodes (ComfyUI V1 protocol). Each node's function is a thin call into krea2_diffusers.

Data passed between nodes:
- ``KREA2_PIPELINE``: a :class:`Krea2Model` — which pipeline to use (the cache key) and the LoRAs
  stacked on it. The pipeline itself lives in :data:`models.PIPELINES`, so ComfyUI's node cache
  never pins it in memory and "Unload models" really frees it; LoRA nodes never modify a pipeline
  another branch of the workflow uses.
- ``KREA2_STYLE_REFS``: a tuple of ``(PIL image, strength)``.
- IMAGE: float (B, H, W, 3) in [0, 1]; LATENT: ``{"samples": (B, 16, H/8, W/8)}`` in the VAE's own
  (un-normalised) space, like every ComfyUI latent, so the native VAE Decode node reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import comfy_bridge
from .models import (
    DTYPES, HUB_TEXT_ENCODER, HUB_VAE, PIPELINES, VARIANTS, LoadSpec, component_choices, list_files, lora_path,
    memory_presets, transformer_choices,
)

CATEGORY = "Krea2"
PIPELINE = "KREA2_PIPELINE"
STYLE_REFS = "KREA2_STYLE_REFS"
CREATIVITY = ["raw", "low", "medium", "high"]
STYLE_MODES = ("reference", "describe")
MAX_SEED = 0xFFFFFFFFFFFFFFFF - 16  # room for seed + i in a batch
MAX_SIZE = 4096


@dataclass(frozen=True)
class Krea2Model:
    """A pipeline to load (``spec``) plus the LoRAs, ``(path, strength)``, to apply to it."""

    spec: LoadSpec
    loras: tuple[tuple[str, float], ...] = ()

    def pipeline(self):
        """The cached pipeline, with exactly these LoRAs active."""
        return PIPELINES.get(self.spec, self.loras)


def _seed_input(tooltip: str):
    return ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": True, "tooltip": tooltip})


class Krea2ModelLoader:
    DESCRIPTION = "Loads Krea 2 (RAW or Turbo) as one pipeline: transformer, Qwen3-VL text encoder and Qwen-Image VAE."
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (PIPELINE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The Krea 2 pipeline; connect it to Krea 2 LoRA / Sampler / Prompt Expander.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (list(transformer_choices()), {"tooltip": (
                "Original single file or GGUF from models/diffusion_models, or a diffusers folder from models/diffusers. "
                "tiny-random: RANDOM weights, for testing only.")}),
            "variant": (list(VARIANTS), {"default": "auto", "tooltip": (
                "Which release this is; sets the sampler's defaults (Turbo: 8 steps, guidance off; RAW: 52 steps, 3.5). "
                "auto: Turbo when the name says turbo/tdm/distill.")}),
            "text_encoder": (list(component_choices("text_encoders", HUB_TEXT_ENCODER)), {"tooltip": (
                "Qwen3-VL-4B-Instruct, for single files and GGUF (diffusers folders bring their own). "
                "The hub id downloads it once.")}),
            "vae": (list(component_choices("vae", HUB_VAE)), {"tooltip": (
                "Qwen-Image VAE, for single files and GGUF (diffusers folders bring their own).")}),
            "dtype": (list(DTYPES), {"default": "bfloat16", "tooltip": "Weight dtype (GGUF files keep their quantization)."}),
            "memory": (memory_presets(), {"default": "auto", "tooltip": (
                "auto: fit the GPU it finds (offloading / fp8 / NF4 as needed); high: everything on the GPU; "
                "NNgb: fit a card of that size.")}),
        }}

    def load(self, model, variant, text_encoder, vae, dtype, memory):
        spec = LoadSpec(model, variant, text_encoder, vae, dtype, memory)
        PIPELINES.get(spec, loras=None)  # load now, so that errors and loading time show on this node
        return (Krea2Model(spec),)


class Krea2LoraLoader:
    DESCRIPTION = "Adds a LoRA (ai-toolkit, kohya/musubi, OneTrainer or diffusers format) to the pipeline. Chain several."
    CATEGORY = CATEGORY
    FUNCTION = "add_lora"
    RETURN_TYPES = (PIPELINE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The pipeline with this LoRA stacked on it.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "pipeline": (PIPELINE, {"tooltip": "From Krea 2 Model Loader or another Krea 2 LoRA Loader."}),
            "lora_name": (list(list_files("loras")), {"tooltip": "A LoRA file from models/loras."}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                   "tooltip": "How strongly the LoRA applies; 0 leaves it out."}),
        }}

    def add_lora(self, pipeline, lora_name, strength):
        if strength == 0:
            return (pipeline,)
        path = str(lora_path(lora_name))
        return (replace(pipeline, loras=pipeline.loras + ((path, float(strength)),)),)


class Krea2PromptExpander:
    DESCRIPTION = "Expands a short prompt into a detailed one with the pipeline's own Qwen3-VL (no extra weights)."
    CATEGORY = CATEGORY
    FUNCTION = "expand"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("prompt",)
    OUTPUT_TOOLTIPS = ("The expanded prompt; connect it to the Sampler's prompt.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "pipeline": (PIPELINE, {"tooltip": "Its Qwen3-VL text encoder writes the expansion."}),
            "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "The short prompt to expand."}),
            "creativity": (CREATIVITY, {"default": "medium", "tooltip": (
                "raw: unchanged; low / medium / high: expanded and interpreted increasingly freely.")}),
            "seed": _seed_input("Same seed, same expansion."),
            "max_new_tokens": ("INT", {"default": 512, "min": 1, "max": 2048, "tooltip": "Longest expansion, in tokens."}),
        }}

    def expand(self, pipeline, prompt, creativity, seed, max_new_tokens):
        return (pipeline.pipeline().expand_prompt(prompt, creativity=creativity, seed=seed, max_new_tokens=max_new_tokens),)


class Krea2StyleReference:
    DESCRIPTION = "Adds a style reference image with its own strength. Chain several (up to 10) into the Sampler."
    CATEGORY = CATEGORY
    FUNCTION = "add_reference"
    RETURN_TYPES = (STYLE_REFS,)
    RETURN_NAMES = ("style_refs",)
    OUTPUT_TOOLTIPS = ("The references so far; connect to another Style Reference or to the Sampler.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "image": ("IMAGE", {"tooltip": "The reference; every image of a batch becomes its own reference."}),
                "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 2.0, "step": 0.05, "tooltip": (
                    "How much this reference's style counts: 0 = ignored, 1 = plain reference, more = stronger.")}),
            },
            "optional": {"style_refs": (STYLE_REFS, {"tooltip": "References from a previous Style Reference node."})},
        }

    def add_reference(self, image, strength, style_refs=()):
        return (tuple(style_refs) + tuple((pil, float(strength)) for pil in comfy_bridge.comfy_to_pil(image)),)


class Krea2Sampler:
    DESCRIPTION = "Generates images with Krea 2 (text to image, optionally with style references)."
    CATEGORY = CATEGORY
    FUNCTION = "sample"
    RETURN_TYPES = ("IMAGE", "LATENT")
    RETURN_NAMES = ("image", "latent")
    OUTPUT_TOOLTIPS = ("The decoded images.", "The same images as latents (for VAE Decode, upscalers ...).")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE, {"tooltip": "From Krea 2 Model Loader or Krea 2 LoRA Loader."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "dynamicPrompts": True,
                                      "tooltip": "What to draw (or connect Krea 2 Prompt Expander)."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "", "tooltip": (
                    "Used when guidance is on (RAW). Empty is fine.")}),
                "width": ("INT", {"default": 1024, "min": 16, "max": MAX_SIZE, "step": 16,
                                  "tooltip": "Pixels, a multiple of 16. Turbo is best at 1-2K, RAW around 1K."}),
                "height": ("INT", {"default": 1024, "min": 16, "max": MAX_SIZE, "step": 16,
                                   "tooltip": "Pixels, a multiple of 16."}),
                "steps": ("INT", {"default": 0, "min": 0, "max": 200, "tooltip": "0 = the model's preset: Turbo 8, RAW 52."}),
                "guidance": ("FLOAT", {
                    "default": -1.0, "min": -1.0, "max": 20.0, "step": 0.1, "round": 0.01,
                    "display_name": "guidance (Krea scale: 0 = off; cfg = this + 1)",
                    "tooltip": ("Krea/diffusers convention: 0 turns guidance off; it equals ComfyUI's cfg minus 1 "
                                "(so RAW's 3.5 is cfg 4.5). -1 = the model's preset: Turbo 0, RAW 3.5.")}),
                "seed": _seed_input("Image i of a batch uses seed + i, like Krea's reference code."),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 16, "tooltip": "Images per run."}),
            },
            "optional": {
                "style_refs": (STYLE_REFS, {"tooltip": "From Krea 2 Style Reference."}),
                "style_mode": (list(STYLE_MODES), {"default": "reference", "tooltip": (
                    "reference: the images themselves steer the image (add the style-reference LoRA with a LoRA Loader); "
                    "describe: no LoRA needed, the text encoder describes each image's style.")}),
            },
        }

    def sample(self, pipeline, prompt, negative_prompt, width, height, steps, guidance, seed, batch_size, style_refs=(),
               style_mode="reference"):
        pipe = pipeline.pipeline()
        extra = {}
        if style_refs:
            extra = {"style_images": [ref[0] for ref in style_refs], "style_strengths": [ref[1] for ref in style_refs],
                     "style_mode": style_mode}
        callback = comfy_bridge.step_callback(steps or pipe.preset.num_inference_steps)
        output = pipe(
            prompt, negative_prompt=negative_prompt, width=width, height=height, num_inference_steps=steps or None,
            guidance_scale=None if guidance < 0 else guidance, num_images_per_prompt=batch_size,
            generator=[torch.Generator().manual_seed(seed + i) for i in range(batch_size)], output_type="np",
            callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"], **extra,
        )
        images = comfy_bridge.images_to_comfy(output.images)
        return (images, {"samples": vae_space_latents(pipe, callback.latents, *images.shape[1:3])})


def vae_space_latents(pipe, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed model latents -> (B, 16, H/8, W/8) in the VAE's own space (what ComfyUI latents hold)."""
    from krea2_diffusers.latents import unpack_latents

    latents = unpack_latents(packed, height, width).float().cpu()
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1)
    return latents * std + mean


NODE_CLASS_MAPPINGS = {
    "Krea2ModelLoader": Krea2ModelLoader,
    "Krea2LoraLoader": Krea2LoraLoader,
    "Krea2PromptExpander": Krea2PromptExpander,
    "Krea2StyleReference": Krea2StyleReference,
    "Krea2Sampler": Krea2Sampler,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "Krea2ModelLoader": "Krea 2 Model Loader",
    "Krea2LoraLoader": "Krea 2 LoRA Loader",
    "Krea2PromptExpander": "Krea 2 Prompt Expander",
    "Krea2StyleReference": "Krea 2 Style Reference",
    "Krea2Sampler": "Krea 2 Sampler",
}
