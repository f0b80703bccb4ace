"""The Krea 2 nodes (ComfyUI V1 protocol). Each node's function is a thin call into krea2_diffusers.

Data passed between nodes:
- ``KREA2_PIPELINE``: a :class:`Krea2Model` — which pipeline to use (the cache key) and the LoRAs
  stacked on it. The pipeline itself lives in :data:`models.PIPELINES`, so ComfyUI's node cache
  never pins it in memory and "Unload models" really frees it; LoRA nodes never modify a pipeline
  another branch of the workflow uses.
- ``KREA2_STYLE_REFS``: a tuple of ``(PIL image, strength)``.
- IMAGE: float (B, H, W, 3) in [0, 1]; LATENT: ``{"samples": (B, 16, 1, H/8, W/8)}``, raw (un-normalised)
  latents of the Qwen-Image VAE in ComfyUI's 5-D video layout for it, so native VAE Decode reads the
  Sampler's output and native VAE Encode feeds its ``latent`` input (4-D latents are accepted too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import comfy_bridge
from .references import REFERENCES, Krea2ReferenceImage, Krea2TextEncode
from .models import (
    DTYPES, HUB_TEXT_ENCODER, HUB_VAE, PIPELINES, VARIANTS, LoadSpec, component_choices, default_component, list_files,
    lora_path, memory_presets, transformer_choices,
)

CATEGORY = "Krea2"
PIPELINE = "KREA2_PIPELINE"
STYLE_REFS = "KREA2_STYLE_REFS"
CREATIVITY = ["raw", "low", "medium", "high"]
STYLE_MODES = ("reference", "describe")
REFERENCE_METHODS = ("index_timestep_zero", "index")  # as krea2_diffusers.presets (a test checks)
CACHE_METHODS = ("none", "fbcache", "taylorseer", "magcache", "dbcache")  # as krea2_diffusers.presets (a test checks)
MAX_SEED = 0xFFFFFFFFFFFFFFFF - 16  # room for seed + i in a batch
MAX_SIZE = 4096


@dataclass(frozen=True)
class Krea2Model:
    """A pipeline to load (``spec``) plus the LoRAs, ``(path, strength)``, to apply to it, and the step cache
    the Sampler runs it with (``(method, threshold)``, threshold None = the preset's; see Krea 2 Cache)."""

    spec: LoadSpec
    loras: tuple[tuple[str, float], ...] = ()
    cache: tuple[str, float | None] = ("none", None)

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
            "text_encoder": (list(component_choices("text_encoders", HUB_TEXT_ENCODER)), {
                "default": default_component("text_encoders", HUB_TEXT_ENCODER), "tooltip": (
                    "Qwen3-VL-4B-Instruct for single files and GGUF (diffusers folders bring their own): ComfyUI's "
                    "models/text_encoders/qwen3vl_4b_{bf16,fp8_scaled}.safetensors, a folder there, or the hub id "
                    "(downloads it once).")}),
            "vae": (list(component_choices("vae", HUB_VAE)), {
                "default": default_component("vae", HUB_VAE), "tooltip": (
                    "Qwen-Image VAE for single files and GGUF (diffusers folders bring their own): ComfyUI's "
                    "models/vae/qwen_image_vae.safetensors, a folder there, or the hub id.")}),
            "dtype": (list(DTYPES), {"default": "auto", "tooltip": (
                "Weight dtype (GGUF files keep their quantization). auto: bfloat16 on a GPU and on CPUs with bf16 "
                "units (AVX512-BF16 / AMX), float32 on other CPUs.")}),
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


class Krea2Cache:
    DESCRIPTION = ("Step caching for the Sampler this pipeline feeds: skips transformer work between steps "
                   "(First-Block Cache, TaylorSeer, MagCache: diffusers' hooks; dbcache: cache-dit's DBCache, "
                   "needs pip install cache-dit). Faster, slightly different images.")
    CATEGORY = CATEGORY
    FUNCTION = "set_cache"
    RETURN_TYPES = (PIPELINE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The pipeline, sampled with this cache; connect it to the Sampler.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "pipeline": (PIPELINE, {"tooltip": "From Krea 2 Model Loader or Krea 2 LoRA Loader."}),
            "cache": (list(CACHE_METHODS), {"default": "fbcache", "tooltip": (
                "none: every step in full. fbcache: skip the other blocks while the first block's output barely "
                "changes. taylorseer: predict the output from the last full steps. magcache: skip by the model's "
                "residual-magnitude ratios. dbcache: cache-dit's dual-block cache.")}),
            "threshold": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 100.0, "step": 0.01, "tooltip": (
                "-1 = the preset's (RAW or Turbo). Higher skips more. fbcache/magcache/dbcache: the residual "
                "threshold; taylorseer: steps per full forward (a whole number); 0 never skips.")}),
        }}

    def set_cache(self, pipeline, cache, threshold):
        return (replace(pipeline, cache=(cache, None if threshold < 0 else float(threshold))),)


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
    DESCRIPTION = ("Generates images with Krea 2: text to image, img2img from a LATENT (native VAE Encode) with "
                   "denoise, inpainting with a mask, optionally with style references.")
    CATEGORY = CATEGORY
    FUNCTION = "sample"
    RETURN_TYPES = ("IMAGE", "LATENT")
    RETURN_NAMES = ("image", "latent")
    OUTPUT_TOOLTIPS = ("The decoded images.", "The same images as raw Qwen-Image VAE latents (B, 16, 1, H/8, W/8): "
                       "native VAE Decode gives the same picture.")

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
                "latent": ("LATENT", {"tooltip": (
                    "Start from this image (native VAE Encode of the Qwen-Image VAE, 4-D or 5-D) instead of noise: "
                    "img2img. Its size overrides width and height.")}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": (
                    "With a latent: how much to change it (1 = ignore it, 0 = return it). Without: unused.")}),
                "mask": ("MASK", {"tooltip": "With a latent: repaint only where the mask is 1 (inpainting)."}),
                "references": (REFERENCES, {"tooltip": (
                    "From Krea 2 Reference Image (edit / identity / insertion LoRAs): vision tokens + reference latents.")}),
                "reference_method": (list(REFERENCE_METHODS), {"default": "index_timestep_zero", "tooltip": (
                    "index_timestep_zero: reference tokens modulated as timestep 0 (ComfyUI's native Krea 2); "
                    "index: with each step's timestep.")}),
                "guidance_interval_low": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": (
                    "Guidance runs only while the noise level t (1 = pure noise, 0 = clean) is in [low, high]; "
                    "outside, the unconditional pass is skipped (faster). 0 and 1 = every step.")}),
                "guidance_interval_high": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                                     "tooltip": "Upper end of the guidance interval (see low)."}),
            },
        }

    def sample(self, pipeline, prompt, negative_prompt, width, height, steps, guidance, seed, batch_size, style_refs=(),
               style_mode="reference", latent=None, denoise=1.0, mask=None, references=(), reference_method="index_timestep_zero",
               guidance_interval_low=0.0, guidance_interval_high=1.0):
        from krea2_diffusers.caching.apply import step_cache
        from krea2_diffusers.latents import to_model_space, unpack_latents
        from krea2_diffusers.sampling import check_guidance_interval

        interval = check_guidance_interval((guidance_interval_low, guidance_interval_high))

        start = None
        if latent is not None:  # checked before the pipeline is loaded or anything sampled
            start = comfy_bridge.check_image_latents(latent["samples"], "latent input").float()
            if start.shape[0] not in (1, batch_size):
                raise ValueError(f"latent input holds {start.shape[0]} images; batch_size is {batch_size}")
            mask = mask if mask is not None else latent.get("noise_mask")
        pipe = pipeline.pipeline()
        extra = {}
        if style_refs:
            extra = {"style_images": [ref[0] for ref in style_refs], "style_strengths": [ref[1] for ref in style_refs],
                     "style_mode": style_mode}
        if references:
            extra.update(reference_images=[ref[0] for ref in references], reference_strengths=[ref[1] for ref in references],
                         reference_method=reference_method)
        total_steps = steps or pipe.preset.num_inference_steps
        callback = comfy_bridge.step_callback(total_steps)
        generators = [torch.Generator().manual_seed(seed + i) for i in range(batch_size)]
        common = dict(guidance_scale=None if guidance < 0 else guidance, generator=generators, output_type="np",
                      callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"],
                      guidance_interval=None if interval == (0.0, 1.0) else interval, **extra)
        if start is not None and denoise == 0:  # nothing to change: the image itself
            return decode_only(pipe, start.expand(batch_size, -1, -1, -1))
        method, threshold = pipeline.cache
        with step_cache(pipe, method, num_inference_steps=total_steps, threshold=threshold):
            if start is not None:
                image = to_model_space(pipe.vae, start.to(pipe.vae.dtype)).float()
                output = sample_from_image(pipe, image, denoise, total_steps, mask, prompt, negative_prompt, batch_size, **common)
            else:
                output = pipe(prompt, negative_prompt=negative_prompt, width=width, height=height,
                              num_inference_steps=steps or None, num_images_per_prompt=batch_size, **common)
        images = comfy_bridge.images_to_comfy(output.images)
        latents = unpack_latents(callback.latents.float(), *images.shape[1:3]).cpu()
        return (images, {"samples": vae_space_latents(pipe, latents)})


