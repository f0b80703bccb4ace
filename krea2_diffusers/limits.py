"""Limits and input checks for serving Krea 2 to people (a web demo, an HTTP API): what a request
may ask for, size presets, and friendly refusals before any model work. UI-free; the Gradio demo
(``app.py``) builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    cache: str = "none"  # a step-cache preset (krea2_diffusers.presets.CACHE_METHODS)
    cache_threshold: float | None = None  # None: the preset's
    guidance_interval: tuple[float, float] | None = None  # CFG only while t is in [low, high]; None: every step


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
    check_speed_options(request)
    return width, height


def check_speed_options(request: Request) -> None:
    """The step cache and guidance interval of a request (see ``krea2_diffusers.caching``)."""
    from .presets import CACHE_METHODS
    from .sampling import check_guidance_interval

    if request.cache not in CACHE_METHODS:
        raise InputError(f"Cache must be one of {', '.join(CACHE_METHODS)}.")
    if request.cache_threshold is not None and not 0 <= float(request.cache_threshold) <= 100:
        raise InputError("The cache threshold must be between 0 and 100 (empty: the preset's).")
    try:
        check_guidance_interval(request.guidance_interval)
    except ValueError:
        raise InputError("The guidance interval needs 0 <= low <= high <= 1.") from None
