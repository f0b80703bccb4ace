"""Disk cache of VAE latents and text conditioning, so the frozen encoders run once per dataset.

Layout (one small safetensors shard per entry, named by a content hash)::

    cache_dir/latents/<vae fingerprint>/<hash of image bytes, bucket, crop>.safetensors
    cache_dir/text/<text-encoder fingerprint>/<hash of caption>.safetensors

The fingerprint folders change whenever the model weights, its config or an encoding setting
changes, which invalidates the old entries without ever reading stale ones; unchanged datasets
are reused across runs. Shards are written to a temporary name and renamed, so a killed run
never leaves a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from krea2_diffusers.files import save_safetensors

from .buckets import Bucket, resize_to_bucket
from .dataset import Sample
from .masks import MASK_FORMAT_VERSION, mask_grid

logger = logging.getLogger("finetune")

LATENT_FORMAT_VERSION = 1
TEXT_FORMAT_VERSION = 1


def module_fingerprint(module: torch.nn.Module, extra: dict | None = None) -> str:
    """A short hash of a module's class, config and a strided sample of every weight.

    Sampling (64 values per tensor) keeps this cheap for a 4B text encoder while any fine-tune,
    re-quantisation or different checkpoint still changes it.
    """
    digest = hashlib.sha256()
    digest.update(type(module).__name__.encode())
    config = getattr(module, "config", None)
    if config is not None:
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        # Private entries (e.g. diffusers' `_use_default_values`, built from a set) vary between
        # processes without meaning anything.
        as_dict = {k: v for k, v in as_dict.items() if not str(k).startswith("_")}
        digest.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    digest.update(json.dumps(extra or {}, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            flat = tensor.detach().reshape(-1)
            stride = max(1, flat.numel() // 64)
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(flat[::stride].to(torch.float64).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def content_hash(*parts: bytes | str) -> str:
    """A 32-hex-digit key of the parts (bytes or text), for cache file names."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def load_image_tensor(sample: Sample, bucket: Bucket) -> torch.Tensor:
    """The sample's pixels cropped to ``bucket``: (3, H, W) float32 in [0, 1]."""
    with Image.open(sample.image_path) as image:
        image = image.convert("RGB")
        if sample.crop is not None:
            image = image.crop(sample.crop)
        image = resize_to_bucket(image, bucket)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
    return pixels.permute(2, 0, 1)


@dataclass
class TrainingCache:
    """Paths of every sample's cached latents and caption conditioning, plus the empty prompt's.

    Latent shards hold ``latents`` (16, H/8, W/8), already normalised with the VAE's per-channel
    mean/std. Text shards hold ``prompt_embeds`` (L, num_text_layers, text_dim) for the real tokens
    only: padding consumes no position and is masked everywhere, so dropping it is exact and a
    batch is re-padded to its own longest caption (never to ``max_sequence_length``).
    A masked sample's latent shard also holds ``mask`` (H/8, W/8), its loss weights
    (:func:`finetune.data.masks.mask_grid`).
    """

    latent_files: list[Path]
    text_files: list[Path]
    empty_text_file: Path
    variant_files: list[list[Path]] | None = None
    """Per sample, the text shards of its captions for epochs 0, 1, ... in turn (tag shuffling,
    :func:`finetune.data.captions.caption_variants`); ``text_files[i]`` is ``variant_files[i][0]``."""

    def latents(self, indices: Sequence[int]) -> torch.Tensor:
        """(B, 16, h, w); the indices must share a bucket."""
        return torch.stack([load_file(str(self.latent_files[i]))["latents"] for i in indices])

    def latents_and_masks(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 16, h, w) latents and (B, h, w) loss weights (1 everywhere for a sample without a mask)."""
        shards = [load_file(str(self.latent_files[i])) for i in indices]
        latents = torch.stack([shard["latents"] for shard in shards])
        masks = torch.stack([shard.get("mask", torch.ones(latents.shape[2:])) for shard in shards])
        return latents, masks

    def text(self, indices: Sequence[int], drop: Sequence[bool], epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``prompt_embeds`` (B, L, layers, dim) and bool ``prompt_embeds_mask`` (B, L),
        L the longest of these captions; ``drop[i]`` swaps sample i's caption for the empty prompt
        (caption dropout); ``epoch`` picks each sample's caption variant."""

        def caption_file(i: int) -> Path:
            if self.variant_files is None:
                return self.text_files[i]
            return self.variant_files[i][epoch % len(self.variant_files[i])]

        embeds = [load_file(str(self.empty_text_file if d else caption_file(i)))["prompt_embeds"] for i, d in zip(indices, drop)]
        length = max(e.shape[0] for e in embeds)
        out = embeds[0].new_zeros((len(embeds), length, *embeds[0].shape[1:]))
        mask = torch.zeros(len(embeds), length, dtype=torch.bool)
        for row, e in enumerate(embeds):
            out[row, : e.shape[0]] = e
            mask[row, : e.shape[0]] = True
        return out, mask


