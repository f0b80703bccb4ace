"""What the Gradio demo (``app.py``) does, without Gradio: input limits, size presets, loading the
Turbo / RAW pipelines, one generation (with prompt expansion and style references) and the settings
it records in its PNG.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .files import split_path_and_number
from .metadata import save_png
from .presets import looks_distilled, preset_for
from .tiny import is_tiny

CREATIVITY = ("raw", "low", "medium", "high")
STYLE_MODES = ("describe", "reference")  # describe needs no LoRA; reference wants the style-reference LoRA
MAX_SEED = 2**32 - 1
GUIDANCE_CONVENTION = "krea (standard = value + 1)"
# Multiples of 16 (the VAE's 8 x the 2x2 patch), about 1 and 2 megapixels.
SIZE_PRESETS = {
    "1:1 · 1024×1024": (1024, 1024),
    "4:3 · 1152×864": (1152, 864),
    "3:4 · 864×1152": (864, 1152),
    "3:2 · 1248×832": (1248, 832),
    "2:3 · 832×1248": (832, 1248),
    "16:9 · 1360×768": (1360, 768),
    "9:16 · 768×1360": (768, 1360),
    "1:1 · 1536×1536": (1536, 1536),
    "1:1 · 2048×2048": (2048, 2048),
}
# Offered only with tiny-random, whose random weights make big images pointless.
TEST_SIZE_PRESETS = {"test · 64×64": (64, 64), "test · 128×96": (128, 96)}


class InputError(ValueError):
    """A request the demo refuses; the message is shown to the user as is."""


@dataclass(frozen=True)
class Limits:
    max_side: int = 2048
    max_steps: int = 100
    max_guidance: float = 20.0
    max_references: int = 4
    max_prompt_chars: int = 2000
    max_expansion_tokens: int = 512  # longest prompt expansion (creativity other than raw)


@dataclass
class Request:
    """One generation, as the UI or the ``/generate`` API asks for it."""

    prompt: str
    negative_prompt: str = ""
    variant: str = "Turbo"
    size: str = "1:1 · 1024×1024"
    steps: int | None = None  # None: the variant's preset
    guidance: float | None = None  # Krea convention, 0 = off; None: the variant's preset
    seed: int = 0
    creativity: str = "raw"
    style_images: list = field(default_factory=list)
    style_strengths: list[float] = field(default_factory=list)
    style_mode: str = "describe"


@dataclass
class Result:
    image: object  # PIL image
    png_path: Path  # the image with its settings in PNG text chunks
    settings: dict
    expanded_prompt: str | None


def parse_lora(spec: str) -> tuple[str, float]:
    """``"path"`` or ``"path:strength"`` -> (path, strength), as ``--lora`` takes it."""
    return split_path_and_number(spec, 1.0)


def random_seed() -> int:
    return random.randint(0, MAX_SEED)


def check(request: Request, limits: Limits, sizes: dict, variants) -> tuple[int, int]:
    """Refuse bad input with a friendly message before any model work; returns (width, height)."""
    prompt = (request.prompt or "").strip()
    if not prompt:
        raise InputError("Please enter a prompt.")
    for name, text in (("prompt", request.prompt), ("negative prompt", request.negative_prompt or "")):
        if len(text) > limits.max_prompt_chars:
            raise InputError(f"The {name} is {len(text)} characters long; the limit is {limits.max_prompt_chars}.")
    if request.variant not in variants:
        raise InputError(f"Model {request.variant!r} is not loaded here; choose one of {', '.join(variants)}.")
    if request.size not in sizes:
        raise InputError(f"Unknown size {request.size!r}; choose one of: {', '.join(sizes)}.")
    width, height = sizes[request.size]
    if max(width, height) > limits.max_side:
        raise InputError(f"{width}×{height} is too large for this server (at most {limits.max_side} pixels a side).")
    if request.steps is not None and not 1 <= int(request.steps) <= limits.max_steps:
        raise InputError(f"Steps must be between 1 and {limits.max_steps}.")
    if request.guidance is not None and not 0 <= float(request.guidance) <= limits.max_guidance:
        raise InputError(f"Guidance must be between 0 (off) and {limits.max_guidance}.")
    if not 0 <= int(request.seed) <= MAX_SEED:
        raise InputError(f"The seed must be between 0 and {MAX_SEED}.")
    if request.creativity not in CREATIVITY:
        raise InputError(f"Creativity must be one of {', '.join(CREATIVITY)}.")
    if len(request.style_images) != len(request.style_strengths):
        raise InputError("Give each style reference image exactly one strength.")
    if len(request.style_images) > limits.max_references:
        raise InputError(f"At most {limits.max_references} style references, please (got {len(request.style_images)}).")
    if any(not 0 <= float(s) for s in request.style_strengths):
        raise InputError("Style reference strengths must be 0 or more.")
    if request.style_images and request.style_mode not in STYLE_MODES:
        raise InputError(f"Style mode must be one of {', '.join(STYLE_MODES)}.")
    return width, height


class Demo:
    """The demo's models (Turbo and/or RAW) and generation.

    Args:
        models: variant label ("Turbo", "RAW") -> model (``tiny-random``, a diffusers folder or hub id,
            or a ``.safetensors``/``.gguf`` transformer file).
        load: ``load(model, is_distilled) -> pipeline``.
        output_dir: where the PNGs with settings are written (the newest ``keep_files`` are kept).
    """

    def __init__(self, models: dict[str, str], load, output_dir, limits: Limits = Limits(), keep_files: int = 200):
        self.models, self._load, self.limits = dict(models), load, limits
        self.output_dir, self.keep_files = Path(output_dir), keep_files
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.tiny = all(is_tiny(m) for m in self.models.values())
        offered = {**(TEST_SIZE_PRESETS if self.tiny else {}), **SIZE_PRESETS}
        self.sizes = {name: size for name, size in offered.items() if max(size) <= limits.max_side}
        # Real checkpoints are large: keep one loaded at a time (tiny-random: both).
        self._max_loaded = len(self.models) if self.tiny else 1
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()

    @staticmethod
    def variants_for(model: str, raw_model: str | None = None, is_distilled: bool | None = None) -> dict[str, str]:
        """The UI's model choices: with ``raw_model``, ``model`` is the Turbo; alone, tiny-random is offered
        as both and a real model as what ``is_distilled`` (default: its name) says it is."""
        if raw_model is not None:
            return {"Turbo": model, "RAW": raw_model}
        if is_tiny(model) and is_distilled is None:
            return {"Turbo": model, "RAW": model}
        turbo = looks_distilled(model) if is_distilled is None else is_distilled
        return {("Turbo" if turbo else "RAW"): model}

    def preset(self, variant: str):
        return preset_for(variant == "Turbo")

    def label(self) -> str:
        pipe = next(iter(self._loaded.values()), None)
        return getattr(pipe, "label", None) or ", ".join(f"{v}: {m}" for v, m in self.models.items())

    def pipeline(self, variant: str):
        with self._lock:
            if variant not in self._loaded:
                while len(self._loaded) >= self._max_loaded:
                    self._loaded.pop(next(iter(self._loaded)))
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                self._loaded[variant] = self._load(self.models[variant], variant == "Turbo")
            return self._loaded[variant]

    def generate(self, request: Request, progress=None) -> Result:
        """Run one request. ``progress(step, total, what="Sampling")`` is called after every step."""
        width, height = check(request, self.limits, self.sizes, self.models)
        pipe = self.pipeline(request.variant)
        preset = pipe.preset
        steps = int(request.steps) if request.steps is not None else preset.num_inference_steps
        guidance = float(request.guidance) if request.guidance is not None else preset.guidance_scale
        prompt, expanded, extra = request.prompt, None, {}
        if request.creativity != "raw":  # what pipe(creativity=...) does, with our token limit
            if progress is not None:
                progress(0, steps, "Expanding the prompt")
            prompt = expanded = pipe.expand_prompt(request.prompt, creativity=request.creativity, seed=int(request.seed),
                                                   max_new_tokens=self.limits.max_expansion_tokens)
        if request.style_images:
            extra.update(style_images=list(request.style_images), style_strengths=[float(s) for s in request.style_strengths],
                         style_mode=request.style_mode)

        def on_step(pipeline, step, timestep, tensors):
            if progress is not None:
                progress(step + 1, steps)
            return tensors

        output = pipe(prompt, negative_prompt=request.negative_prompt or "", width=width, height=height,
                      num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(int(request.seed)), callback_on_step_end=on_step, **extra)
        image = output.images[0]
        settings = {
            "prompt": request.prompt, "negative_prompt": request.negative_prompt or "", "seed": int(request.seed),
            "steps": steps, "guidance_scale": guidance, "guidance_convention": GUIDANCE_CONVENTION,
            "width": image.width, "height": image.height, "model": getattr(pipe, "label", None) or self.models[request.variant],
            "variant": request.variant,
        }
        if request.creativity != "raw":
            settings.update(creativity=request.creativity, expanded_prompt=expanded)
        if request.style_images:
            settings.update(style_strengths=[float(s) for s in request.style_strengths], style_mode=request.style_mode)
        return Result(image, self._save(image, settings), settings, expanded)

    def _save(self, image, settings: dict) -> Path:
        path = self.output_dir / f"krea2-{time.strftime('%Y%m%d-%H%M%S')}-{settings['seed']}-{time.monotonic_ns() % 10**6}.png"
        save_png(image, path, settings)
        old = sorted(self.output_dir.glob("krea2-*.png"), key=lambda p: p.stat().st_mtime)[:-self.keep_files]
        for stale in old:
            stale.unlink(missing_ok=True)
        return path
