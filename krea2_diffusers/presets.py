"""Sampler defaults of the two released checkpoints, and of the packaged ``krea2-digits`` model."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplerPreset:
    name: str
    num_inference_steps: int
    guidance_scale: float  # Krea convention: 0 = off; standard convention = guidance_scale + 1
    is_distilled: bool
    resolution: int = 1024  # default height and width in pixels


RAW = SamplerPreset("raw", num_inference_steps=52, guidance_scale=3.5, is_distilled=False)
TURBO = SamplerPreset("turbo", num_inference_steps=8, guidance_scale=0.0, is_distilled=True)
# krea2-digits (krea2_diffusers.models.digits): the proving ground's sampling of its base (64 px, 16 Euler steps, CFG 3).
DIGITS = SamplerPreset("digits", num_inference_steps=16, guidance_scale=3.0, is_distilled=False, resolution=64)
# Presets a model folder may name in its model_index.json (``sampler_preset``).
NAMED_PRESETS = {preset.name: preset for preset in (RAW, TURBO, DIGITS)}

# How style-reference tokens attend (see ``models.transformer.Krea2Transformer2DModel.prepare_conditioning``):
# "joint" (to every token, as the community LoRA was trained) or "cached" (only among themselves).
REFERENCE_ATTENTION = ("joint", "cached")
# How reference tokens are modulated, as ComfyUI's Kontext reference methods name it:
# "index_timestep_zero" (reference k at RoPE (k, i, j), modulated as timestep 0, ComfyUI's native Krea 2
# with ``ref_latents``) or "index" (same positions, modulated with the step's own timestep).
REFERENCE_METHODS = ("index_timestep_zero", "index")


def check_reference_options(reference_attention: str, reference_method: str) -> None:
    """Refuse unknown values, and "cached" attention with the "index" method (whose reference
    keys/values change every step)."""
    if reference_attention not in REFERENCE_ATTENTION:
        raise ValueError(f"reference_attention must be one of {REFERENCE_ATTENTION}, got {reference_attention!r}")
    if reference_method not in REFERENCE_METHODS:
        raise ValueError(f"reference_method must be one of {REFERENCE_METHODS}, got {reference_method!r}")
    if reference_method == "index" and reference_attention == "cached":
        raise ValueError('reference_method="index" modulates the references with each step\'s timestep, so their '
                         'keys/values cannot be cached: use reference_attention="joint"')

# The memory knob's values (see ``pipelines.memory.apply_memory_preset``), here so the CLI needs no torch to list them.
MEMORY_PRESETS = ("auto", "high", "24gb", "16gb", "12gb", "8gb")

# The step-cache knob's values (``krea2 generate --cache``; see ``caching.presets``): diffusers' hooks
# (First-Block Cache, TaylorSeer, MagCache) or cache-dit's DBCache; here so the CLI needs no torch to list them.
CACHE_METHODS = ("none", "fbcache", "taylorseer", "magcache", "dbcache")

# Substrings of a checkpoint's file or folder name that mark the distilled release.
DISTILLED_NAME_MARKERS = ("turbo", "tdm", "distill")


# Keys a distilled export records in its safetensors header, so it is recognised whatever its name.
DISTILLED_METADATA_KEY = "krea2.is_distilled"
STEPS_METADATA_KEY = "krea2.num_inference_steps"


def check_preset_name(name: str | None) -> str | None:
    """``name`` when it is None or one of :data:`NAMED_PRESETS`, else a ValueError listing them."""
    if name is not None and name not in NAMED_PRESETS:
        raise ValueError(f"sampler_preset must be one of {sorted(NAMED_PRESETS)} (or null), got {name!r}")
    return name


def preset_for(is_distilled: bool, distilled_steps: int | None = None, name: str | None = None) -> SamplerPreset:
    """The preset a model folder names (``name``, e.g. ``"digits"``) when it agrees with ``is_distilled``
    (a RAW-style one used as Turbo gets Turbo's); else RAW's or Turbo's defaults, a distilled model with
    its own step count (e.g. a 4-step student) getting Turbo's at that count."""
    if name is not None and NAMED_PRESETS[check_preset_name(name)].is_distilled == bool(is_distilled):
        return NAMED_PRESETS[name]
    if is_distilled and distilled_steps:
        return replace(TURBO, num_inference_steps=int(distilled_steps))
    return TURBO if is_distilled else RAW


def distillation_from_metadata(metadata: dict[str, str]) -> tuple[bool | None, int | None]:
    """(is_distilled, step count) recorded in a file's metadata; (None, None) when it says nothing."""
    flag = str(metadata.get(DISTILLED_METADATA_KEY, "")).lower()
    if flag not in ("true", "false"):
        return None, None
    steps = metadata.get(STEPS_METADATA_KEY)
    return flag == "true", int(steps) if steps and str(steps).isdigit() else None


def looks_distilled(name: str) -> bool:
    """Guess from a file/repo name whether it is the Turbo release (callers can override)."""
    lowered = str(name).lower()
    return any(marker in lowered for marker in DISTILLED_NAME_MARKERS)