def sample_from_image(pipe, image: torch.Tensor, denoise: float, steps: int, mask, prompt: str, negative_prompt: str,
                      batch_size: int, **kwargs):
    """ComfyUI's img2img / inpainting on the library's pipelines (``Krea2Img2ImgPipeline`` /
    ``Krea2InpaintPipeline`` sharing ``pipe``'s components), with ComfyUI's ``denoise`` schedule.

    Args:
        image: model latents (1 or ``batch_size``, 16, h, w); the output has their size.
        denoise: in (0, 1]: all ``steps`` run, from part-way into a longer schedule
            (``sampling.denoise_sigmas``), where diffusers' ``strength`` would run fewer steps.
        mask: ComfyUI MASK ((B,) H, W) or None: 1 = repaint (inpainting), any size.
        kwargs: the rest of the pipeline's arguments (generator, output_type, callbacks, style ...).
    """
    from krea2_diffusers import Krea2Img2ImgPipeline, Krea2InpaintPipeline
    from krea2_diffusers.sampling import denoise_sigmas

    if image.shape[0] == 1:  # one image for the whole batch
        prompts, negatives, per_prompt = prompt, negative_prompt, batch_size
    else:  # one image per batch item: the pipelines pair images with prompts
        prompts, negatives, per_prompt = [prompt] * batch_size, [negative_prompt] * batch_size, 1
    args = dict(image=image, strength=1.0, sigmas=denoise_sigmas(steps, denoise), negative_prompt=negatives,
                num_images_per_prompt=per_prompt, **kwargs)
    if mask is None:
        return Krea2Img2ImgPipeline.from_pipe(pipe)(prompts, **args)
    masks = list(mask.detach().float().cpu().reshape(-1, *mask.shape[-2:]))  # (H, W) each: one mask, or one per image
    return Krea2InpaintPipeline.from_pipe(pipe)(prompts, mask_image=masks, **args)


