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


def _hash(*parts: bytes | str) -> str:
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
    batch is re-padded to its own longest caption.
    """

    latent_files: list[Path]
    text_files: list[Path]
    empty_text_file: Path

    def latents(self, indices: Sequence[int]) -> torch.Tensor:
        """(B, 16, h, w); the indices must share a bucket."""
        return torch.stack([load_file(str(self.latent_files[i]))["latents"] for i in indices])

    def text(self, indices: Sequence[int], drop: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``prompt_embeds`` (B, L, layers, dim) and bool ``prompt_embeds_mask`` (B, L);
        ``drop[i]`` swaps sample i's caption for the empty prompt (caption dropout)."""
        embeds = [
            load_file(str(self.empty_text_file if d else self.text_files[i]))["prompt_embeds"]
            for i, d in zip(indices, drop)
        ]
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
) -> TrainingCache:
    """Encode whatever is missing (each process takes every ``world_size``-th entry), then wait
    for all processes. ``pipe`` provides ``vae``, ``text_encoder`` and ``encode_prompt``."""
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
        vae_dir / f"{_hash(s.image_path.read_bytes(), str(b), str(s.crop))}.safetensors" for s, b in zip(samples, buckets)
    ]
    captions = [s.caption for s in samples]
    text_file = {c: text_dir / f"{_hash(c)}.safetensors" for c in set(captions) | {""}}

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
            save_safetensors({"latents": latents.float().cpu()}, latent_files[index])
        for caption in todo_text:
            embeds, mask = pipe.encode_prompt(caption, device=device, max_sequence_length=max_sequence_length)
            save_safetensors({"prompt_embeds": embeds[0][mask[0]].cpu()}, text_file[caption])
    barrier()
    return TrainingCache(latent_files, [text_file[c] for c in captions], text_file[""])
