"""The typed configuration of a curation warehouse: queue policy and every job's thresholds.

A YAML file (``--config``) holds any subset of the sections below; unknown keys are refused with
the closest valid name (the parser is finetune's, so both tools reject typos the same way).
Defaults are the Krea 2 report's choices where it gives them, otherwise conservative values that
drop only what is clearly unusable; curation/README.md gives the reasoning for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from finetune.config import ConfigError, config_from_dict

from .hash_index import SUBSTRING_BITS, SUBSTRINGS

INDEXED_BITS = SUBSTRINGS * SUBSTRING_BITS


@dataclass
class QueueConfig:
    batch_size: int = 64
    """Rows one claim takes (``work --batch`` overrides it)."""
    max_attempts: int = 4
    """A row whose job raised this many times is marked ``failed`` with its last error."""
    backoff_s: float = 10.0
    """A failed row waits ``backoff_s * 2**(attempts-1)`` seconds before it is claimable again."""
    poll_s: float = 1.0
    """How often an idle worker looks again while others still hold rows."""
    rate_window_s: float = 60.0
    """``status`` reports rows/s over this trailing window."""


@dataclass
class ProbeConfig:
    max_pixels: int = 200_000_000
    """Headers declaring more pixels are dropped unread (``too_large``): a decompression bomb guard."""
    max_side: int = 30_000


@dataclass
class FilterConfig:
    min_side: int = 256
    """Shorter side in pixels: below the first pretraining stage (256 px) an image only adds blur."""
    max_aspect_ratio: float = 3.0
    """Long side / short side; panoramas and strips crop badly into any training bucket."""
    analysis_side: int = 256
    """Images are scored at this longer side, so thresholds do not depend on the resolution."""
    min_neighbour_correlation: float = 0.6
    """Noise: the correlation of neighbouring grey pixels of the analysis thumbnail. Uniform or
    Gaussian i.i.d. noise scores ~0.3 at any size and strength (the thumbnail's antialiasing),
    photographs 0.75-1.0 even with film grain of sigma 8; dense textures (foliage, gravel seen
    from afar) sit at 0.6-0.85, so a higher threshold starts dropping them."""
    min_entropy: float = 2.0
    """Bits of the joint RGB histogram (16 levels per channel); a flat or two-tone image is below."""
    max_black_white_fraction: float = 0.95
    """Share of near-black (<16) plus near-white (>239) pixels: blank pages, black frames, scans."""
    max_dominant_fraction: float = 0.85
    """Share of the most common colour (5 bits/channel): a flat background with a speck of content.
    Illustrations with large uniform regions stay well below it."""
    border_min_fraction: float = 0.03
    """A uniform margin of at least this share of the side, ending at a hard edge, is a border."""
    uniform_tolerance: int = 12
    """Max deviation (grey levels) of a pixel from its row's median colour to count as uniform."""


@dataclass
class DedupConfig:
    hash_size: int = 12
    """Perceptual hash of hash_size**2 bits (low DCT frequencies vs their median)."""
    max_hash_distance: int = 44
    """Candidate radius in bits: copies cropped by up to 5% a side, resized to 50% and saved at JPEG
    q60 differ in up to ~40 of the 144 bits, unrelated photographs in 48 or more. Larger widens
    what alignment must reject (slower), smaller misses cropped copies."""
    colour_grid: int = 4
    """Colour hash: mean chroma (Cb, Cr) of each cell of a colour_grid x colour_grid grid."""
    max_colour_distance: float = 8.0
    """Mean absolute chroma difference (0-255) above which two same-structure images are distinct:
    cropped and recompressed copies score up to ~6, equal-luma colour variants 25 or more."""
    min_similarity: float = 0.7
    """Crop-tolerant detail correlation of the two thumbnails (curation.alignment) a candidate
    needs: copies score 0.85-1.0, photographs sharing only a layout up to ~0.45, unrelated ones
    ~0.3. Lower merges look-alikes, higher splits heavily recompressed or cropped copies."""


@dataclass
class CaptionConfig:
    model: str = "Qwen/Qwen3-VL-4B-Instruct"
    """The pipeline's Qwen3-VL (its hub id, a Krea 2 folder or its text_encoder), any transformers
    Qwen-VL id, or tiny-random (RANDOM weights: only with ``--allow-random-weights``)."""
    max_new_tokens: int = 256
    rewrite_max_new_tokens: int = 96
    max_pixels: int = 448 * 448
    seed: int = 0


@dataclass
class EmbedConfig:
    model: str = "google/siglip2-base-patch16-224"
    """A transformers vision encoder (SigLIP-2, DINOv2: e.g. facebook/dinov2-small) or tiny-random
    (RANDOM weights: only with ``--allow-random-weights``)."""
    batch_size: int = 32


@dataclass
class ClusterConfig:
    levels: list[int] = field(default_factory=lambda: [64, 8])
    """Clusters per level: level 0 splits all embeddings, each later level splits its parent's members."""
    iterations: int = 20
    seed: int = 0
    semantic_threshold: float = 0.95
    """Cosine similarity at or above which two images of one leaf cluster are semantic duplicates."""


@dataclass
class CurationConfig:
    queue: QueueConfig = field(default_factory=QueueConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        if self.queue.batch_size < 1 or self.queue.max_attempts < 1:
            raise ConfigError("queue.batch_size and queue.max_attempts must be at least 1")
        bits = self.dedup.hash_size ** 2
        if self.dedup.hash_size < 2 or not 0 <= self.dedup.max_hash_distance < bits:
            raise ConfigError(f"dedup.max_hash_distance ({self.dedup.max_hash_distance}) must lie in [0, {bits}) "
                              f"for a hash of {bits} bits (dedup.hash_size {self.dedup.hash_size})")
        if bits - 1 < INDEXED_BITS:
            raise ConfigError(f"dedup.hash_size ({self.dedup.hash_size}) gives {bits} bits; the near-duplicate index "
                              f"keys {INDEXED_BITS} of them besides the DC bit: use dedup.hash_size >= 9")
        if not -1 <= self.dedup.min_similarity <= 1:
            raise ConfigError(f"dedup.min_similarity ({self.dedup.min_similarity}) is a correlation in [-1, 1]")
        if not self.cluster.levels or min(self.cluster.levels) < 1:
            raise ConfigError(f"cluster.levels must be a non-empty list of positive counts, got {self.cluster.levels}")


def load_config(path: str | Path | None) -> CurationConfig:
    """The config in ``path`` (YAML), or the defaults when ``path`` is None."""
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"curation config {str(path)!r} not found")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    config = config_from_dict(CurationConfig, raw)
    config.validate()
    return config
