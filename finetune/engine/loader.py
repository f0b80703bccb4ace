"""The input pipeline: a ``torch.utils.data.DataLoader`` over the cached latents and caption
features, driven by a resumable sampler.

What a step trains on is fixed when the run starts: the *global batch* of ``micro_batch``
samples x ``accumulation`` micro-batches (``training.batch_size`` x processes, and
``training.gradient_accumulation_steps``). Micro-batch ``k`` of the run, its samples, noise,
timesteps and caption dropout are pure functions of ``(seed, k)``. :func:`step_layout` splits one
step's samples over however many processes run now (the same number of forward passes on each,
as FSDP's collectives need), so a run resumed on another world size trains on exactly the same
samples with the same noise. The data position saved in a checkpoint is the step counter.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..data.buckets import BucketBatches
from ..data.cache import TrainingCache
from ..data.encoding import pack_latents
from ..data.masks import packed_mask
from ..optimization.timesteps import sample_timesteps


class LayoutError(ValueError):
    """The global batch cannot be split evenly over this number of processes."""


@dataclass(frozen=True)
class GlobalBatch:
    """The batch a run keeps for its whole life (saved in ``run.json`` and every checkpoint)."""

    micro_batch: int  # samples per global micro-batch (one bucket each)
    accumulation: int  # micro-batches per optimizer step
    max_per_forward: int  # the per-process batch the run started with: forwards never exceed it

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.accumulation

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Forward:
    """One forward pass of one process: slots ``start:stop`` of micro-batch ``micro`` of a step."""

    micro: int
    start: int
    stop: int


def step_layout(batch: GlobalBatch, rank: int, world_size: int) -> list[Forward]:
    """The forward passes process ``rank`` of ``world_size`` runs in every step.

    The step's ``micro_batch x accumulation`` samples are numbered in order; each process takes a
    contiguous run of ``samples_per_step / world_size`` of them, cut into forwards of equal size
    ``s`` that never cross a micro-batch (so each forward is one bucket) and never exceed
    ``max_per_forward``. Every process gets the same number of forwards.
    """
    total = batch.samples_per_step
    if total % world_size:
        raise LayoutError(
            f"the run's global batch of {total} samples per step ({batch.micro_batch} x {batch.accumulation} "
            f"accumulation) cannot be split over {world_size} processes; use a number of processes dividing {total}"
        )
    share = total // world_size
    common = math.gcd(batch.micro_batch, share)
    size = max(d for d in range(1, common + 1) if common % d == 0 and d <= batch.max_per_forward)
    first = rank * share
    forwards = []
    for j in range(share // size):
        position = first + j * size
        micro, slot = divmod(position, batch.micro_batch)
        forwards.append(Forward(micro, slot, slot + size))
    return forwards


def step_generator(seed: int, index: int) -> torch.Generator:
    """Noise, timesteps and caption dropout of global micro-batch ``index`` come from here:
    identical for every process count and after a resume."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class ResumableSampler(Sampler):
    """Yields ``(step, Forward)`` work items of one process from ``start_step`` to ``max_steps``.

    Its state is the next step; since every item is a function of the step, restoring it resumes
    the exact data stream. No per-step reshuffle: the order of an epoch is computed once.
    """

    def __init__(self, layout: list[Forward], start_step: int, max_steps: int):
        self.layout = layout
        self.start_step = start_step
        self.max_steps = max_steps

    def __iter__(self) -> Iterator[tuple[int, Forward]]:
        for step in range(self.start_step, self.max_steps):
            for forward in self.layout:
                yield step, forward

    def __len__(self) -> int:
        return max(0, self.max_steps - self.start_step) * len(self.layout)

    def state_dict(self) -> dict:
        return {"next_step": self.start_step}

    def load_state_dict(self, state: dict) -> None:
        self.start_step = int(state["next_step"])


