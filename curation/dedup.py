"""The ``dedup`` job: exact (md5) and near duplicates, one representative per group.

Near duplicates share a close perceptual hash, a close colour hash AND align: the 144-bit pHash
within ``max_hash_distance`` only proposes candidates (a 5%-per-side crop moves it as far as a
photograph that merely shares the layout), the colour hash keeps equal-luma colour variants
apart, and the crop-tolerant detail correlation of the two grey thumbnails (curation.alignment)
decides (:func:`best_match`). Workers take candidates from the index in the warehouse
(curation/hash_index.py: per-image cost flat in the table, thumbnails fetched for candidates
only) and keep nothing between batches; row locks, not a lock over the warehouse, settle two
workers placing near duplicates at once (:class:`DedupJob`).
:class:`Deduplicator` is the in-memory reference (the exact scan, :class:`HashIndex`) that the
quality tests and the bench's recall use. The representative is the largest image (pixels), then
the oldest (first ingested); a larger late arrival takes over its group.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import psycopg

from .config import DedupConfig
from .alignment import similarity
from .hash_index import bit_order, candidates
from .hashing import colour_distance, hash_int
from .warehouse import Warehouse

DUPLICATE_REASONS = ("exact_duplicate", "near_duplicate")


def best_match(found: Iterable[tuple[int, int, bytes, bytes | None, int]], colour: bytes, thumbnail: bytes | None,
               config: DedupConfig) -> tuple[int, int, int] | None:
    """The candidate an image copies, as ``(key, distance, group)``, or None. ``found``: candidates
    within ``max_hash_distance`` as ``(key, distance, colour hash, thumbnail, group)``; each must be
    as close in colour and align (crop-tolerant detail correlation >= ``min_similarity``); the
    best-aligned wins, then the closest hash. A thumbnail of None (rows deduplicated before schema 2)
    matches by md5 only."""
    best = None
    for key, distance, other_colour, other_thumbnail, group in found:
        if other_thumbnail is None or thumbnail is None:
            continue
        if colour_distance(other_colour, colour) > config.max_colour_distance:
            continue
        score = similarity(other_thumbnail, thumbnail)
        if score >= config.min_similarity and (best is None or (score, -distance) > best[0]):
            best = ((score, -distance), (key, distance, group))
    return None if best is None else best[1]


def representative(members: Iterable[tuple[int, int]]) -> int:
    """Of ``(id, area)`` members: the largest (pixels), then the oldest (smallest id = first ingested)."""
    return max(members, key=lambda m: (m[1], -m[0]))[0]


class HashIndex:
    """The reference exact scan (quality tests, the bench's recall): every indexed hash in a (N, words)
    uint64 array; a query XORs and popcounts them all.

    Exact and linear per query (~5 ns a hash with numpy): 1e5 hashes take ~0.5 ms, 1e7 ~50 ms, and
    every worker would hold the whole table. Workers use the warehouse's index
    (curation/hash_index.py: flat cost, approximate), measured against this scan.
    """

    def __init__(self, bits: int, max_distance: int):
        self.words = (bits + 63) // 64
        self.max_distance = max_distance
        self.keys = np.zeros(0, np.int64)
        self.table = np.zeros((0, self.words), np.uint64)
        self.size = 0

    def _split(self, value: int) -> np.ndarray:
        return np.array([(value >> (64 * w)) & 0xFFFFFFFFFFFFFFFF for w in range(self.words)], np.uint64)

    def add(self, key: int, value: int) -> None:
        if self.size == len(self.keys):  # amortised growth: appends stay O(1)
            capacity = max(1024, 2 * self.size)
            self.keys = np.resize(self.keys, capacity)
            self.table = np.resize(self.table, (capacity, self.words))
        self.keys[self.size] = key
        self.table[self.size] = self._split(value)
        self.size += 1

    def query(self, value: int) -> list[tuple[int, int]]:
        """Every indexed ``(key, distance)`` within ``max_distance`` bits of ``value``."""
        table, words = self.table[:self.size], self._split(value)
        distance = np.bitwise_count(table[:, 0] ^ words[0]).astype(np.int32)
        for w in range(1, self.words):
            distance += np.bitwise_count(table[:, w] ^ words[w])
        hits = np.flatnonzero(distance <= self.max_distance)
        return list(zip(self.keys[hits].tolist(), distance[hits].tolist()))

    def __len__(self) -> int:
        return self.size


@dataclass
class Member:
    group: int
    area: int
    md5: str
    colour: bytes
    thumbnail: bytes | None
    """The grey alignment thumbnail; None for rows deduplicated before schema 2 (md5 only)."""


class Deduplicator:
    """Groups hashes incrementally: md5 first, then the nearest near-duplicate by (phash, colour)."""

    def __init__(self, config: DedupConfig):
        self.config = config
        self.index = HashIndex(config.hash_size ** 2, config.max_hash_distance)
        self.members: dict[int, Member] = {}
        self.groups: dict[int, list[int]] = defaultdict(list)
        self.by_md5: dict[str, int] = {}

    def match(self, value: int, colour: bytes, thumbnail: bytes | None) -> tuple[int, float] | None:
        """The indexed image this one copies, as ``(key, distance)``, or None. Candidates come from
        the hash within ``max_hash_distance``, then must be as close in colour and align (crop-
        tolerant detail correlation >= ``min_similarity``); the best-aligned candidate wins."""
        found = best_match(((key, distance, self.members[key].colour, self.members[key].thumbnail, self.members[key].group)
                            for key, distance in self.index.query(value)), colour, thumbnail, self.config)
        return None if found is None else (found[0], float(found[1]))

    def place(self, image_id: int, md5: str, phash: bytes, colour: bytes, thumbnail: bytes | None,
              area: int) -> tuple[int, float]:
        """Put an image in a group (its own when nothing matches); returns (group, distance)."""
        value = hash_int(phash)
        if md5 in self.by_md5:
            group, distance = self.members[self.by_md5[md5]].group, 0.0
        else:
            found = self.match(value, colour, thumbnail)
            group, distance = (self.members[found[0]].group, found[1]) if found else (image_id, 0.0)
            self.by_md5[md5] = image_id
        self.index.add(image_id, value)
        self.members[image_id] = Member(group, area, md5, colour, thumbnail)
        self.groups[group].append(image_id)
        return group, distance

    def representative(self, group: int) -> int:
        """Largest (pixels), then oldest (smallest id = first ingested)."""
        return representative((i, self.members[i].area) for i in self.groups[group])

    def reason(self, image_id: int, representative: int) -> str:
        same = self.members[image_id].md5 == self.members[representative].md5
        return DUPLICATE_REASONS[0] if same else DUPLICATE_REASONS[1]


class DedupJob:
    """The dedup step of one worker: every batch reads and writes the warehouse (no state kept).

    No lock spans the warehouse. A row enters the index when the filter job writes its hash, so of
    two copies deduplicated at once, each worker having committed its rows' hashes before probing,
    at least one sees the other. A candidate not placed yet is locked (``FOR UPDATE``; each batch
    locks its own rows first, in id order): the worker waits until its owner placed it and joins
    its group, or, if nobody holds it, leaves it, and its owner, waiting on the lock, then sees
    this row placed. Two workers waiting on each other's rows are a deadlock Postgres breaks by
    aborting one, which re-runs its batch. Nothing is grouped twice."""

    RETRIES = 100

    def __init__(self, config: DedupConfig):
        self.config = config
        bit_order(config.hash_size)  # refuses a hash too short for the index before any claim

    def ready(self, warehouse: Warehouse) -> bool:
        return True

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        conn = warehouse.conn
        for attempt in range(self.RETRIES):
            try:
                with conn.transaction():
                    self._place(conn, rows)
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == self.RETRIES - 1:
                    raise
                time.sleep(random.uniform(0, 0.01 * min(attempt + 1, 20)))  # de-synchronise the retries
        warehouse.release_log("dedup", [r["id"] for r in rows], "done")

    @staticmethod
    def _placed(conn, image_id: int) -> int | None:
        """The group of a candidate nobody had placed when it was found: waits for the worker
        holding it, if any, to finish (its row lock); None while it is still unplaced."""
        return conn.execute("SELECT dedup_group FROM images WHERE id = %s FOR UPDATE", (image_id,)).fetchone()[0]

    def _place(self, conn, rows: list[dict]) -> None:
        config = self.config
        conn.execute("SELECT id FROM images WHERE id = ANY(%s) ORDER BY id FOR UPDATE", ([r["id"] for r in rows],))
        for row in rows:
            phash, colour, thumbnail = bytes(row["phash"]), bytes(row["colour_hash"]), bytes(row["thumbnail"])
            group, distance = None, 0.0
            for other, other_group in conn.execute("SELECT id, dedup_group FROM images WHERE md5 = %s AND id <> %s "
                                                   "AND phash IS NOT NULL ORDER BY id", (row["md5"], row["id"])).fetchall():
                group = other_group if other_group is not None else self._placed(conn, other)
                if group is not None:
                    break
            if group is None:
                weak = row["phash_weak"] and bytes(row["phash_weak"])
                near = [(c[0], c[1], bytes(c[2]), c[3] and bytes(c[3]), self._placed(conn, c[0]) if c[4] is None else c[4])
                        for c in candidates(conn, phash, weak, config.hash_size, config.max_hash_distance)
                        if c[0] != row["id"]]
                found = best_match((c for c in near if c[4] is not None), colour, thumbnail, config)
                group, distance = (found[2], float(found[1])) if found else (row["id"], 0.0)
            placed = conn.execute(
                "UPDATE images SET dedup_group = %s, dedup_distance = %s, dedup_seq = nextval('dedup_seq'), "
                "dedup_done_at = clock_timestamp(), dedup_claimed_by = NULL, dedup_error = NULL "
                "WHERE id = %s AND dedup_claimed_by = pg_backend_pid() RETURNING id",
                (group, distance, row["id"])).fetchone()
            if placed:
                self._settle(conn, group)

    @staticmethod
    def _settle(conn, group: int) -> None:
        """Point every member of ``group`` at its representative (largest, then oldest) and set
        the statuses: members dropped for another reason (filters never reach dedup, but a
        semantic duplicate may) keep it, and so do those ``dedup-shards`` dropped (their kept copy
        lives in another shard; a larger late arrival becomes kept here and meets it at the next
        ``dedup-shards`` run)."""
        members = conn.execute("SELECT id, width::bigint * height, md5 FROM images WHERE dedup_group = %s "
                               "ORDER BY id FOR UPDATE", (group,)).fetchall()
        rep = representative([(m[0], m[1]) for m in members])
        rep_md5 = next(m[2] for m in members if m[0] == rep)
        reasons = [None if m[0] == rep else DUPLICATE_REASONS[0] if m[2] == rep_md5 else DUPLICATE_REASONS[1]
                   for m in members]
        conn.execute(
            "UPDATE images i SET duplicate_of = CASE WHEN v.reason IS NULL THEN NULL ELSE %s END, "
            "status = CASE WHEN v.reason IS NULL THEN 'kept' ELSE 'dropped' END, drop_reason = v.reason, "
            "drop_score = CASE WHEN v.reason IS NULL THEN NULL ELSE i.dedup_distance END, "
            "drop_job = CASE WHEN v.reason IS NULL THEN NULL ELSE 'dedup' END "
            "FROM unnest(%s::bigint[], %s::text[]) AS v(id, reason) WHERE i.id = v.id "
            "AND (i.status IN ('kept', 'pending') OR i.drop_reason IN ('exact_duplicate', 'near_duplicate')) "
            "AND i.drop_job IS DISTINCT FROM 'dedup-shards' "
            "AND (i.duplicate_of IS DISTINCT FROM CASE WHEN v.reason IS NULL THEN NULL ELSE %s END "
            "     OR i.drop_reason IS DISTINCT FROM v.reason OR i.status = 'pending')",
            (rep, [m[0] for m in members], reasons, rep))