def build_cache(
    pipe,
    samples: Sequence[Sample],
    buckets: Sequence[Bucket],
    cache_dir: str | Path,
    max_sequence_length: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    captions: Sequence[Sequence[str]] | None = None,
) -> TrainingCache:
    """Encode whatever is missing (each process takes every ``world_size``-th entry), then wait
    for all processes. ``pipe`` provides ``vae``, ``text_encoder`` and ``encode_prompt``.

    ``captions``: per sample, its caption variants by epoch (default: its one caption). A sample
    with a ``mask`` caches it beside its latents; the mask's bytes are part of that entry's key.
    """
    from . import encoding

    cache_dir = Path(cache_dir)
    vae_dir = cache_dir / "latents" / module_fingerprint(pipe.vae, encoding.vae_fingerprint_extra(pipe, LATENT_FORMAT_VERSION))
    text_settings = {
        "max_sequence_length": max_sequence_length,
        "select_layers": list(getattr(pipe.config, "text_encoder_select_layers", []) or []),
        "tokenizer": [type(pipe.tokenizer).__name__, len(pipe.tokenizer)],
        "version": TEXT_FORMAT_VERSION,
    }
    text_dir = cache_dir / "text" / module_fingerprint(pipe.text_encoder, text_settings)

    latent_files = [
        vae_dir / f"{content_hash(s.image_path.read_bytes(), str(b), str(s.crop), *_mask_key(s))}.safetensors"
        for s, b in zip(samples, buckets)
    ]
    variants = [list(c) for c in captions] if captions is not None else [[s.caption] for s in samples]
    text_file = {c: text_dir / f"{content_hash(c)}.safetensors" for c in {c for v in variants for c in v} | {""}}

    # Split the work by position in the full (deduplicated, ordered) lists, not in what is still
    # missing: each process checks existence at a different moment, so "missing" differs.
    first_index: dict[Path, int] = {}
    for index, path in enumerate(latent_files):
        first_index.setdefault(path, index)
    todo_latents = [i for n, i in enumerate(first_index.values()) if n % world_size == rank and not latent_files[i].exists()]
    todo_text = [c for n, c in enumerate(sorted(text_file)) if n % world_size == rank and not text_file[c].exists()]

    with torch.no_grad():
        for index in todo_latents:
            pixels = load_image_tensor(samples[index], buckets[index])[None].to(device)
            latents = encoding.encode_images(pipe, pixels)[0]
            entry = {"latents": latents.float().cpu()}
            if samples[index].mask is not None:
                entry["mask"] = mask_grid(samples[index], buckets[index])
                if not entry["mask"].any():
                    logger.warning("the mask of %s is empty once cropped to its bucket: the sample trains nothing", samples[index].image_path)
            save_safetensors(entry, latent_files[index])
        for caption in todo_text:
            embeds, mask = pipe.encode_prompt(caption, device=device, max_sequence_length=max_sequence_length)
            save_safetensors({"prompt_embeds": embeds[0][mask[0]].cpu()}, text_file[caption])
    barrier()
    variant_files = [[text_file[c] for c in v] for v in variants]
    return TrainingCache(latent_files, [v[0] for v in variant_files], text_file[""],
                         variant_files if any(len(v) > 1 for v in variants) else None)


def _mask_key(sample: Sample) -> tuple[bytes | str, ...]:
    """What a sample's mask adds to its latent entry's key (nothing without a mask, so unmasked
    entries keep their keys)."""
    return () if sample.mask is None else (f"mask-v{MASK_FORMAT_VERSION}", sample.mask.read_bytes())