class CachedFeatures(Dataset):
    """Item ``(step, Forward)`` -> the tensors of that forward pass, read from the disk cache.

    Returns ``x0`` (b, N, 64) packed clean latents, ``noise`` like it, ``t`` (b,), ``embeds``
    (b, L, layers, dim) with ``mask`` (b, L), ``grid`` (h/2, w/2) and the sample ``ids``. With
    ``references`` (the reference source: :class:`finetune.data.style_groups.StyleGroups` for
    style-reference training, :class:`finetune.data.pair_features.PairFeatures` for paired samples)
    also what its ``inputs`` gives: ``references`` (b, R, 64), ``reference_positions`` (R, 3), and
    ``key_bias`` (b, L + N + R) / ``reference_ids`` (b, k) or vision-token ``embeds`` / ``mask``.

    ``caption_dropout``: one probability, or one per sample (per dataset, ``data.datasets``).
    ``sample_weights`` (per sample; regularisation samples' ``prior_loss_weight``) adds
    ``sample_weights`` (b,); a cache with masks (``masked``) adds ``loss_mask`` (b, N, 64), the
    latent-grid masks packed like ``x0``.
    """

    def __init__(self, cache: TrainingCache, batches: BucketBatches, batch: GlobalBatch, seed: int,
                 caption_dropout: float | Sequence[float], objective, references=None, *,
                 sample_weights: Sequence[float] | None = None, masked: bool = False):
        self.cache, self.batches, self.batch = cache, batches, batch
        self.seed, self.caption_dropout, self.objective = seed, caption_dropout, objective
        self.references = references
        self.sample_weights, self.masked = sample_weights, masked

    def __getitem__(self, item: tuple[int, Forward]) -> dict:
        step, forward = item
        index = step * self.batch.accumulation + forward.micro
        global_ids = self.batches.global_batch(index)
        mine = slice(forward.start, forward.stop)
        local = global_ids[mine]
        if self.masked:
            latents, masks = self.cache.latents_and_masks(local)  # (b, 16, h, w), (b, h, w)
        else:
            latents = self.cache.latents(local)  # (b, 16, h, w)
        x0 = pack_latents(latents)
        generator = step_generator(self.seed, index)
        n_global, tokens, features = len(global_ids), x0.shape[1], x0.shape[2]
        noise = torch.randn((n_global, tokens, features), generator=generator)
        t = sample_timesteps(n_global, tokens, self.objective, generator)
        chance = self.caption_dropout
        if not isinstance(chance, (int, float)):
            chance = torch.tensor([chance[i] for i in global_ids], dtype=torch.float32)
        drop = (torch.rand(n_global, generator=generator) < chance).tolist()
        # The epoch picks each sample's caption variant (tag shuffling, finetune.data.captions).
        embeds, mask = self.cache.text(local, drop[mine], index // self.batches.batches_per_epoch)
        item = dict(x0=x0, noise=noise[mine], t=t[mine], embeds=embeds, mask=mask,
                    grid=torch.tensor([latents.shape[2] // 2, latents.shape[3] // 2]), ids=torch.tensor(local))
        if self.masked:
            item["loss_mask"] = packed_mask(masks, latents.shape[1])
        if self.sample_weights is not None:
            item["sample_weights"] = torch.tensor([self.sample_weights[i] for i in local], dtype=torch.float32)
        if self.references is not None:
            # Drawn after the noise for the whole global micro-batch: any process split sees the same.
            item.update(self.references.inputs(self.cache, global_ids, mine, drop, generator, tuple(latents.shape[2:]),
                                               embeds.shape[1]))
        return item

    def __len__(self) -> int:  # map-style, indexed by the sampler's items
        raise TypeError("CachedFeatures is indexed by (step, Forward) items from ResumableSampler")


def make_loader(dataset: CachedFeatures, sampler: ResumableSampler, *, num_workers: int, prefetch_factor: int,
                pin_memory: bool) -> DataLoader:
    """Workers read and assemble the next forwards while the current one trains.

    The loader gets its own generator: by default it draws its workers' base seed from the global
    torch generator when iterated, which would shift the restored RNG stream of a resumed run
    (LoRA dropout draws from it). Nothing random happens in the workers anyway.
    """
    kwargs = dict(prefetch_factor=prefetch_factor) if num_workers > 0 else {}
    return DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(0), **kwargs)
