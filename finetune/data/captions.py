"""Per-dataset caption rules: a trigger-word prefix and comma-tag shuffling with a kept head.

Captions are encoded once, before training, into the text cache; a shuffled caption therefore
cannot be drawn at the step that uses it. Instead every sample gets its tag orders ahead of time:
order ``e % MAX_TAG_ORDERS`` for epoch ``e``, each a pure function of ``(seed, sample, order)``,
so a resumed run (or any process count) trains on exactly the same captions, and the cache holds
at most :data:`MAX_TAG_ORDERS` variants per sample (a variant of a 12-layer x 2560-wide caption of
60 tokens is ~7 MB of float32 features).

Caption dropout (the empty prompt, per dataset) is drawn per step in the loader, from the step's
generator (:class:`finetune.engine.loader.CachedFeatures`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from .config import DatasetConfig
from .dataset import Sample

MAX_TAG_ORDERS = 16
"""Distinct tag orders per sample; epochs beyond it reuse them in turn."""
TAG_SEPARATOR = ", "


def split_tags(caption: str) -> list[str]:
    """``"a, b ,, c"`` -> ``["a", "b", "c"]``: comma-separated tags, stripped, empty ones dropped."""
    return [tag.strip() for tag in caption.split(",") if tag.strip()]


def with_prefix(caption: str, prefix: str) -> str:
    """``prefix`` in front of ``caption`` joined with ", " (just ``prefix`` for an empty caption);
    a caption that already holds the prefix is left as it is (the Train tab's trigger word too)."""
    prefix = prefix.strip()
    if not prefix or prefix in caption:
        return caption
    return f"{prefix}{TAG_SEPARATOR}{caption}" if caption else prefix


def shuffled(caption: str, keep: int, rng: random.Random) -> str:
    """The caption's tags with the first ``keep`` in place and the rest in ``rng``'s order."""
    tags = split_tags(caption)
    head, tail = tags[:keep], tags[keep:]
    rng.shuffle(tail)
    return TAG_SEPARATOR.join(head + tail)


def tag_order_rng(seed: int, sample: int, order: int) -> random.Random:
    digest = hashlib.sha256(f"tags:{seed}:{sample}:{order}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def caption_variants(samples: Sequence[Sample], datasets: Sequence[DatasetConfig], seed: int, epochs: int) -> list[list[str]]:
    """Per sample (index into the repeated sample list), the captions of its epochs in turn:
    one caption when its dataset does not shuffle tags (or it has fewer than two tags to move),
    else ``min(epochs, MAX_TAG_ORDERS)`` tag orders. The prefix is added after shuffling, so it
    always leads."""
    variants = []
    for index, sample in enumerate(samples):
        rules = datasets[sample.dataset]
        movable = len(split_tags(sample.caption)) - rules.keep_tags
        if not rules.shuffle_tags or movable < 2:
            variants.append([with_prefix(sample.caption, rules.caption_prefix)])
            continue
        orders = max(1, min(epochs, MAX_TAG_ORDERS))
        variants.append([with_prefix(shuffled(sample.caption, rules.keep_tags, tag_order_rng(seed, index, order)),
                                     rules.caption_prefix) for order in range(orders)])
    return variants
