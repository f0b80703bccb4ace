"""PNG files that carry their generation settings, as ComfyUI / A1111 users expect."""

from __future__ import annotations

import io
import json

from PIL import Image, PngImagePlugin

from .files import atomic_write

# Text chunks written, besides one chunk per setting.
PARAMETERS_KEY = "parameters"  # A1111-style one-line summary
SETTINGS_KEY = "krea2"  # JSON of all settings


def lora_entries(loras) -> list[dict]:
    """The ``loras`` setting of an image: ``[(file, strength), ...]`` -> ``[{"file", "strength"}, ...]``.

    "file", not "path": gradio reads a ``{"path": ...}`` dict in a JSON output as a file to serve (the app's
    server copied the LoRA into its cache and the API client downloaded it, dropping the strength)."""
    return [{"file": str(file), "strength": float(strength)} for file, strength in loras]


def a1111_parameters(settings: dict) -> str:
    """``prompt\\nNegative prompt: ...\\nSteps: 8, CFG scale: 1.0, Seed: 1, Size: 1024x1024, Model: x``.

    A1111's "CFG scale" is the standard convention, so it is Krea's guidance + 1.
    """
    lines = [settings.get("prompt", "")]
    if settings.get("negative_prompt"):
        lines.append(f"Negative prompt: {settings['negative_prompt']}")
    fields = []
    if "steps" in settings:
        fields.append(f"Steps: {settings['steps']}")
    if "guidance_scale" in settings:
        fields.append(f"CFG scale: {float(settings['guidance_scale']) + 1:g}")
    if "seed" in settings:
        fields.append(f"Seed: {settings['seed']}")
    if "width" in settings and "height" in settings:
        fields.append(f"Size: {settings['width']}x{settings['height']}")
    if "model" in settings:
        fields.append(f"Model: {settings['model']}")
    lines.append(", ".join(fields))
    return "\n".join(lines)


def png_bytes(image: Image.Image, settings: dict) -> bytes:
    info = PngImagePlugin.PngInfo()
    for key, value in settings.items():
        info.add_itxt(key, value if isinstance(value, str) else json.dumps(value))
    info.add_itxt(PARAMETERS_KEY, a1111_parameters(settings))
    info.add_itxt(SETTINGS_KEY, json.dumps(settings, sort_keys=True))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def save_png(image: Image.Image, path, settings: dict) -> None:
    """Atomically write ``image`` with one text chunk per setting plus ``parameters`` and ``krea2``."""
    data = png_bytes(image, settings)
    with atomic_write(path) as handle:
        handle.write(data)


def read_settings(path) -> dict:
    """The settings stored by :func:`save_png`."""
    with Image.open(path) as image:
        return json.loads(image.text[SETTINGS_KEY])
