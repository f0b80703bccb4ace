"""Sample images during training: RAW with CFG, and Turbo with the current LoRA when configured."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import TrainConfig
from .engine.parallel import gathered
from .engine.runtime import Runtime


class Validator:
    def __init__(self, config: TrainConfig, pipe, runtime: Runtime, out_dir: Path):
        self.config = config
        self.pipe = pipe
        self.runtime = runtime
        self.out_dir = out_dir
        self._turbo = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.validation.prompts)

    def due(self, step: int) -> bool:
        every = self.config.validation.every_n_steps
        return self.enabled and every > 0 and step % every == 0

    def _sample(self, pipe, steps: int, guidance: float):
        v = self.config.validation
        generators = [torch.Generator().manual_seed(v.seed + i) for i in range(len(v.prompts))]
        if v.reference_images:  # paired training: each prompt with its own references
            return [self._referenced(pipe, prompt, refs, steps, guidance, generator)
                    for prompt, refs, generator in zip(v.prompts, v.reference_images, generators)]
        return pipe(
            v.prompts, negative_prompt=v.negative_prompt if guidance > 0 else None, height=v.height, width=v.width,
            num_inference_steps=steps, guidance_scale=guidance, generator=generators, output_type="pil",
        ).images

    def _referenced(self, pipe, prompt: str, references: list[str], steps: int, guidance: float, generator):
        """One sample of an edit / reference LoRA: its references and the output side by side."""
        from krea2_diffusers.conditioning.references import load_reference_images

        v, pairs = self.config.validation, self.config.data.references
        image = pipe(
            prompt, negative_prompt=v.negative_prompt if guidance > 0 else None, height=v.height, width=v.width,
            num_inference_steps=steps, guidance_scale=guidance, generator=generator, output_type="pil",
            reference_images=references, reference_vision_tokens=pairs.vision_tokens, reference_latents=pairs.latents,
            reference_max_pixels=pairs.max_pixels,
            reference_attention="cached" if self.config.training.reference_kv_cache else "joint",
        ).images[0]
        return side_by_side(load_reference_images(references, what="validation reference image") + [image])

    def run(self, model: torch.nn.Module, step: int, metrics, lora_layers=None) -> list[Path]:
        """Every process must call this, at the same step; the main one samples and saves.

        A sharded model (FSDP) gathers its parameters collectively, so there every process runs
        the same RAW sampling in lockstep (same prompts, same seeds) and all but the main one drop
        their images. Otherwise (one process, DDP) and for the Turbo sample, only the main process
        samples while the others wait at a barrier. ``lora_layers``: the trained adapter, gathered
        by every process (a collective under FSDP) but whole on the main one only.
        """
        v, runtime = self.config.validation, self.runtime
        samples = runtime.is_main or runtime.strategy == "fsdp"
        images = {}
        if samples:
            model.eval()
            encoders = [self.pipe.text_encoder, self.pipe.vae]
            homes = [next(m.parameters()).device for m in encoders]
            for module in encoders:
                module.to(runtime.device)  # offloaded during training on GPUs
            try:
                with torch.no_grad(), gathered(model, runtime):
                    images["raw"] = self._sample(self.pipe, v.num_inference_steps, v.guidance_scale)
                if runtime.is_main and lora_layers is not None and self.config.model.turbo_model_name_or_path:
                    images["turbo"] = self._sample(self._turbo_with(lora_layers), v.turbo_num_inference_steps, 0.0)
            finally:
                model.train()
                for module, home in zip(encoders, homes):
                    module.to(home)
        saved = []
        if runtime.is_main:
            folder = self.out_dir / "samples" / f"step-{step:06d}"
            folder.mkdir(parents=True, exist_ok=True)
            for kind, batch in images.items():
                for i, image in enumerate(batch):
                    path = folder / f"{kind}-{i:02d}.png"
                    image.save(path)
                    saved.append(path)
                metrics.add_images(f"samples/{kind}", batch, step)
        runtime.barrier()
        return saved

    def _turbo_with(self, lora_layers):
        from krea2_diffusers.loaders.lora import apply_lora_layers, delete_lora

        from .model import load_turbo_pipeline

        if self._turbo is None:
            self._turbo = load_turbo_pipeline(self.config.model.turbo_model_name_or_path, self.pipe, self.config.model.dtype)
        transformer = self._turbo.transformer
        if "validation" in (getattr(transformer, "peft_config", None) or {}):
            delete_lora(transformer, "validation")
        apply_lora_layers(transformer, lora_layers, adapter_name="validation")
        return self._turbo


def side_by_side(images: list) -> "PIL.Image.Image":
    """The images left to right in one RGB image, each scaled to the last one's height (aspect kept)."""
    import PIL.Image

    height = images[-1].height
    scaled = [im if im.height == height else im.resize((max(1, round(im.width * height / im.height)), height)) for im in images]
    sheet = PIL.Image.new("RGB", (sum(im.width for im in scaled), height))
    left = 0
    for im in scaled:
        sheet.paste(im.convert("RGB"), (left, 0))
        left += im.width
    return sheet
