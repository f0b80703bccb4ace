"""From a config to the list of samples and their buckets, with every fixable problem reported
before a model is loaded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .buckets import fits, make_buckets, nearest_bucket
from ..config import TrainConfig
from .dataset import DatasetError, DatasetScan, make_synthetic_dataset, scan_dataset
from .datasets import dataset_entries, entry_key
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
