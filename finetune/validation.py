"""Sample images during training: RAW with CFG, and Turbo with the current LoRA when configured."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .engine.parallel import gathered, unwrap
from .engine.runtime import Runtime

logger = logging.getLogger("finetune")

REPORT_BATCH = 8
"""The report's samples go through the pipeline this many at a time (one call per chunk)."""


class Validator:
    def __init__(self, config: TrainConfig, pipe, runtime: Runtime, out_dir: Path, report=None):
        """``report``: the run's :class:`~finetune.report.collector.ReportCollector` (None: no metrics)."""
        self.config = config
        self.pipe = pipe
        self.runtime = runtime
        self.out_dir = out_dir
        self.report = report
        self._turbo = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.validation.prompts)

    def due(self, step: int) -> bool:
        return self.enabled and self.config.validation.due(step)

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

    def _sample_pairs(self, pairs) -> list:
        """The RAW model's samples of the report's (prompt, copy) pairs, in their order."""
        v, plan = self.config.validation, self.report.plan
        images = []
        for start in range(0, len(pairs), REPORT_BATCH):
            chunk = pairs[start:start + REPORT_BATCH]
            generators = [torch.Generator().manual_seed(plan.seed_of(prompt, copy)) for prompt, copy in chunk]
            images += self.pipe(
                [prompt.text for prompt, _ in chunk], negative_prompt=v.negative_prompt if v.guidance_scale > 0 else None,
                height=v.height, width=v.width, num_inference_steps=v.num_inference_steps, guidance_scale=v.guidance_scale,
                generator=generators, output_type="pil",
            ).images
        return images

    @contextlib.contextmanager
    def _sampling(self, model: torch.nn.Module):
        """The model in eval mode and the encoders on the device (offloaded during training on GPUs)."""
        encoders = [self.pipe.text_encoder, self.pipe.vae]
        homes = [next(m.parameters()).device for m in encoders]
        model.eval()
        for module in encoders:
            module.to(self.runtime.device)
        try:
            yield
        finally:
            model.train()
            for module, home in zip(encoders, homes):
                module.to(home)

    def sample_base(self, model: torch.nn.Module, lora: bool, start_step: int) -> None:
        """Before the first step, every process: the base model's samples of the report, once per run
        (kept in the run folder). A LoRA run samples with its adapters off, so a resumed run can make
        them too; a resumed full fine-tune no longer holds its base and goes without (no leak)."""
        runtime = self.runtime
        if self.report is None or not runtime.any(runtime.is_main and not self.report.has_base()):
            return
        if not lora and start_step > 0:
            if runtime.is_main:
                logger.warning("report: a resumed full fine-tune cannot sample its base model; leak is not measured")
            return
        images, started = None, time.perf_counter()
        if runtime.is_main or runtime.strategy == "fsdp":
            adapters = unwrap(model) if lora else None
            with self._sampling(model), torch.no_grad(), gathered(model, runtime):
                if adapters is not None:
                    adapters.disable_adapters()
                try:
                    images = self._sample_pairs(self.report.plan.base_samples())
                finally:
                    if adapters is not None:
                        adapters.enable_adapters()
        if runtime.is_main:
            self.report.save_base(images)
            logger.info("report: %d base-model samples in %.1f s", len(images), time.perf_counter() - started)
        runtime.barrier()

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
            with self._sampling(model):
                with torch.no_grad(), gathered(model, runtime):
                    images["raw"] = self._sample(self.pipe, v.num_inference_steps, v.guidance_scale)
                    started = time.perf_counter()
                    extra = self._sample_pairs(self.report.plan.extra_samples()) if self.report is not None else []
                    extra_seconds = time.perf_counter() - started
                if runtime.is_main and lora_layers is not None and self.config.model.turbo_model_name_or_path:
                    images["turbo"] = self._sample(self._turbo_with(lora_layers), v.turbo_num_inference_steps, 0.0)
                if runtime.is_main and self.report is not None:  # while the vision tower is on the device
                    self.report.measure(step, images["raw"], extra, self.pipe, runtime.device, extra_seconds)
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
