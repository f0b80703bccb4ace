"""Row order of a pack: a global shuffle by seed, then groups of ``batch_size`` rows per bucket.

The pack is read in order by the trainer, so this order *is* the training order: it has to be
random across the whole set (not bucket by bucket) and still give every batch a single bucket.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from ..data.buckets import Bucket, nearest_bucket


@dataclass(frozen=True)
class Group:
    bucket: Bucket
    members: tuple[int, ...]
    """Indices into the caller's list of samples, in row order."""


def group_rows(sizes: Sequence[tuple[int, int]], buckets: Sequence[Bucket], batch_size: int, seed: int) -> list[Group]:
    """Order ``sizes`` (one ``(width, height)`` per sample) into one-bucket groups of ``batch_size``.

    1. shuffle all samples with ``random.Random(seed)``;
    2. walk that order, filling each sample's nearest bucket; a bucket that reaches ``batch_size``
       emits a group (so groups appear in a random order and hold randomly drawn samples);
    3. the remainders of all buckets (fewer than ``batch_size`` each) are sorted by aspect ratio and
       cut into groups that take the bucket nearest their median sample: those few samples get a
       slightly different crop instead of being dropped;
    4. the groups are shuffled again with the same generator; the one group that may be short
       (``len(sizes) % batch_size`` samples) goes last.

    Every sample appears exactly once.
    """
    rng = random.Random(seed)
    order = list(range(len(sizes)))
    rng.shuffle(order)
    pending: dict[Bucket, list[int]] = {}
    groups: list[Group] = []
    for index in order:
        bucket = nearest_bucket(*sizes[index], buckets)
        members = pending.setdefault(bucket, [])
        members.append(index)
        if len(members) == batch_size:
            groups.append(Group(bucket, tuple(pending.pop(bucket))))
    rest = sorted((i for b in sorted(pending) for i in pending[b]), key=lambda i: math.log(sizes[i][0] / sizes[i][1]))
    tail: list[Group] = []
    for start in range(0, len(rest), batch_size):
        members = rest[start:start + batch_size]
        median = sizes[members[len(members) // 2]]
        (groups if len(members) == batch_size else tail).append(Group(nearest_bucket(*median, buckets), tuple(members)))
    rng.shuffle(groups)
    return groups + tail
