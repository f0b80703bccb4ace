"""Style-reference training data: the style groups of a dataset and, for every sample, the
references it is trained with.

A sample's references are OTHER images of its group (never its own image, also not a repeat of it
through ``data.repeats``), so the LoRA learns to carry a style over, not to copy the target. They
come from the same latent cache as the targets and enter the transformer exactly as the pipeline's
``style_mode="reference"`` sends them (:mod:`krea2_diffusers.conditioning.style`): packed clean latents after
the target at RoPE (k, i, j), each weighted by a strength s as a log(s) attention bias.

Left out on purpose: the vision tokens of the references in the text (the pipeline adds them at
inference; the cached captions are encoded without them). The transformer-side path, where the
style LoRA acts, is the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from krea2_diffusers.latents import PIXELS_PER_TOKEN
from krea2_diffusers.conditioning.style import reference_area, reference_layout, reference_size, strength_bias

from .config import StyleReferencesConfig
from .dataset import DatasetError, Sample

# Latent cells per pixel side (the VAE's downsampling).
_VAE_SCALE = 8


class _Size:
    """Width/height of a target in pixels, for :func:`krea2_diffusers.conditioning.style.reference_size`."""

    def __init__(self, height: int, width: int):
        self.height, self.width = height, width


class StyleGroups:
    """``others[i]``: indices of the samples of i's group showing another image than i's."""

    def __init__(self, samples: list[Sample], config: StyleReferencesConfig):
        self.config = config
        unlabelled = [s.image_path for s in samples if s.style_id is None]
        if unlabelled:
            raise DatasetError(
                f"data.style_references needs a style group for every image, {unlabelled[0]} has none "
                f"({len(unlabelled)} images without one): put the images in one subfolder per style, "
                "or give the manifest a style_id column")
        groups: dict[str, list[int]] = {}
        for index, sample in enumerate(samples):
            groups.setdefault(sample.style_id, []).append(index)
        self.others = [[j for j in groups[s.style_id] if samples[j].image_path != s.image_path] for s in samples]
        lonely = [s for s, others in zip(samples, self.others) if not others]
        if lonely:
            raise DatasetError(f"style group {lonely[0].style_id!r} has only one image ({lonely[0].image_path}); "
                               "a sample's references are other images of its group, so every group needs at least two")

    def draw(self, ids: list[int], generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        """References and strengths for the samples ``ids`` of one global micro-batch.

        One count k in [1, max_references] (capped by the smallest group) for all rows, so the rows
        share one reference layout; then per row k distinct other images of its group and k
        strengths uniform in ``strength_range``. Deterministic in the generator (from (seed, step)).
        """
        most = min([self.config.max_references] + [len(self.others[i]) for i in ids])
        count = 1 + int(torch.randint(most, (1,), generator=generator))
        low, high = self.config.strength_range
        references, strengths = [], []
        for i in ids:
            order = torch.randperm(len(self.others[i]), generator=generator)[:count].tolist()
            references.append([self.others[i][j] for j in order])
            strengths.append((low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)).tolist())
        return references, strengths

    def inputs(self, cache, global_ids: list[int], mine: slice, drop: list[bool], generator: torch.Generator,
               grid: tuple[int, int], text_len: int) -> dict[str, torch.Tensor]:
        """The reference inputs of the rows ``global_ids[mine]`` (:func:`reference_inputs`) and their
        ``reference_ids`` (b, k), drawn for the whole global micro-batch ``global_ids``."""
        references, strengths = self.draw(global_ids, generator)
        item = reference_inputs(cache, references[mine], strengths[mine], grid, text_len, self.config.resolution)
        item["reference_ids"] = torch.tensor(references[mine])
        return item


def reference_inputs(cache, references: list[list[int]], strengths: list[list[float]], grid: tuple[int, int],
                     text_len: int, resolution: int | None) -> dict[str, torch.Tensor]:
    """The transformer's reference inputs for b rows whose targets have latent ``grid`` (h, w).

    Every reference is sized as the pipeline sizes it (``reference_area`` / ``reference_size``,
    sharing ``resolution``^2 px among the k references), with the target's aspect so that every row
    has the same layout; cached latents of another size are resized in latent space.

    Returns ``references`` (b, R, 64) packed latents, ``reference_positions`` (R, 3) and
    ``key_bias`` (b, text_len + N + R) with log(s) on each reference's tokens.
    """
    from .encoding import pack_latents

    height, width = grid[0] * _VAE_SCALE, grid[1] * _VAE_SCALE
    count = len(references[0])
    area = reference_area(height, width, count, resolution)
    size = reference_size(_Size(height, width), area)
    layout, positions = reference_layout([size] * count)
    cells = (size[0] // _VAE_SCALE, size[1] // _VAE_SCALE)
    # (b, R, 64): each row's k references packed one after the other.
    packed = torch.cat([torch.cat([pack_latents(_resized(cache.latents([j]), cells)) for j in row], dim=1)
                        for row in references])
    patch = PIXELS_PER_TOKEN // _VAE_SCALE
    image_len = (grid[0] // patch) * (grid[1] // patch)
    bias = torch.stack([strength_bias(s, [], layout, text_len, image_len, packed.shape[1]) for s in strengths])
    return dict(references=packed, reference_positions=positions, key_bias=bias)


def _resized(latents: torch.Tensor, cells: tuple[int, int]) -> torch.Tensor:
    """(1, 16, h, w) -> (1, 16, *cells); area-averaged when shrinking, as an image resize would."""
    if tuple(latents.shape[2:]) == cells:
        return latents
    return F.interpolate(latents.float(), size=cells, mode="bilinear", antialias=True, align_corners=False).to(latents.dtype)