def decode_only(pipe, raw: torch.Tensor) -> tuple:
    """(IMAGE, LATENT) of raw VAE latents (B, 16, h, w) as they are (``denoise`` 0)."""
    from krea2_diffusers.latents import decode_latents, to_model_space

    vae = pipe.vae
    with torch.no_grad():
        pixels = decode_latents(vae, to_model_space(vae, raw.to(pipe._execution_device, vae.dtype)))
    return pixels.permute(0, 2, 3, 1).float().cpu(), {"samples": raw.float()[:, :, None].contiguous()}


def vae_space_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Model latents (B, 16, H/8, W/8) -> ComfyUI's LATENT for the Qwen-Image VAE: raw, (B, 16, 1, H/8, W/8)."""
    from krea2_diffusers.latents import to_vae_space

    return to_vae_space(pipe.vae, latents.to(pipe.vae.dtype)).float()[:, :, None].contiguous()


NODE_CLASS_MAPPINGS = {
    "Krea2ModelLoader": Krea2ModelLoader,
    "Krea2LoraLoader": Krea2LoraLoader,
    "Krea2Cache": Krea2Cache,
    "Krea2PromptExpander": Krea2PromptExpander,
    "Krea2StyleReference": Krea2StyleReference,
    "Krea2Sampler": Krea2Sampler,
    "Krea2ReferenceImage": Krea2ReferenceImage,
    "Krea2TextEncode": Krea2TextEncode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "Krea2ModelLoader": "Krea 2 Model Loader",
    "Krea2LoraLoader": "Krea 2 LoRA Loader",
    "Krea2Cache": "Krea 2 Cache",
    "Krea2PromptExpander": "Krea 2 Prompt Expander",
    "Krea2StyleReference": "Krea 2 Style Reference",
    "Krea2Sampler": "Krea 2 Sampler",
    "Krea2ReferenceImage": "Krea 2 Reference Image",
    "Krea2TextEncode": "Krea 2 Text Encode (references)",
}
