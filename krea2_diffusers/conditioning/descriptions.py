"""Training-free style references: the VLM's content-free style description of an image, cached.

Each description later enters the transformer as its own group of text tokens (``style.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import PIL.Image
import torch

from .references import (
    IMAGE_PAD, REFERENCE_MAX_PIXELS, one_image, takes_token_types, token_id, to_rgb, vision_block, vision_inputs,
)
from .text import base_text_model

logger = logging.getLogger(__name__)

# Our instruction for a content-free style description; "content-free" so the reference lends its look,
# not its subjects, to the new image.
DESCRIBE_STYLE_INSTRUCTION = (
    "You are an art director describing the visual style of a reference image so that another image can be made "
    "in the same style. Describe only how it looks, never what it shows: do not name or describe any object, "
    "person, animal, place or text in it. Cover the medium and technique, the colour palette, the lighting, the "
    "textures and brushwork or grain, the era or art movement it evokes, and the composition and framing. "
    "Answer with one paragraph of plain sentences, no lists, no markdown."
)
DESCRIBE_STYLE_REQUEST = "Describe the style of this image."
DESCRIPTION_MAX_NEW_TOKENS = 160
# Descriptions should be stable rather than inventive: sample cool.
_DESCRIPTION_SAMPLING = dict(temperature=0.3, top_k=20, top_p=0.9, repetition_penalty=1.05)


def describe_style(model, tokenizer, image, seed: int | None = 0, max_new_tokens: int = DESCRIPTION_MAX_NEW_TOKENS,
                   *, max_pixels: int = REFERENCE_MAX_PIXELS) -> str:
    """The VLM's content-free description of ``image``'s style (medium, palette, lighting, texture, era,
    composition), one paragraph; reproducible for a seed; the global RNG is untouched.

    Args:
        model: a Qwen2-VL/Qwen3-VL model with its LM head (e.g. the pipeline's text encoder).
        image: anything :func:`load_reference_images` accepts (one image).
    Returns:
        The cleaned description ("" if the model produced nothing usable).
    """
    return describe_image(model, tokenizer, image, DESCRIBE_STYLE_INSTRUCTION, DESCRIBE_STYLE_REQUEST, seed=seed,
                          max_new_tokens=max_new_tokens, max_pixels=max_pixels)


def describe_image(model, tokenizer, image, instruction: str, request: str, seed: int | None = 0,
                   max_new_tokens: int = DESCRIPTION_MAX_NEW_TOKENS, *, max_pixels: int = REFERENCE_MAX_PIXELS,
                   sampling: dict | None = None) -> str:
    """What a Qwen-VL model with its LM head writes about ``image`` given a system ``instruction``
    and a user ``request`` (the image comes first in the user turn); cleaned to one paragraph.

    Style descriptions and curation captions both go through here. ``sampling`` overrides the
    (cool) default sampling settings; the global RNG is untouched.
    """
    from .expander import chat_input_ids, clean_generated_text, sample_text

    picture = one_image(image)
    config = getattr(model, "config", None)
    image_token = token_id(tokenizer, IMAGE_PAD, getattr(config, "image_token_id", None))
    pixel_values, grid, tokens = vision_inputs(model, [picture], max_pixels)
    messages = [
        {"role": "system", "content": instruction},
        {"role": "user", "content": vision_block(tokens[0]) + request},
    ]
    input_ids = chat_input_ids(tokenizer, messages)
    device = next(model.parameters()).device
    token_types = (torch.tensor([input_ids], device=device) == image_token).int()
    kwargs = dict(do_sample=True, max_new_tokens=max_new_tokens, **(sampling or _DESCRIPTION_SAMPLING))
    if getattr(getattr(model, "generation_config", None), "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        kwargs["pad_token_id"] = tokenizer.pad_token_id
    if getattr(getattr(model, "generation_config", None), "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
        kwargs["eos_token_id"] = tokenizer.eos_token_id
    vision = dict(pixel_values=pixel_values.to(device), image_grid_thw=grid.to(device))
    if takes_token_types(base_text_model(model).get_rope_index):
        vision["mm_token_type_ids"] = token_types
    raw = sample_text(model, tokenizer, input_ids, kwargs, seed, **vision)
    return clean_generated_text(raw, tuple(getattr(tokenizer, "all_special_tokens", ())))


def image_content_hash(image: PIL.Image.Image) -> str:
    """sha256 of an image's RGB pixels and size: equal for equal content, whatever file it came from."""
    rgb = to_rgb(image)
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def model_fingerprint(model) -> str:
    """Identify a model cheaply: class, name or path, and a hash of a few embedding rows (two random
    models with the same empty name must not share descriptions)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    digest = hashlib.sha256(f"{type(model).__name__}:{name}".encode())
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        digest.update(embeddings.weight[:4].detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# Changing the instruction or sampling invalidates cached descriptions.
_INSTRUCTION_VERSION = hashlib.sha256(
    (DESCRIBE_STYLE_INSTRUCTION + DESCRIBE_STYLE_REQUEST + repr(_DESCRIPTION_SAMPLING)).encode()
).hexdigest()[:12]
STYLE_CACHE_FILE = "style_descriptions.json"


class StyleDescriptionCache:
    """Style descriptions cached per image content (and model, seed, length, instruction version).

    In memory by default; with ``path`` (or :meth:`on_disk`) also persisted as one JSON file, written
    atomically and merged with what other processes wrote meanwhile. ``hits`` and ``misses`` count lookups.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.hits = 0
        self.misses = 0
        self._entries: dict[str, str] = {}
        self._loaded = self.path is None

    @classmethod
    def on_disk(cls, path: str | os.PathLike | None = None) -> "StyleDescriptionCache":
        """A persistent cache; default file ``style_descriptions.json`` under :func:`tokenizer.cache_dir`."""
        from .tokenizer import cache_dir

        return cls(path if path is not None else cache_dir() / STYLE_CACHE_FILE)

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def _read_file(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            logger.warning("ignoring unreadable style description cache %s (%s)", self.path, err)
            return {}
        if not isinstance(data, dict):
            logger.warning("ignoring style description cache %s: not a JSON object", self.path)
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}

    def _load(self) -> None:
        if not self._loaded:
            self._entries = {**self._read_file(), **self._entries}
            self._loaded = True

    def _save(self) -> None:
        from ..files import atomic_write

        merged = {**self._read_file(), **self._entries}
        with atomic_write(self.path, "w") as handle:
            json.dump(merged, handle, ensure_ascii=False, indent=0, sort_keys=True)
        self._entries = merged

    @staticmethod
    def key(model, image: PIL.Image.Image, seed, max_new_tokens: int, max_pixels: int) -> str:
        return f"{image_content_hash(image)}|{model_fingerprint(model)}|{_INSTRUCTION_VERSION}|{seed}|{max_new_tokens}|{max_pixels}"

    def describe(self, model, tokenizer, image, seed: int = 0, max_new_tokens: int = DESCRIPTION_MAX_NEW_TOKENS,
                 *, max_pixels: int = REFERENCE_MAX_PIXELS) -> str:
        """:func:`describe_style`, computed once per (image content, model, seed, length)."""
        if seed is None:
            raise ValueError("cached style descriptions need a fixed seed (None would make every call differ)")
        picture = one_image(image)
        key = self.key(model, picture, seed, max_new_tokens, max_pixels)
        self._load()
        if key in self._entries:
            self.hits += 1
            return self._entries[key]
        self.misses += 1
        text = describe_style(model, tokenizer, picture, seed=seed, max_new_tokens=max_new_tokens, max_pixels=max_pixels)
        self._store(key, text)
        return text

    def _store(self, key: str, text: str) -> None:
        self._entries[key] = text
        if self.path is not None:
            self._save()
