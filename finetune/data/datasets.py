"""Several datasets in one run (``data.datasets``) and the mix they make.

A single ``data.path`` (or ``data.synthetic``) is the one-entry case: :func:`dataset_entries`
turns either form into the same list, with the run-wide defaults (``data.resolution``,
``data.caption_dropout``, ``data.repeats``) filled in, so everything after the config sees one shape.

Samples of all datasets are concatenated (each repeated ``repeats`` times) and drawn through one
:class:`finetune.data.buckets.BucketBatches`. Each dataset gets ``weight / (sum of the weights)`` of
the draws, whatever its size (:func:`draws_per_epoch`): an epoch draws every sample at least once,
the dataset with the most samples per unit of weight once per sample, the others proportionally
more often (a subject set of 20 beside 200 regularisation images, equal weights: each subject image
10 times per epoch, each regularisation image once: 400 draws, half and half). The draw counts are
fixed per epoch, so the batch order stays a pure function of (seed, step): deterministic and exactly
resumable. :func:`dataset_mix` counts the shares from the epoch itself (bucket top-ups included).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from krea2_diffusers.files import atomic_write

from ..config import DataConfig, DatasetConfig, TrainConfig
from .buckets import BucketBatches
from .captions import caption_variants
from .dataset import Sample

logger = logging.getLogger("finetune")
MIX_FILE = "dataset_mix.json"


def dataset_entries(data: DataConfig, synthetic_path: Path) -> list[DatasetConfig]:
    """``data.datasets`` with their defaults filled in, or the one entry of ``data.path``
    (``synthetic_path`` when only ``data.synthetic`` is given)."""
    if not data.datasets:
        return [DatasetConfig(path=str(data.path or synthetic_path), repeats=data.repeats, resolution=data.resolution,
                              caption_dropout=data.caption_dropout)]
    return [dataclasses.replace(entry, resolution=entry.resolution or data.resolution,
                                caption_dropout=data.caption_dropout if entry.caption_dropout is None else entry.caption_dropout)
            for entry in data.datasets]


def entry_key(data: DataConfig, index: int) -> str:
    """The config key of entry ``index``, for messages."""
    return f"data.datasets[{index}]" if data.datasets else "data"


def per_sample(samples: Sequence[Sample], entries: Sequence[DatasetConfig], prior_loss_weight: float) -> tuple[list[float], list[float]]:
    """(caption dropout, loss weight) of every sample: its dataset's dropout, and
    ``prior_loss_weight`` for regularisation samples (1 for the others)."""
    dropout = [entries[s.dataset].caption_dropout for s in samples]
    weight = [prior_loss_weight if entries[s.dataset].is_regularization else 1.0 for s in samples]
    return dropout, weight


def draws_per_epoch(samples: Sequence[Sample], entries: Sequence[DatasetConfig]) -> list[float]:
    """Per sample, its expected draws in an epoch (:class:`~finetune.data.buckets.BucketBatches`'
    ``draws``): dataset ``d`` of ``n_d`` samples and weight ``w_d`` gets ``(w_d / n_d) / min_k (w_k / n_k)``
    per sample, so its draws ``n_d * that`` are in proportion to ``w_d``, and the dataset with the
    most samples per unit of weight is drawn exactly once per sample (1.0: x / x is exact)."""
    counts: dict[int, int] = {}
    for sample in samples:
        counts[sample.dataset] = counts.get(sample.dataset, 0) + 1
    per_sample = {d: entries[d].weight / n for d, n in counts.items()}
    least = min(per_sample.values())
    return [per_sample[s.dataset] / least for s in samples]


def dataset_mix(samples: Sequence[Sample], entries: Sequence[DatasetConfig], epoch: list[list[int]]) -> list[dict]:
    """Per dataset: path, images, repeats, weight, resolution, regularisation, its draws in an epoch
    and their ``share`` of the sample slots of ``epoch`` (the global micro-batches of one epoch)."""
    slots = [0] * len(entries)
    for batch in epoch:
        for index in batch:
            slots[samples[index].dataset] += 1
    total = sum(slots)
    rows = []
    for i, entry in enumerate(entries):
        count = sum(1 for s in samples if s.dataset == i)
        rows.append({"path": entry.path, "images": count // entry.repeats, "repeats": entry.repeats, "weight": entry.weight,
                     "resolution": entry.resolution, "is_regularization": entry.is_regularization,
                     "samples_per_epoch": slots[i], "share": slots[i] / total})
    return rows


def share_line(name: str, share: float, details: str = "") -> str:
    """``dataset NAME: 50.0% of samples`` (and `` (details)``): how every mix report names a dataset's share."""
    return f"dataset {name}: {100 * share:.1f}% of samples" + (f" ({details})" if details else "")


def mix_text(rows: list[dict]) -> str:
    """The mix as the lines printed at the start of a run (and by ``krea2 train --dry-run``)."""
    lines = ["dataset mix (share = of the training samples drawn):"]
    for row in rows:
        kind = ", regularisation" if row["is_regularization"] else ""
        lines.append(share_line(row["path"], row["share"],
                                       f"{row['images']} images x {row['repeats']} repeats, weight {row['weight']:g}, "
                                       f"{row['samples_per_epoch']} draws per epoch, {row['resolution']} px{kind}"))
    return "\n".join(lines)


def sample_batches(config: TrainConfig, samples: Sequence[Sample], keys: Sequence, micro_batch: int, out: Path) -> BucketBatches:
    """The run's batch order over ``samples``: global micro-batches of ``micro_batch`` samples sharing
    a batching key (``keys``: each sample's bucket, or for pairs its bucket and reference sizes), each
    dataset drawn by its weight (:func:`draws_per_epoch`)."""
    entries = dataset_entries(config.data, out / "synthetic_data")
    return BucketBatches(keys, micro_batch, seed=config.training.seed, shuffle=config.data.shuffle,
                         draws=draws_per_epoch(samples, entries))


@dataclass
class SampleRules:
    """What each sample's dataset decides while training: its caption variants by epoch, its
    caption dropout (one number when all datasets agree) and its loss weight (None: all 1)."""

    captions: list[list[str]]
    caption_dropout: float | list[float]
    sample_weights: list[float] | None
    mix: list[dict]

    @classmethod
    def of(cls, config: TrainConfig, samples: Sequence[Sample], batches: BucketBatches, micro_batches: int, out: Path,
           report: bool) -> "SampleRules":
        """Rules for ``samples`` drawn by ``batches`` over ``micro_batches`` global micro-batches;
        with ``report``, the dataset mix is logged and written to ``out/dataset_mix.json``."""
        entries = dataset_entries(config.data, out / "synthetic_data")
        epochs = math.ceil(micro_batches / batches.batches_per_epoch)
        dropout, weights = per_sample(samples, entries, config.training.prior_loss_weight)
        rules = cls(captions=caption_variants(samples, entries, config.training.seed, epochs),
                    caption_dropout=dropout[0] if len(set(dropout)) == 1 else dropout,
                    sample_weights=weights if any(w != 1.0 for w in weights) else None,
                    mix=dataset_mix(samples, entries, batches.epoch(0)))
        if report:
            logger.info("%s", mix_text(rules.mix))
            with atomic_write(out / MIX_FILE, "w") as handle:
                json.dump(rules.mix, handle, indent=2)
        return rules
