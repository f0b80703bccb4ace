"""The ``dedup`` job: exact (md5) and near duplicates, one representative per group.

Near duplicates share a close perceptual hash AND a close colour hash. Candidates come from
multi-index hashing: the 144-bit hash is cut into ``bands`` bands; two hashes within ``D`` bits
agree within ``D // bands`` bits on at least one band (pigeonhole), so a query only looks up the
buckets of its own band values flipped in at most that many bits (301 keys a band for 24-bit
bands at radius 2) instead of scanning every hash: the work per query depends on the bucket
sizes, which stay near zero while N is well below 2**24.

Workers claim dedup rows in parallel; the grouping itself runs under one transaction-level
advisory lock, so two near duplicates handled by two workers at once still meet. Each worker keeps
the index in memory and catches up with rows others grouped since (``dedup_seq`` order): work per
batch is proportional to the batch plus what is new, not to the table. The representative is the
largest image (pixels), then the oldest (first ingested); a larger late arrival takes over its group.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .config import DedupConfig
from .hashing import colour_distance, hash_int
from .warehouse import Warehouse

DEDUP_LOCK = 0x6B72656132_02
"""Advisory lock key serialising the grouping step of every dedup worker."""
DUPLICATE_REASONS = ("exact_duplicate", "near_duplicate")


class HashIndex:
    """Multi-index hashing over ``bands`` equal bands of ``bits``-bit hashes (Python ints)."""

    def __init__(self, bits: int, bands: int, max_distance: int):
        if bits % bands:
            raise ValueError(f"{bands} bands do not divide {bits} hash bits")
        self.width = bits // bands
        self.bands = bands
        self.max_distance = max_distance
        radius = max_distance // bands
        self.masks = np.array([sum(1 << b for b in flips) for r in range(radius + 1)
                               for flips in itertools.combinations(range(self.width), r)], dtype=np.int64)
        self.tables: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(bands)]
        self.hashes: dict[int, int] = {}

    def _bands(self, value: int):
        mask = (1 << self.width) - 1
        return [(value >> (self.width * b)) & mask for b in range(self.bands)]

    def add(self, key: int, value: int) -> None:
        self.hashes[key] = value
        for table, band in zip(self.tables, self._bands(value)):
            table[band].append(key)

    def query(self, value: int) -> list[tuple[int, int]]:
        """Every indexed ``(key, distance)`` within ``max_distance`` bits of ``value``."""
        candidates: set[int] = set()
        # All bands' neighbour values in one vectorised XOR; the ones that exist are found by a
        # set intersection in C rather than one dictionary probe per neighbour in Python.
        neighbours = (np.array(self._bands(value), dtype=np.int64)[:, None] ^ self.masks).tolist()
        for table, values in zip(self.tables, neighbours):
            for neighbour in table.keys() & set(values):
                candidates.update(table[neighbour])
        found = []
        for key in candidates:
            distance = (self.hashes[key] ^ value).bit_count()
            if distance <= self.max_distance:
                found.append((key, distance))
        return found

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass
class Member:
    group: int
    area: int
    md5: str
    colour: bytes


class Deduplicator:
    """Groups hashes incrementally: md5 first, then the nearest near-duplicate by (phash, colour)."""

    def __init__(self, config: DedupConfig):
        self.config = config
        self.index = HashIndex(config.hash_size ** 2, config.bands, config.max_hash_distance)
        self.members: dict[int, Member] = {}
        self.groups: dict[int, list[int]] = defaultdict(list)
        self.by_md5: dict[str, int] = {}

    def place(self, image_id: int, md5: str, phash: bytes, colour: bytes, area: int) -> tuple[int, float]:
        """Put an image in a group (its own when nothing matches); returns (group, distance)."""
        value = hash_int(phash)
        if md5 in self.by_md5:
            group, distance = self.members[self.by_md5[md5]].group, 0.0
        else:
            matches = [(d, key) for key, d in self.index.query(value)
                       if colour_distance(self.members[key].colour, colour) <= self.config.max_colour_distance]
            group, distance = (self.members[min(matches)[1]].group, float(min(matches)[0])) if matches else (image_id, 0.0)
            self.by_md5[md5] = image_id
        self.index.add(image_id, value)
        self.members[image_id] = Member(group, area, md5, colour)
        self.groups[group].append(image_id)
        return group, distance

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
        rows = conn.execute("SELECT id, md5, phash, colour_hash, width::bigint * height, dedup_seq FROM images "
                            "WHERE dedup_seq > %s ORDER BY dedup_seq", (self.last_seq,)).fetchall()
        for image_id, md5, phash, colour, area, seq in rows:
            self.dedup.place(image_id, md5, bytes(phash), bytes(colour), area)
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
                                                   row["width"] * row["height"])
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
