"""The ``dedup`` job: exact (md5) and near duplicates, one representative per group.

Near duplicates share a close perceptual hash, a close colour hash AND align: the 144-bit pHash
within ``max_hash_distance`` only proposes candidates (a 5%-per-side crop moves it as far as a
photograph that merely shares the layout), the colour hash keeps equal-luma colour variants
apart, and the crop-tolerant detail correlation of the two grey thumbnails (curation.alignment)
decides. Candidates come from an exact vectorised scan of every earlier hash (:class:`HashIndex`).

Workers claim dedup rows in parallel; the grouping itself runs under one transaction-level
advisory lock, so two near duplicates handled by two workers at once still meet. Each worker keeps
the index in memory and catches up with rows others grouped since (``dedup_seq`` order): work per
batch is proportional to the batch plus what is new, not to the table. The representative is the
largest image (pixels), then the oldest (first ingested); a larger late arrival takes over its group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .config import DedupConfig
from .alignment import similarity
from .hashing import colour_distance, hash_int
from .warehouse import Warehouse

DEDUP_LOCK = 0x6B72656132_02
"""Advisory lock key serialising the grouping step of every dedup worker."""
DUPLICATE_REASONS = ("exact_duplicate", "near_duplicate")


class HashIndex:
    """Every indexed hash in a (N, words) uint64 array; a query XORs and popcounts them all.

    Exact and linear per query (~5 ns a hash with numpy): 1e5 hashes take ~0.5 ms. The crop
    tolerance needs a candidate radius (~30% of the bits) at which any bucketed search (multi-index
    hashing) degenerates into probing most of its buckets, so the index is a plain vectorised scan.
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
        best = None
        for key, distance in self.index.query(value):
            member = self.members[key]
            if member.thumbnail is None or thumbnail is None:
                continue
            if colour_distance(member.colour, colour) > self.config.max_colour_distance:
                continue
            score = similarity(member.thumbnail, thumbnail)
            if score >= self.config.min_similarity and (best is None or (score, -distance) > best[0]):
                best = ((score, -distance), key, float(distance))
        return None if best is None else (best[1], best[2])

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

    def add_known(self, image_id: int, md5: str, phash: bytes, colour: bytes, thumbnail: bytes | None,
                  area: int, group: int) -> None:
        """Index an image another worker already grouped (its group as stored): no search."""
        self.by_md5.setdefault(md5, image_id)
        self.index.add(image_id, hash_int(phash))
        self.members[image_id] = Member(group, area, md5, colour, thumbnail)
        self.groups[group].append(image_id)

    def representative(self, group: int) -> int:
        """Largest (pixels), then oldest (smallest id = first ingested)."""
        return max(self.groups[group], key=lambda i: (self.members[i].area, -i))

    def reason(self, image_id: int, representative: int) -> str:
        same = self.members[image_id].md5 == self.members[representative].md5
        return DUPLICATE_REASONS[0] if same else DUPLICATE_REASONS[1]


class DedupJob:
    """The dedup step of one worker (its in-memory index survives across batches)."""

    def __init__(self, config: DedupConfig):
        self.dedup = Deduplicator(config)
        self.last_seq = 0

    def _catch_up(self, conn) -> None:
        rows = conn.execute("SELECT id, md5, phash, colour_hash, thumbnail, width::bigint * height, dedup_group, "
                            "dedup_seq FROM images WHERE dedup_seq > %s ORDER BY dedup_seq", (self.last_seq,)).fetchall()
        for image_id, md5, phash, colour, thumbnail, area, group, seq in rows:
            self.dedup.add_known(image_id, md5, bytes(phash), bytes(colour), thumbnail and bytes(thumbnail), area, group)
            self.last_seq = seq

    def ready(self, warehouse: Warehouse) -> bool:
        return True

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        try:
            self._run(warehouse, rows)
        except BaseException:
            # The transaction rolled back: forget what this batch placed; the next batch reloads
            # the index from the table.
            self.dedup = Deduplicator(self.dedup.config)
            self.last_seq = 0
            raise

    def _run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        conn = warehouse.conn
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (DEDUP_LOCK,))
            self._catch_up(conn)
            seqs = [r[0] for r in conn.execute("SELECT nextval('dedup_seq') FROM generate_series(1, %s)", (len(rows),))]
            placed = []
            for row, seq in zip(rows, seqs):
                group, distance = self.dedup.place(row["id"], row["md5"], bytes(row["phash"]), bytes(row["colour_hash"]),
                                                   bytes(row["thumbnail"]), row["width"] * row["height"])
                placed.append((row["id"], group, distance, seq))
            self.last_seq = max(self.last_seq, max(p[3] for p in placed))
            groups = {p[1] for p in placed}
            reps = {g: self.dedup.representative(g) for g in groups}
            ids, group_ids, distances, seqs, dups, reasons = [], [], [], [], [], []
            for image_id, group, distance, seq in placed:
                rep = reps[group]
                ids.append(image_id)
                group_ids.append(group)
                distances.append(distance)
                seqs.append(seq)
                dups.append(None if rep == image_id else rep)
                reasons.append(None if rep == image_id else self.dedup.reason(image_id, rep))
            conn.execute(
                "UPDATE images i SET dedup_group = v.g, dedup_distance = v.d, dedup_seq = v.s, duplicate_of = v.dup, "
                "dedup_done_at = clock_timestamp(), dedup_claimed_by = NULL, dedup_error = NULL, "
                "status = CASE WHEN v.reason IS NULL THEN 'kept' ELSE 'dropped' END, drop_reason = v.reason, "
                "drop_score = CASE WHEN v.reason IS NULL THEN NULL ELSE v.d END, "
                "drop_job = CASE WHEN v.reason IS NULL THEN NULL ELSE 'dedup' END "
                "FROM unnest(%s::bigint[], %s::bigint[], %s::real[], %s::bigint[], %s::bigint[], %s::text[]) "
                "AS v(id, g, d, s, dup, reason) WHERE i.id = v.id AND i.dedup_claimed_by = pg_backend_pid()",
                (ids, group_ids, distances, seqs, dups, reasons))
            # When a new arrival became its group's representative, the earlier members follow it.
            batch = set(ids)
            earlier = [(m, g) for g in groups if reps[g] in batch for m in self.dedup.groups[g] if m not in batch]
            if earlier:
                members = [m for m, _ in earlier]
                new_reps = [reps[g] for _, g in earlier]
                old_reasons = [None if reps[g] == m else self.dedup.reason(m, reps[g]) for m, g in earlier]
                conn.execute(
                    "UPDATE images i SET duplicate_of = CASE WHEN v.rep = i.id THEN NULL ELSE v.rep END, "
                    "status = CASE WHEN v.reason IS NULL THEN 'kept' ELSE 'dropped' END, drop_reason = v.reason, "
                    "drop_job = CASE WHEN v.reason IS NULL THEN NULL ELSE 'dedup' END "
                    "FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS v(id, rep, reason) "
                    "WHERE i.id = v.id AND (i.status = 'kept' OR i.drop_reason IN ('exact_duplicate', 'near_duplicate'))",
                    (members, new_reps, old_reasons))
            warehouse.release_log("dedup", ids, "done")
