"""From a config to the list of samples and their buckets, with every fixable problem reported
before a model is loaded."""

from __future__ import annotations

import logging
from pathlib import Path

from .buckets import fits, make_buckets, nearest_bucket
from ..config import TrainConfig
from .dataset import DatasetError, make_synthetic_dataset, scan_dataset

logger = logging.getLogger("finetune")


def prepare_samples(config: TrainConfig, out: Path, runtime):
    """Scan the dataset and bucket it; every error a user can fix is raised here, before any model loads."""
    data = config.data
    path = Path(data.path) if data.path else out / "synthetic_data"
    if data.synthetic is not None:
        if runtime.is_main:
            make_synthetic_dataset(path, data.synthetic.num_prompts, data.synthetic.images_per_prompt, data.synthetic.size)
        runtime.barrier()
    scan = scan_dataset(path)
    if scan.skipped:
        logger.warning("dataset %s: %s", path, scan.summary())
    buckets = make_buckets(data.resolution, data.bucket_step, data.min_aspect_ratio, data.max_aspect_ratio)
    assigned = [nearest_bucket(*s.size, buckets) for s in scan.samples]
    too_small = [(s, b) for s, b in zip(scan.samples, assigned) if not fits(*s.size, b)]
    if too_small:
        examples = ", ".join(f"{s.image_path.name} {s.size[0]}x{s.size[1]} < bucket {b[0]}x{b[1]}" for s, b in too_small[:3])
        smallest = min(min(s.size) for s, _ in too_small)
        raise DatasetError(
            f"{len(too_small)} of {len(scan.samples)} images are smaller than their bucket ({examples}); "
            f"lower data.resolution (e.g. to {max(16, smallest // 16 * 16)}) or remove them"
        )
    samples = scan.samples * data.repeats
    return samples, assigned * data.repeats, scan
