"""Aspect-ratio buckets and the deterministic, resumable batch order over them.

A bucket is a ``(width, height)`` pair, both multiples of ``step`` (16 = VAE 8 x patch 2), with an
area close to ``resolution**2``. Each image goes to the bucket nearest its aspect ratio, is scaled
to cover it and centre-cropped. Batches hold one bucket each, so latents stack without padding.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from PIL import Image

Bucket = tuple[int, int]  # (width, height) in pixels


def make_buckets(resolution: int, step: int = 16, min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0) -> list[Bucket]:
    """All ``(w, h)`` with ``w, h`` multiples of ``step``, ``w * h <= resolution**2`` (as large as
    possible for that width) and ``min_aspect_ratio <= w / h <= max_aspect_ratio``, sorted by aspect."""
    area = resolution * resolution
    buckets: set[Bucket] = set()
    width = step
    while width <= area // step:
        height = (area // width) // step * step
        if height >= step and min_aspect_ratio <= width / height <= max_aspect_ratio:
            buckets.add((width, height))
        width += step
    if not buckets:
        raise ValueError(f"no bucket fits resolution={resolution}, step={step}; raise data.resolution")
    return sorted(buckets, key=lambda b: b[0] / b[1])


def nearest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is closest in log space (so 2:1 and 1:2 are equally far from 1:1)."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))


def fits(width: int, height: int, bucket: Bucket) -> bool:
    """True when the image covers the bucket without upscaling (cover-scaling factor <= 1)."""
    return max(bucket[0] / width, bucket[1] / height) <= 1.0


def resize_to_bucket(image: Image.Image, bucket: Bucket, resample: Image.Resampling = Image.Resampling.LANCZOS) -> Image.Image:
    """Scale ``image`` to cover ``bucket``, then centre-crop to exactly ``bucket`` (loss masks use the
    same geometry with a box filter)."""
    bw, bh = bucket
    scale = max(bw / image.width, bh / image.height)
    new_size = (max(bw, round(image.width * scale)), max(bh, round(image.height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, resample)
    left = (image.width - bw) // 2
    top = (image.height - bh) // 2
    return image.crop((left, top, left + bw, top + bh))


@dataclass
class BucketBatches:
    """A fixed-length epoch of global batches, reshuffled per epoch from ``seed``.

    Batch ``k`` of the whole run is a pure function of ``(seed, k)``: that is what makes resuming
    exact (the data position is just the step counter) and what lets N processes agree on the
    global batch while each takes its own slice.

    Args:
        bucket_of: bucket of each sample (index = sample id).
        global_batch_size: samples per optimizer micro-step across all processes.
        draws: per sample, its expected draws per epoch (>= 1; default: 1 each). Every sample is
            drawn once per epoch; the samples of one bucket sharing a value ``d`` (a dataset's:
            :func:`finetune.data.datasets.draws_per_epoch`) add ``round(n * d) - n`` draws of
            their own, cycled through a fresh shuffle each epoch. Those counts are fixed, so the
            epoch's length is too (and ``global_batch`` stays a pure function of the index).
    """

    bucket_of: Sequence[Bucket]
    global_batch_size: int
    seed: int = 0
    shuffle: bool = True
    draws: Sequence[float] = ()

    def __post_init__(self) -> None:
        if self.draws and len(self.draws) != len(self.bucket_of):
            raise ValueError(f"draws has {len(self.draws)} values for {len(self.bucket_of)} samples")
        groups: dict[Bucket, list[int]] = {}
        for index, bucket in enumerate(self.bucket_of):
            groups.setdefault(bucket, []).append(index)
        self._groups = [groups[b] for b in sorted(groups)]
        # Per bucket: (the samples sharing a draws value, their extra draws per epoch).
        self._extra = [self._extra_draws(group) for group in self._groups]
        # A bucket with fewer samples than a batch is topped up by cycling its own samples, so small
        # datasets still train every image; the epoch length is fixed by the bucket sizes.
        self.batches_per_epoch = sum(math.ceil((len(g) + sum(n for _, n in extra)) / self.global_batch_size)
                                     for g, extra in zip(self._groups, self._extra))

    def _extra_draws(self, group: list[int]) -> list[tuple[list[int], int]]:
        by_value: dict[float, list[int]] = {}
        for index in group:
            by_value.setdefault(float(self.draws[index]) if self.draws else 1.0, []).append(index)
        extra = [(members, round(len(members) * value) - len(members)) for value, members in sorted(by_value.items())]
        return [(members, count) for members, count in extra if count > 0]

    def epoch(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        batches = []
        for group, extra in zip(self._groups, self._extra):
            order = list(group)
            if self.shuffle:
                rng.shuffle(order)
            if extra:  # (none: the order of a run without weighted draws, as it always was)
                for members, count in extra:
                    cycle = list(members)
                    if self.shuffle:
                        rng.shuffle(cycle)
                    order += (cycle * (count // len(cycle) + 1))[:count]
                if self.shuffle:
                    rng.shuffle(order)
            count = math.ceil(len(order) / self.global_batch_size)
            cycled = (order * (count * self.global_batch_size // len(order) + 1))[: count * self.global_batch_size]
            batches += [cycled[i * self.global_batch_size:(i + 1) * self.global_batch_size] for i in range(count)]
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def global_batch(self, index: int) -> list[int]:
        """Sample ids of global batch ``index`` (counted from the start of the run)."""
        epoch, position = divmod(index, self.batches_per_epoch)
        if getattr(self, "_cached", (None,))[0] != epoch:  # shuffle once per epoch, not per step
            self._cached = (epoch, self.epoch(epoch))
        return self._cached[1][position]

    def local_batch(self, index: int, rank: int, world_size: int) -> list[int]:
        batch = self.global_batch(index)
        per_rank = len(batch) // world_size
        return batch[rank * per_rank:(rank + 1) * per_rank]
