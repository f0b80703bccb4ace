"""From a config to the list of samples and their buckets, with every fixable problem reported
before a model is loaded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

from .buckets import fits, make_buckets, nearest_bucket
from ..config import TrainConfig
from .dataset import DatasetError, DatasetScan, make_synthetic_dataset, scan_dataset
from .datasets import dataset_entries, dataset_mix, entry_key, mix_text, sample_batches, share_line
from .masks import attach_masks

logger = logging.getLogger("finetune")


def prepare_samples(config: TrainConfig, out: Path, runtime):
    """Scan the datasets, find their masks and bucket them; every error a user can fix is raised
    here, before any model loads.

    Returns the samples of all datasets (each repeated ``repeats`` times, ``Sample.dataset``
    naming its entry), the bucket of each, and the merged scan.
    """
    data = config.data
    entries = dataset_entries(data, out / "synthetic_data")
    if data.synthetic is not None:
        if runtime.is_main:
            make_synthetic_dataset(entries[0].path, data.synthetic.num_prompts, data.synthetic.images_per_prompt, data.synthetic.size)
        runtime.barrier()
    samples, assigned, merged = [], [], DatasetScan()
    for index, entry in enumerate(entries):
        key = entry_key(data, index)
        if data.references is not None:  # paired samples: every reference checked here too
            from .pairs import scan_pairs

            scan = scan_pairs(entry.path, data.references, f"{key}.path")
        else:
            scan = scan_dataset(entry.path, f"{key}.path")
        if scan.skipped:
            logger.warning("dataset %s: %s", entry.path, scan.summary())
        found = [dataclasses.replace(s, dataset=index) for s in attach_masks(scan.samples, data.masks)]
        buckets = make_buckets(entry.resolution, data.bucket_step, data.min_aspect_ratio, data.max_aspect_ratio)
        chosen = [nearest_bucket(*s.size, buckets) for s in found]
        too_small = [(s, b) for s, b in zip(found, chosen) if not fits(*s.size, b)]
        if too_small:
            examples = ", ".join(f"{s.image_path.name} {s.size[0]}x{s.size[1]} < bucket {b[0]}x{b[1]}" for s, b in too_small[:3])
            smallest = min(min(s.size) for s, _ in too_small)
            raise DatasetError(
                f"{len(too_small)} of {len(found)} images are smaller than their bucket ({examples}); "
                f"lower {key}.resolution (e.g. to {max(16, smallest // 16 * 16)}) or remove them"
            )
        samples += found * entry.repeats
        assigned += chosen * entry.repeats
        merged.samples += found
        for reason, paths in scan.skipped.items():
            merged.skipped.setdefault(reason, []).extend(paths)
    return samples, assigned, merged


def planned_mix_text(config: TrainConfig, world_size: int = 1) -> str:
    """What ``krea2 train --dry-run`` says of the datasets: one ``dataset PATH: S% of samples`` line
    each, the shares counted over the first epoch of the batch order a run on ``world_size``
    processes draws (as the run itself reports them). Several datasets are scanned and bucketed
    for it (their errors raised here, as at a run's start); a single one is all of the samples."""
    out = Path(config.output_dir)
    entries = dataset_entries(config.data, out / "synthetic_data")
    if len(entries) == 1:  # nothing to read: data.synthetic would even write its set first
        return share_line(entries[0].path, 1.0, "the only dataset")
    samples, buckets, _ = prepare_samples(config, out, SimpleNamespace(is_main=True, barrier=lambda: None))
    keys = buckets
    if config.data.references is not None:
        from .pairs import batch_keys

        keys = batch_keys(samples, buckets, config.data.references.max_pixels)
    batches = sample_batches(config, samples, keys, config.training.batch_size * world_size, out)
    return mix_text(dataset_mix(samples, entries, batches.epoch(0)))
