"""The cached model inputs of paired samples (``data.references``) and the reference part of each
forward, as the pipeline's ``reference_images`` path feeds them.

Cached like the targets (:mod:`finetune.data.cache`, content-hashed names, atomic shards):

* reference latents: ``cache_dir/latents/<vae fingerprint>/<hash of image bytes, size>.safetensors``,
  ``latents`` (16, h/8, w/8) at the pipeline's sizes (:func:`finetune.data.pairs.reference_sizes`);
* with ``vision_tokens``: the instruction encoded with the references as Qwen3-VL vision tokens
  before it (:func:`krea2_diffusers.conditioning.references.encode_prompt_with_images`),
  ``cache_dir/reference_text/<text-encoder fingerprint>/<hash of text, image bytes>.safetensors``;
  with caption dropout also the empty instruction with the same references (the images stay: the
  unconditional branch at inference keeps them too).

In a forward the references follow the target's tokens at RoPE (k, i, j), modulated as timestep 0
by the transformer, so the loss (on the target's tokens only: the transformer returns those) is the
edit's. The rows of a forward share their reference sizes (:func:`finetune.data.pairs.batch_keys`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from krea2_diffusers.conditioning.reference_images import VISION_MAX_PIXELS
from krea2_diffusers.conditioning.references import encode_prompt_with_images, one_image
from krea2_diffusers.conditioning.style import reference_layout
from krea2_diffusers.files import save_safetensors

from .config import ReferencesConfig
from .cache import LATENT_FORMAT_VERSION, TrainingCache, content_hash, module_fingerprint
from .dataset import Sample
from .pairs import reference_sizes

REFERENCE_TEXT_VERSION = 1


def reference_pixels(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """The reference at ``size`` (height, width): (3, h, w) float32 in [0, 1], RGB (transparency on
    white), resized whole (no crop) as the pipeline resizes its reference images."""
    image = one_image(path).resize((size[1], size[0]))
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


@dataclass
class PairFeatures:
    """Per sample i: ``sizes[i]`` (height, width) px of its references, ``latent_files[i]`` one shard
    each (empty without ``latents``), and with ``vision_tokens`` ``text_files[i]`` /
    ``empty_text_files[i]`` (instruction / empty instruction with the references as vision tokens)."""

    config: ReferencesConfig
    sizes: list[tuple[tuple[int, int], ...]]
    latent_files: list[list[Path]]
    text_files: list[Path] | None = None
    empty_text_files: list[Path] | None = None

    def inputs(self, cache: TrainingCache, global_ids: list[int], mine: slice, drop: list[bool],
               generator: torch.Generator, grid: tuple[int, int], text_len: int) -> dict[str, torch.Tensor]:
        """The reference inputs of the rows ``global_ids[mine]`` (``drop``: caption dropout of every
        global row). ``references`` (b, R, 64) packed clean latents and ``reference_positions``
        (R, 3) with ``latents``; ``embeds`` (b, L', layers, dim) / ``mask`` (b, L') replacing the
        plain caption's with ``vision_tokens``. Nothing random: ``generator`` is unused."""
        from .encoding import pack_latents

        rows, dropped = global_ids[mine], drop[mine]
        out: dict[str, torch.Tensor] = {}
        if self.config.latents:
            if len({self.sizes[i] for i in rows}) != 1:
                raise RuntimeError(f"the rows {rows} of one forward have different reference sizes (batch keys broken)")
            out["references"] = torch.cat([
                torch.cat([pack_latents(load_file(str(f))["latents"][None]) for f in self.latent_files[i]], dim=1)
                for i in rows])
            out["reference_positions"] = reference_layout(list(self.sizes[rows[0]]))[1]
        if self.config.vision_tokens:
            files = [self.empty_text_files[i] if d else self.text_files[i] for i, d in zip(rows, dropped)]
            out["embeds"], out["mask"] = TrainingCache([], files, files[0]).text(range(len(files)), [False] * len(files))
        return out


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_pair_cache(pipe, samples: Sequence[Sample], config: ReferencesConfig, cache_dir: str | Path, caption_dropout: float,
                     max_sequence_length: int, device: torch.device, rank: int = 0, world_size: int = 1,
                     barrier: Callable[[], None] = lambda: None, captions: Sequence[str] | None = None) -> PairFeatures:
    """Encode whatever reference latents and vision-token texts are missing (each process every
    ``world_size``-th entry), then wait for all processes. ``pipe``: ``vae``, ``text_encoder``, ``tokenizer``.
    ``captions``: per sample the instruction to encode (default its caption; the trainer passes its
    first caption variant, trigger prefix included; later epochs' tag shuffles are not re-encoded)."""
    from . import encoding

    cache_dir = Path(cache_dir)
    digests = {path: _file_digest(path) for s in samples for path in s.references}
    sizes = [reference_sizes(s, config.max_pixels) for s in samples]

    latent_files: list[list[Path]] = [[] for _ in samples]
    latent_todo: dict[Path, tuple[Path, tuple[int, int]]] = {}
    if config.latents:
        vae_dir = cache_dir / "latents" / module_fingerprint(pipe.vae, encoding.vae_fingerprint_extra(pipe, LATENT_FORMAT_VERSION))
        for i, sample in enumerate(samples):
            for ref, size in zip(sample.references, sizes[i]):
                file = vae_dir / f"{content_hash('reference', digests[ref], str(size))}.safetensors"
                latent_files[i].append(file)
                latent_todo.setdefault(file, (ref, size))

    text_files = empty_files = None
    text_todo: dict[Path, tuple[str, tuple[Path, ...]]] = {}
    if config.vision_tokens:
        settings = {"max_sequence_length": max_sequence_length, "vision_pixels": VISION_MAX_PIXELS,
                    "select_layers": list(pipe.config.text_encoder_select_layers),
                    "tokenizer": [type(pipe.tokenizer).__name__, len(pipe.tokenizer)], "version": REFERENCE_TEXT_VERSION}
        text_dir = cache_dir / "reference_text" / module_fingerprint(pipe.text_encoder, settings)

        def entry(text: str, sample: Sample) -> Path:
            file = text_dir / f"{content_hash(text, *(digests[r] for r in sample.references))}.safetensors"
            text_todo.setdefault(file, (text, sample.references))
            return file

        captions = [s.caption for s in samples] if captions is None else captions
        text_files = [entry(caption, s) for caption, s in zip(captions, samples)]
        empty_files = [entry("", s) for s in samples] if caption_dropout > 0 else list(text_files)

    # Split by position in the full ordered lists (as build_cache does): "missing" differs per process.
    mine = lambda entries: [k for n, k in enumerate(entries) if n % world_size == rank and not k.exists()]
    with torch.no_grad():
        for file in mine(latent_todo):
            ref, size = latent_todo[file]
            latents = encoding.encode_images(pipe, reference_pixels(ref, size)[None].to(device))[0]
            save_safetensors({"latents": latents.float().cpu()}, file)
        for file in mine(text_todo):
            text, refs = text_todo[file]
            embeds, mask, _ = encode_prompt_with_images(
                pipe.text_encoder, pipe.tokenizer, text, [one_image(r) for r in refs],
                layers=pipe.config.text_encoder_select_layers, max_sequence_length=max_sequence_length,
                max_pixels=VISION_MAX_PIXELS, device=device)
            save_safetensors({"prompt_embeds": embeds[0][mask[0]].cpu()}, file)
    barrier()
    return PairFeatures(config, sizes, latent_files, text_files, empty_files)
