"""The training data: finding samples (``dataset``), bucketing them (``buckets``), encoding and
caching latents and caption features once (``cache``, ``encoding``), loss masks (``masks``),
several datasets and their caption rules (``datasets``, ``captions``), paired samples for edit
and reference LoRAs (``pairs``, ``pair_features``, ``synthetic_pairs``), and the checks that run
before any model loads (``samples``)."""

from .dataset import IMAGE_EXTENSIONS, DatasetError, DatasetScan, Sample, make_synthetic_dataset, scan_dataset

__all__ = ["IMAGE_EXTENSIONS", "DatasetError", "DatasetScan", "Sample", "make_synthetic_dataset", "scan_dataset"]
