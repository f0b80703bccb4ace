"""``Krea2Pipeline``: text-to-image with Krea 2 RAW or Turbo.

Per generation, the text is encoded once (positive and negative prompts in one encoder call,
padded only to the longest), the transformer's timestep-independent work is prepared once,
and CFG's two branches run as one batch. Each step then costs one transformer pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from .. import sampling
from ..caching import contexts
from ..caching.contexts import cache_context
from ..conditioning.reference_images import DEFAULT_REFERENCE_MAX_PIXELS, check_reference_images
from ..conditioning.style import DEFAULT_STYLE_RESOLUTION, STYLE_MODES
from ..conditioning.text import DEFAULT_MAX_SEQUENCE_LENGTH, TAPPED_LAYERS, encode_prompts
from ..latents import PATCH_SIZE, PIXELS_PER_TOKEN, decode_latents, pack_latents, position_ids, round_to_multiple, unpack_latents
from ..loaders.lora_pipeline import Krea2LoraLoaderMixin
from ..loaders.pipeline_loading import Krea2PipelineLoadingMixin
from ..models.vae import enable_single_frame_convs
from ..presets import check_preset_name, check_reference_options, preset_for
from .prompt_inputs import prompt_list, prompt_rows, reference_inputs

logger = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class Krea2PipelineOutput(BaseOutput):
    """images: list of PIL images, (B, H, W, 3) array, (B, 3, H, W) tensor in [0, 1], or packed latents.
    expanded_prompts: the prompts actually encoded when a prompt expander ran, else None."""

    images: Any
    expanded_prompts: list[str] | None = None


class Krea2Pipeline(Krea2PipelineLoadingMixin, DiffusionPipeline, Krea2LoraLoaderMixin):
    """Krea 2 text-to-image pipeline. Loading (``from_pretrained``, ``from_single_file``): see
    :mod:`~krea2_diffusers.loaders.pipeline_loading`. LoRAs: diffusers' calls (``load_lora_weights``,
    ``set_adapters``, ``fuse_lora`` ...), see :mod:`~krea2_diffusers.loaders.lora_pipeline`.

    Args:
        scheduler: kept for diffusers-format folders; sampling follows Krea 2's schedule (see ``sampling``).
        vae: ``AutoencoderKLQwenImage``.
        text_encoder: ``Qwen3VLForConditionalGeneration`` (keeps the LM head, for prompt expansion) or ``Qwen3VLModel``.
        tokenizer: the Qwen tokenizer.
        transformer: :class:`Krea2Transformer2DModel`.
        text_encoder_select_layers: tapped ``hidden_states`` indices (default: the released 12).
        is_distilled: True for Turbo (fixed shift, 8 steps, no CFG by default).
        distilled_steps: a distilled model's own default step count (e.g. 4 for a 4-step student).
        sampler_preset: a named preset of :data:`~krea2_diffusers.presets.NAMED_PRESETS` giving the
            defaults of steps, guidance and size (``"digits"``: ``krea2-digits``); None: RAW's or Turbo's.
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer, text_encoder_select_layers=None,
                 is_distilled: bool = False, patch_size: int = PATCH_SIZE, distilled_steps: int | None = None,
                 sampler_preset: str | None = None):
        super().__init__()
        if patch_size != PATCH_SIZE:
            raise ValueError(f"Krea 2 uses patch_size={PATCH_SIZE}, got {patch_size}")
        self.register_modules(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        if vae is not None:
            enable_single_frame_convs(vae)  # images are single frames: 2-D convs, same result
        layers = tuple(text_encoder_select_layers) if text_encoder_select_layers is not None else TAPPED_LAYERS
        expected = getattr(getattr(transformer, "config", None), "num_text_layers", len(layers))
        if len(layers) != expected:
            raise ValueError(f"text_encoder_select_layers has {len(layers)} entries; the transformer reads {expected} layers")
        self.register_to_config(text_encoder_select_layers=layers, is_distilled=bool(is_distilled), patch_size=patch_size,
                                distilled_steps=distilled_steps, sampler_preset=check_preset_name(sampler_preset))
        self.label = None  # e.g. the tiny-random warning, shown by the CLI and the UIs
        # CFG runs both branches in one batch; set False to halve peak activation memory.
        self.batch_cfg = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pipe(cls, pipeline, **kwargs):
        """A pipeline of this class on ``pipeline``'s components (no copies; offload hooks kept),
        e.g. ``Krea2Img2ImgPipeline.from_pipe(pipe)``. Keyword arguments replace components or
        config values (``is_distilled`` ...). Unlike diffusers' generic version no dtype is cast."""
        components = {name: kwargs.pop(name, module) for name, module in pipeline.components.items()}
        keys = ("text_encoder_select_layers", "is_distilled", "patch_size", "distilled_steps", "sampler_preset")
        config = {key: kwargs.pop(key, getattr(pipeline.config, key, None)) for key in keys}
        if kwargs:
            raise ValueError(f"from_pipe got unknown arguments {sorted(kwargs)}")
        new = cls(**components, **config)
        new.label, new.batch_cfg = pipeline.label, pipeline.batch_cfg
        if hasattr(pipeline, "_style_cache"):
            new._style_cache = pipeline._style_cache
        new.set_progress_bar_config(**getattr(pipeline, "_progress_bar_config", {}))
        return new

    @property
    def is_distilled(self) -> bool:
        return bool(self.config.is_distilled)

    @property
    def preset(self):
        return preset_for(self.is_distilled, getattr(self.config, "distilled_steps", None),
                          getattr(self.config, "sampler_preset", None))

    # ------------------------------------------------------------------ text
    def encode_prompt(self, prompt, device=None, num_images_per_prompt: int = 1, prompt_embeds=None,
                      prompt_embeds_mask=None, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH):
        """Encode prompts: returns embeds (B * n, L, 12, 2560) and mask (B * n, L) bool.

        L is the longest prompt's token count plus the 5 suffix tokens (at most ``max_sequence_length``);
        the reference's fixed 512 padding gives the same images, so it is not materialised.
        """
        if prompt_embeds is None:
            if self.text_encoder is None:
                raise ValueError("the text encoder was released (memory.release_text_encoder); pass prompt_embeds and "
                                 "prompt_embeds_mask from encode_prompt, or reload the pipeline")
            prompts = [prompt] if isinstance(prompt, str) else prompt
            prompt_embeds, prompt_embeds_mask = encode_prompts(
                self.text_encoder, self.tokenizer, list(prompts), layers=self.config.text_encoder_select_layers,
                max_sequence_length=max_sequence_length, device=device or self._execution_device,
            )
        elif prompt_embeds_mask is None:
            raise ValueError("prompt_embeds_mask is required with prompt_embeds")
        if num_images_per_prompt > 1:
            prompt_embeds = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)
            prompt_embeds_mask = prompt_embeds_mask.repeat_interleave(num_images_per_prompt, dim=0)
        return prompt_embeds, prompt_embeds_mask.bool()

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_size(height, width) -> tuple[int, int]:
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        rounded = round_to_multiple(height), round_to_multiple(width)
        if rounded != (height, width):
            logger.warning("height and width must be multiples of %d; rounding %dx%d up to %dx%d",
                           PIXELS_PER_TOKEN, height, width, *rounded)
        return rounded

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
        attention_kwargs: dict | None = None,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        guidance_interval: tuple[float, float] | None = None,
        creativity: str | None = None,
        expansion_seed: int | None = 0,
        style_images: list | None = None,
        style_strengths: list[float] | None = None,
        style_mode: str = "reference",
        style_moodboard: bool = False,
        reference_attention: str = "joint",
        style_resolution: int | None = DEFAULT_STYLE_RESOLUTION,
        reference_images=None,
        reference_strengths: float | list[float] | None = None,
        reference_vision_tokens: bool = True,
        reference_latents: bool = True,
        reference_method: str = "index_timestep_zero",
        reference_max_pixels: int = DEFAULT_REFERENCE_MAX_PIXELS,
        image_start: sampling.ImageStart | None = None,
    ):
        """Generate images.

        Args:
            prompt / negative_prompt: text(s); the negative defaults to "" when guidance is on.
            height, width: pixels, rounded up to multiples of 16; default the preset's (1024; krea2-digits 64).
            num_inference_steps: Euler steps; default 52 (RAW) or 8 (Turbo) (krea2-digits 16).
            sigmas: custom unshifted time grid (N values in (0, 1], no final 0), diffusers-style.
            guidance_scale: CFG in Krea's convention, ``v = v_c + g (v_c - v_u)``: 0 = off. The usual
                (ComfyUI) scale is ``g + 1``. Default 3.5 (RAW) or 0 (Turbo).
            latents: initial noise, packed (B, N, 64).
            prompt_embeds / negative_prompt_embeds: (B, L, 12, 2560) with bool masks (B, L).
            output_type: "pil", "np" (B, H, W, 3), "pt" (B, 3, H, W) in [0, 1], or "latent" (packed).
            callback_on_step_end: ``fn(pipe, step, timestep, {name: tensor}) -> dict`` (may replace latents).
            attention_kwargs: ``{"scale": s}`` scales loaded LoRAs.
            guidance_interval: (low, high): apply CFG only for t in [low, high] (t = 1 is noise).
            creativity: "raw" | "low" | "medium" | "high": expand the prompts first with the text
                encoder's own LM (see :meth:`expand_prompt`); the text used is in ``output.expanded_prompts``.
            expansion_seed: seed of the expansion (default 0: the same prompt expands the same way;
                None samples a fresh one).
            style_images: up to 10 reference images (paths or PIL images) whose style steers the image.
            style_strengths: one strength >= 0 per image (default 1): an additive log(s) bias on the
                attention to that reference's tokens; 0 removes it exactly.
            style_mode: "reference" (vision tokens + reference latents; use with a style-reference
                LoRA) or "describe" (training-free: a cached VLM style description per image).
            style_moodboard: read up to 32 ``style_images`` together as ONE reference: they are tiled
                into one board image of the reference budget (constant cost), with one strength
                (default 0.35) for the whole board.
            reference_attention: "joint" (every token attends to every token, as the community
                style-reference LoRA was trained) or "cached" (reference tokens attend only among
                themselves, so their keys/values for every layer are computed once per generation).
            style_resolution: side in pixels of the area ALL reference latents share (default 512:
                512^2 px, 1024 tokens in total for any number of references); None encodes each
                reference at the target's area (the community workflow; cost grows with the count).
            reference_images, reference_strengths: up to 3 images for edit / identity / insertion LoRAs
                (not with style_images), strengths as style_strengths; reference_vision_tokens /
                reference_latents switch either entry path off; reference_method "index_timestep_zero"
                or "index"; reference_max_pixels (1024^2) caps each one's latents. See
                :mod:`~krea2_diffusers.conditioning.reference_images`.
            image_start: where sampling starts instead of noise (set by ``Krea2Img2ImgPipeline`` and
                ``Krea2InpaintPipeline``, or built directly from latents, see ``sampling.ImageStart``);
                ``latents`` is then the noise mixed in.
        """
        preset = self.preset
        steps = preset.num_inference_steps if num_inference_steps is None and sigmas is None else num_inference_steps
        if sigmas is not None:
            steps = len(sigmas)
        guidance = preset.guidance_scale if guidance_scale is None else guidance_scale
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not np.isfinite(guidance) or guidance < 0:
            raise ValueError(f"guidance_scale must be a finite number >= 0 (Krea convention, 0 = off), got {guidance_scale!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"num_inference_steps must be a positive integer, got {num_inference_steps!r}")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be a positive integer, got {num_images_per_prompt!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        bad_inputs = set(callback_on_step_end_tensor_inputs) - set(self._callback_tensor_inputs)
        if bad_inputs:
            raise ValueError(f"callback_on_step_end_tensor_inputs must be among {self._callback_tensor_inputs}, got {sorted(bad_inputs)}")
        interval = sampling.check_guidance_interval(guidance_interval)
        if style_mode not in STYLE_MODES:
            raise ValueError(f"style_mode must be one of {STYLE_MODES}, got {style_mode!r}")
        check_reference_options(reference_attention, reference_method)
        references = check_reference_images(reference_images, reference_strengths, vision_tokens=reference_vision_tokens,
                                            latents=reference_latents, max_pixels=reference_max_pixels)
        if references is not None and (style_images is not None or prompt is None):
            raise ValueError("reference_images need `prompt` text (not prompt_embeds) and no style_images")
        height, width = self._check_size(preset.resolution if height is None else height,
                                        preset.resolution if width is None else width)
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of `prompt` and `prompt_embeds`")
        device = self._execution_device
        self._interrupt = False
        do_cfg = guidance > 0

        # 1. Text (optionally expanded) and style references.
        prompts = prompt_list(prompt, "prompt")
        expanded = None
        if creativity is not None:
            if prompts is None:
                raise ValueError("creativity needs `prompt` text, not prompt_embeds")
            prompts = expanded = self.expand_prompt(prompts, creativity=creativity, seed=expansion_seed)
        batch = len(prompts) if prompts is not None else prompt_embeds.shape[0]
        negatives = prompt_list(negative_prompt if negative_prompt is not None else "", "negative_prompt", batch) if do_cfg else None
        style = self._style_batch(prompts, negatives, style_images, style_strengths, style_mode, style_moodboard,
                                  height, width, max_sequence_length, device, style_resolution, references)
        n = num_images_per_prompt
        text = prompt_rows(self, prompts, negatives, style, batch=batch, num_images_per_prompt=n, do_cfg=do_cfg,
                           prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_embeds_mask,
                           negative_prompt_embeds=negative_prompt_embeds,
                           negative_prompt_embeds_mask=negative_prompt_embeds_mask,
                           max_sequence_length=max_sequence_length, device=device)
        embeds, all_embeds, all_mask = text.embeds, text.all_embeds, text.all_mask
        total = batch * n

        # 2. Noise, positions, schedule.
        grid_h, grid_w = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
        if latents is None:
            shape = (total, self.transformer.config.in_channels // PATCH_SIZE**2, grid_h * PATCH_SIZE, grid_w * PATCH_SIZE)
            latents = pack_latents(randn_tensor(shape, generator=generator, device=device, dtype=torch.float32))
        elif latents.shape != (total, grid_h * grid_w, self.transformer.config.in_channels):
            raise ValueError(f"latents must be packed as {(total, grid_h * grid_w, self.transformer.config.in_channels)}, got {tuple(latents.shape)}")
        latents = latents.to(device=device, dtype=torch.float32)
        positions = position_ids(all_embeds.shape[1], grid_h, grid_w, device)
        positions, reference, key_bias = reference_inputs(style, positions, all_embeds.shape[0], grid_h * grid_w)
        mu = sampling.schedule_mu(grid_h * grid_w, self.is_distilled)
        times = sampling.sigma_schedule(steps, mu, sigmas)
        if image_start is not None:  # img2img / inpainting: start on the image's noised latent
            image_start = image_start.rows(batch, n)
            if image_start.image_latents.shape[1:] != latents.shape[1:]:
                raise ValueError(f"image latents have shape {tuple(image_start.image_latents.shape[1:])}, "
                                 f"a {height}x{width} image needs {tuple(latents.shape[1:])}")
            times = sampling.truncate_for_strength(times, image_start.strength)
            noise, x0 = latents, image_start.image_latents.to(device=device, dtype=torch.float32)
            repaint = None if image_start.repaint is None else image_start.repaint.to(device)
            latents = sampling.noised(x0, noise, float(times[0]))
        times = times.tolist()
        steps = len(times) - 1
        self._num_timesteps = steps

        # 3. Everything that does not change across steps, once.
        with cache_context(self.transformer, contexts.REFERENCES):  # cached references run the blocks once
            conditioning = self.transformer.prepare_conditioning(
                all_embeds.to(device), positions, all_mask.to(device), reference_hidden_states=reference, key_bias=key_bias,
                reference_attention=reference_attention, reference_method=reference_method,
                attention_kwargs=attention_kwargs,  # the per-call LoRA scale reaches text fusion and cached references too
            )
        cond_only = conditioning.select(slice(0, total)) if do_cfg else conditioning

        # 4. Euler steps.
        with self.progress_bar(total=steps) as progress:
            for i in range(steps):
                if self._interrupt:
                    break
                t, t_next = times[i], times[i + 1]
                velocity = self._velocity(latents, t, conditioning, cond_only, guidance, interval, attention_kwargs, total)
                latents = sampling.euler_step(latents, velocity, t, t_next)
                if image_start is not None and repaint is not None:
                    latents = sampling.keep_known(latents, x0, noise, repaint, t_next)
                if callback_on_step_end is not None:
                    local = {"latents": latents, "prompt_embeds": embeds}
                    outputs = callback_on_step_end(self, i, torch.tensor(t * 1000.0), {k: local[k] for k in callback_on_step_end_tensor_inputs}) or {}
                    latents = outputs.get("latents", latents)
                progress.update()

        # 5. Decode.
        self.maybe_free_model_hooks()
        if output_type == "latent":
            images = latents
        else:
            images = decode_latents(self.vae, unpack_latents(latents, height, width))
            images = self.to_output(images, output_type)
        if not return_dict:
            return (images,)
        return Krea2PipelineOutput(images=images, expanded_prompts=expanded)

    def _style_batch(self, prompts, negatives, style_images, style_strengths, mode, moodboard, height, width,
                     max_sequence_length, device, style_resolution, references=None):
        """The referenced text (prompts then negatives) and reference inputs, or None: style images,
        or checked general ``references`` (``conditioning.reference_images``)."""
        from ..conditioning.descriptions import StyleDescriptionCache
        from ..conditioning.reference_images import reference_image_batch
        from ..conditioning.style import style_image_batch

        if references is not None:
            return reference_image_batch(self, prompts + (negatives or []), references,
                                         max_sequence_length=max_sequence_length, device=device)
        if style_images is not None and not hasattr(self, "_style_cache"):
            self._style_cache = StyleDescriptionCache()
        return style_image_batch(self, prompts, negatives, style_images, style_strengths, mode=mode, moodboard=moodboard,
                                 height=height, width=width, max_sequence_length=max_sequence_length, device=device,
                                 cache=getattr(self, "_style_cache", None), style_resolution=style_resolution)

    def expand_prompt(self, prompt, creativity: str = "medium", seed: int | None = 0, max_new_tokens: int = 512, expander=None):
        """Expand short prompts with the text encoder's own Qwen3-VL LM head (no extra weights), or
        with ``expander=(model, tokenizer)``. ``creativity="raw"`` returns the prompt unchanged.
        Returns a str for a str, a list for a list."""
        from ..conditioning.expander import expand_prompts

        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        model, tokenizer = expander if expander is not None else (self.language_model(), self.tokenizer)
        out = expand_prompts(model, tokenizer, prompts, creativity=creativity, seed=seed, max_new_tokens=max_new_tokens)
        return out[0] if isinstance(prompt, str) else out

    def language_model(self):
        """The text encoder with its LM head (prompt expansion, style descriptions). A bare
        ``Qwen3VLModel`` gets the head wrapped around it once, sharing every weight (see
        :func:`~krea2_diffusers.conditioning.expander.with_lm_head`)."""
        from ..conditioning.expander import with_lm_head

        if self.text_encoder is None:
            raise ValueError("the text encoder was released (memory.release_text_encoder); reload the pipeline to expand prompts")
        cached = getattr(self, "_language_model", None)
        if cached is None or cached[0] is not self.text_encoder:
            folder = self.config.get("_name_or_path") if hasattr(self.config, "get") else None
            cached = self._language_model = (self.text_encoder, with_lm_head(self.text_encoder, folder))
        return cached[1]

    def _velocity(self, latents, t, conditioning, cond_only, guidance, interval, attention_kwargs, total):
        """The (guided) velocity (B, N, 64) at time t; one transformer pass when CFG is batched."""
        timestep = torch.full((total,), t, device=latents.device, dtype=torch.float32)

        def run(x, cond, ts, context):  # context: the diffusers cache state this layout uses (caching.contexts)
            with cache_context(self.transformer, context):
                return self.transformer(x, timestep=ts, conditioning=cond, attention_kwargs=attention_kwargs, return_dict=False)[0].float()

        if not sampling.guidance_active(t, guidance, interval):
            return run(latents, cond_only, timestep, contexts.CONDITIONAL)
        if self.batch_cfg:
            both = run(torch.cat([latents, latents]), conditioning, torch.cat([timestep, timestep]), contexts.BATCHED_CFG)
            cond, uncond = both.chunk(2)
        else:
            cond = run(latents, cond_only, timestep, contexts.CONDITIONAL)
            uncond = run(latents, conditioning.select(slice(total, 2 * total)), timestep, contexts.UNCONDITIONAL)
        return sampling.guided_velocity(cond, uncond, guidance)

    @property
    def interrupt(self) -> bool:
        return getattr(self, "_interrupt", False)

    @property
    def num_timesteps(self) -> int:
        return getattr(self, "_num_timesteps", 0)

    @staticmethod
    def to_output(images: torch.Tensor, output_type: str):
        if output_type == "pt":
            return images
        array = images.permute(0, 2, 3, 1).cpu().numpy()
        if output_type == "np":
            return array
        return [PIL.Image.fromarray((a * 255).round().astype(np.uint8)) for a in array]

    def enable_memory_preset(self, memory: str = "auto", device=None) -> str:
        """Fit the pipeline into a memory budget (``auto``, ``high``, ``24gb``, ``16gb``, ``12gb``,
        ``8gb``): model or group offload (the text encoder then waits on the CPU between prompts, it
        is never dropped), fp8/NF4 storage. Returns what was chosen, the text encoder's place
        included. To drop the text encoder after encoding prompts, see ``pipelines.memory.release_text_encoder``."""
        from .memory import apply_memory_preset

        return apply_memory_preset(self, memory, device=device)
