"""Exact near-duplicate candidate search by scanning hashes: the reference, and small warehouses.

:class:`HashIndex` XORs and popcounts every hash with numpy (~5 ns a hash): the in-memory reference
the quality tests and the bench's recall use, and, through :func:`scan_candidates`, what a dedup
batch runs while the warehouse holds at most :data:`SCAN_ROWS` hashed rows. There the scan is
cheaper than the multi-index probes (curation/hash_index.py: 8,064 index descents an image, ~7 ms
of server CPU, whatever the table's size) and exact; it reads the table's hashes once per batch
(~100 bytes a row, nothing kept after the batch).
"""

from __future__ import annotations

import numpy as np

from .hash_index import FULL, Query
from .hashing import hash_int
from .windows import WINDOWS, record_layout, window_hashes

SCAN_ROWS = 20_000
"""Largest warehouse (hashed rows) a batch scans; beyond it the index answers. Measured on this
2-core machine (64 queries a batch, each a full frame and 4 windows, worker and server): the scan
~0.2 ms an image at 1e3 rows, 0.3 at 5e3, 0.95 at 2e4, 2.7 at 5e4; the probes ~9.6 ms of CPU at
1e3 rows and no less beyond (the dedup job alone on 1,000 rows: 1.0 ms an image with the scan, 9.0
with schema 4's per-row probes). The index would pay off only from ~1.5e5 rows, but a batch reads
~100 bytes a row: 2 MB at this limit."""


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

    @classmethod
    def from_hashes(cls, keys: np.ndarray, hashes: np.ndarray, max_distance: int) -> "HashIndex":
        """An index of (N, bytes) uint8 packed hashes (MSB first, as stored) under (N,) keys."""
        index = cls(hashes.shape[1] * 8, max_distance)
        padded = np.zeros((len(hashes), index.words * 8), np.uint8)
        padded[:, index.words * 8 - hashes.shape[1]:] = hashes
        # big-endian words, least significant first (as _split orders them)
        index.table = padded.view(">u8").astype(np.uint64)[:, ::-1].copy()
        index.keys, index.size = np.asarray(keys, np.int64), len(hashes)
        return index

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


def scan_candidates(conn, queries: list[Query], hash_size: int, radius: int,
                    limit: int = SCAN_ROWS) -> list[list[tuple]] | None:
    """Per query, its candidates exactly, as :func:`curation.hash_index.batch_candidates` returns
    them, from one read of every hashed row's hashes (full frame and crop windows); None when the
    warehouse holds more than ``limit`` hashed rows (read no further: bounded work at any size)."""
    size = record_layout(hash_size, 1)[0]
    rows = conn.execute("SELECT id, phash, substring(crop_windows for %s) FROM images WHERE phash_k0 IS NOT NULL "
                        "LIMIT %s", (size * len(WINDOWS), limit + 1)).fetchall()
    if len(rows) > limit:
        return None
    ids = np.array([r[0] for r in rows], np.int64)
    full = HashIndex.from_hashes(ids, np.frombuffer(b"".join(bytes(r[1]) for r in rows), np.uint8).reshape(-1, size),
                                 radius)
    framed = [r for r in rows if r[2] is not None]
    windows = HashIndex.from_hashes(np.arange(len(framed) * len(WINDOWS)),
                                    window_hashes([bytes(r[2]) for r in framed], hash_size), radius)
    window_ids = np.repeat([r[0] for r in framed], len(WINDOWS)).astype(np.int64)
    found: list[list[tuple[int, int, int]]] = []
    for query in queries:
        value = hash_int(query.phash)
        hits = [(key, distance, FULL) for key, distance in full.query(value)]
        hits += [(int(window_ids[key]), distance, 1 + key % len(WINDOWS)) for key, distance in windows.query(value)]
        for j, (window_hash, _) in enumerate(query.windows):
            hits += [(key, distance, -(1 + j)) for key, distance in full.query(hash_int(window_hash))]
        found.append(hits)
    wanted = sorted({hit[0] for hits in found for hit in hits})
    details = {r[0]: r[1:] for r in conn.execute(
        "SELECT id, colour_hash, thumbnail, dedup_group, crop_windows FROM images WHERE id = ANY(%s)", (wanted,))}
    return [[(key, distance, view, *details[key]) for key, distance, view in hits if key in details] for hits in found]
