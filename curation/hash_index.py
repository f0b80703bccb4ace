"""The near-duplicate candidate index, kept in the warehouse: multi-index hashing over pHash substrings.

Each row the filter job hashed stores ``SUBSTRINGS`` keys (``phash_k0..k2``, 24-bit ints, one
B-tree each): the 72 lowest-frequency bits of its pHash (the DC bit, always set, left out), cut
into three runs of 24 in frequency order; and ``phash_weak``: per key, the ``WEAK_BITS`` bits whose
DCT coefficients lie closest to the median (the bits a copy flips). A query probes, per key, its
value with any subset of its weak bits flipped and, with each, up to ``PROBE_RADIUS`` other bits
(1,216 values a key, 3,648 in all); the server keeps the rows within ``max_hash_distance``.

Why this: the radius (44 of 144 bits, ~30%) is far beyond pigeonhole multi-index hashing (45
substrings of 3 bits); plain substring keys probed at a fixed radius found 0.93-0.96 of the exact
scan's pairs at a flat cost (crops flip low frequencies too); pgvector 0.6.2 (``pgserver``) has no
bit vectors, and HNSW over +-1 float vectors builds at a few thousand rows a second here (hours at
1e7). Weak-bit probing found 0.995 of 1,600 real copy pairs (crops <= 5% a side, resizes, JPEG
q60-95) in simulation and 1.0 of 300 in bench/bench_curation.py --scale; a random row matches a
probe with probability 2**-24, ~2,200 index entries a query at 1e7 rows, ~22 at 1e5.

The crop windows (curation/windows.py) have the same keys in ``image_windows``: a dedup batch
(:func:`batch_candidates`, one statement for the whole batch) probes the full-frame index with
each image's full frame and windows and the window index with its full frame. Warehouses of up to
curation.hash_scan.SCAN_ROWS rows are scanned exactly instead (cheaper there).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

SUBSTRINGS = 3
SUBSTRING_BITS = 24
WEAK_BITS = 6
"""Per key, the query flips every subset of its 6 least certain bits (smallest coefficient margins)."""
PROBE_RADIUS = 1
"""... and, with each, any one other bit: 64 * (1 + 18) = 1,216 values a key."""
KEY_COLUMNS = tuple(f"phash_k{k}" for k in range(SUBSTRINGS))


@functools.lru_cache(maxsize=4)
def bit_order(hash_size: int) -> np.ndarray:
    """(SUBSTRINGS * SUBSTRING_BITS,) positions in the packed hash (MSB first), lowest frequency
    first (ky + kx, then position), the DC bit left out."""
    if hash_size ** 2 - 1 < SUBSTRINGS * SUBSTRING_BITS:
        raise ValueError(f"dedup.hash_size {hash_size} gives {hash_size ** 2} bits; the index needs "
                         f"{SUBSTRINGS * SUBSTRING_BITS + 1}")
    order = sorted(range(1, hash_size ** 2), key=lambda i: (i // hash_size + i % hash_size, i))
    return np.array(order[:SUBSTRINGS * SUBSTRING_BITS])


def keys(phashes: np.ndarray, hash_size: int) -> np.ndarray:
    """(N, SUBSTRINGS) int64 keys of (N, bytes) uint8 packed hashes."""
    bits = np.unpackbits(phashes, axis=1)[:, bit_order(hash_size)].reshape(len(phashes), SUBSTRINGS, SUBSTRING_BITS)
    weights = (1 << np.arange(SUBSTRING_BITS - 1, -1, -1)).astype(np.int64)
    return bits.astype(np.int64) @ weights


def row_keys(phash: bytes, hash_size: int) -> list[int]:
    return keys(np.frombuffer(phash, np.uint8)[None], hash_size)[0].tolist()


def weak_bits(margins: np.ndarray, hash_size: int) -> bytes:
    """Per key, the positions (0..SUBSTRING_BITS-1, MSB first) of its WEAK_BITS bits with the
    smallest margins (:func:`~curation.hashing.perceptual_hash_margins`): SUBSTRINGS * WEAK_BITS bytes."""
    per_key = margins[bit_order(hash_size)].reshape(SUBSTRINGS, SUBSTRING_BITS)
    return np.argsort(per_key, axis=1, kind="stable")[:, :WEAK_BITS].astype(np.uint8).tobytes()


@functools.lru_cache(maxsize=1)
def _subset_matrix() -> np.ndarray:
    """(2**WEAK_BITS, WEAK_BITS) 0/1: every subset of the weak bits."""
    return (np.arange(1 << WEAK_BITS)[:, None] >> np.arange(WEAK_BITS)[None]) & 1


def probe_arrays(row: list[int], weak: bytes | None, radius: int = PROBE_RADIUS) -> list[np.ndarray]:
    """Per key, the values probed (sorted int64): the key with any subset of its weak bits flipped,
    each also with up to ``radius`` other bits flipped. ``weak`` None (rows filtered before schema
    4): the radius alone (25 values a key at radius 1, lower recall on cropped copies)."""
    weak_sets = np.frombuffer(weak, np.uint8).reshape(SUBSTRINGS, WEAK_BITS) if weak else [None] * SUBSTRINGS
    out = []
    for key, positions in zip(row, weak_sets):
        if positions is None:
            shifts, subsets = [], np.zeros(1, np.int64)
        else:
            shifts = (SUBSTRING_BITS - 1 - positions.astype(np.int64)).tolist()
            subsets = _subset_matrix() @ (np.int64(1) << np.array(shifts, np.int64))
        others = [b for b in range(SUBSTRING_BITS) if b not in shifts]
        singles = [0]
        for flips in range(1, radius + 1):
            singles += [sum(1 << b for b in bits) for bits in itertools.combinations(others, flips)]
        out.append(np.unique((np.int64(key) ^ subsets)[:, None] ^ np.array(singles, np.int64)[None]))
    return out


def probes(row: list[int], weak: bytes | None, radius: int = PROBE_RADIUS) -> list[list[int]]:
    """:func:`probe_arrays` as lists."""
    return [values.tolist() for values in probe_arrays(row, weak, radius)]


def bit_text(phash: bytes) -> str:
    """The hash as a bit string literal for SQL's ``varbit`` (MSB first, as packed)."""
    return "".join(f"{byte:08b}" for byte in phash)


CANDIDATES_SQL = (
    "WITH hits AS MATERIALIZED (" + " UNION ALL ".join(
        f"SELECT h.id, h.distance FROM unnest(%(p{k})b::int[]) AS p{k}(v) CROSS JOIN LATERAL "
        f"(SELECT id, bit_count(phash_bits # %(bits)s::varbit) AS distance FROM images WHERE {c} = p{k}.v "
        f"AND bit_count(phash_bits # %(bits)s::varbit) <= %(radius)s OFFSET 0) AS h" for k, c in enumerate(KEY_COLUMNS))
    + "), near AS (SELECT DISTINCT id, distance FROM hits) "
    "SELECT i.id, near.distance, i.colour_hash, i.thumbnail, i.dedup_group FROM near JOIN images i ON i.id = near.id")
# Each probed value is looked up on its own (a LATERAL subquery the planner cannot flatten: one
# index-only descent a value); planned as a join, the planner hashed the whole table at 1e5 rows
# (its cost model prices 3,648 descents above a scan), 50x slower. The radius is checked on the
# index entries (INCLUDE phash_bits) inside each descent, so only rows within it are collected:
# at 1e7 rows a query meets ~2,200 entries that agree on a key by chance (0.6 a key value), and
# materialising them all before filtering cost 0.6-1.4 ms a query there (~0.01 ms at 1e5). The distance
# is on the hash as a bit string, because decoding the bytea one (hex, then varbit) cost ~4 us an entry.
"""Placed rows (only they carry keys) agreeing with the query on a probed key and within the
radius on the whole hash. Each key's index holds the hash as a bit string (INCLUDE phash_bits), so
the distance is computed on index entries (an index-only scan) and only rows within the radius are read:
their colour hash and thumbnail come back, for these candidates only."""


def candidates(conn, phash: bytes, weak: bytes | None, hash_size: int, radius: int) -> list[tuple]:
    """``(id, distance, colour_hash, thumbnail, dedup_group)`` of the candidate rows for a hash
    (the full-frame index alone, one query: the scale bench's unit)."""
    params = {f"p{k}": Int4Array(values) for k, values in enumerate(probe_arrays(row_keys(phash, hash_size), weak))}
    return conn.execute(CANDIDATES_SQL, {**params, "bits": bit_text(phash), "radius": radius}).fetchall()


class Int4Array:
    """A numpy integer vector sent to Postgres as a binary ``int4[]`` (psycopg's list dumper formats
    every element through a regular expression: 4 of a worker's 6.7 ms an image at 1,000 rows)."""

    def __init__(self, values):
        self.values = np.asarray(values, np.int64)


class _Int4ArrayDumper(Dumper):
    format = Format.BINARY
    oid = 1007  # int4[]

    def dump(self, obj: Int4Array) -> bytes:
        count = len(obj.values)
        if not count:
            return np.array([0, 0, 23], ">i4").tobytes()  # no dimension, no flags, int4 elements
        body = np.empty((count, 2), ">i4")
        body[:, 0], body[:, 1] = 4, obj.values
        return np.array([1, 0, 23, count, 1], ">i4").tobytes() + body.tobytes()


psycopg.adapters.register_dumper(Int4Array, _Int4ArrayDumper)

FULL = 0
"""A candidate's view (:func:`batch_candidates`): both full frames. ``1 + j``: the candidate's
window j against the query's full frame (the query is the crop); ``-(1 + j)``: the query's window
j against the candidate's full frame (the query is the original)."""
WINDOW_PROBE_RADII = (1, 0, 0)
"""Per key, the extra bits a full frame's probe of the window index flips besides its weak bits:
the first (lowest-frequency) key at radius 1, the others at 0 (1,344 values, not 3,648)."""
WINDOW_VIEW_RADII = (1, 1, 0, 0)
"""Per crop window (curation.windows.WINDOWS), the extra bits its probes of the full-frame index
flip on the first key (the others: weak bits alone): 1,344 values for the 0.85 and 0.75 windows,
192 for the aspect ones (their copies lie within 2 bits). Measured on 250 originals
(bench_curation.py --crops): with every window at radius 0 the original's windows found 0.944 of
the 10-15% crops the exact scan finds, the crop's full frame finding the original's window 0.992;
radius 0 on every key of the window index found 0.94 of them in simulation."""


@dataclass
class Query:
    """One image's hashes: the full frame's and, when it has crop windows, each window's."""

    phash: bytes
    weak: bytes | None
    windows: list[tuple[bytes, bytes]] = field(default_factory=list)
    """``(phash, weak)`` of each window of curation.windows.WINDOWS (empty: full frame only)."""


def _probe_sql() -> str:
    # One probe list per key and index: the full-frame index (queried with every view: the full
    # frame's own probes, then the windows'), the window index (the full frame's, view 0 only).
    lists = "".join(f"{name}{k} AS (SELECT * FROM unnest(%({name}q{k})b::int[], %({name}view{k})b::int[], "
                    f"%({name}v{k})b::int[]) AS p(q, view, v)), " for name in ("f", "w") for k in range(SUBSTRINGS))
    lookups = []
    within = "bit_count(phash_bits # q.bits)"  # checked inside each descent, as in CANDIDATES_SQL
    for k, column in enumerate(KEY_COLUMNS):
        for name, table, crop in (("f", "images", "-1"), ("w", "image_windows", "crop")):
            lookups.append(f"SELECT p.q, p.view, h.id, h.crop, h.distance FROM {name}{k} p "
                           f"JOIN queries q ON q.q = p.q AND q.view = p.view CROSS JOIN LATERAL "
                           f"(SELECT id, {crop} AS crop, {within} AS distance FROM {table} WHERE {column} = p.v "
                           f"AND {within} <= %(radius)s OFFSET 0) AS h")
    return (
        "WITH queries AS (SELECT * FROM unnest(%(qq)b::int[], %(qview)b::int[], %(qbits)s::varbit[]) AS q(q, view, bits)), "
        + lists + "hits AS MATERIALIZED (" + " UNION ALL ".join(lookups) + "), "
        "near AS (SELECT DISTINCT q, view, id, crop, distance FROM hits) "
        "SELECT n.q, n.id, n.distance, CASE WHEN n.view = 0 THEN 1 + n.crop ELSE n.view END, "
        "i.colour_hash, i.thumbnail, i.dedup_group, i.crop_windows "
        "FROM near n JOIN images i ON i.id = n.id")


BATCH_SQL = _probe_sql()
"""A batch's candidates in one statement, through the multi-index probes: each query view (its
full frame, view 0, and its crop windows, view -(1 + j)) against the full-frame index, and its full
frame against the window index (image_windows). The full frame probes as :func:`candidates` does
(3,648 values), the window index at :data:`WINDOW_PROBE_RADII` (1,344) and its 4 windows the
full-frame index at :data:`WINDOW_VIEW_RADII` (2 x 1,344 + 2 x 192): 8,064 descents an image,
2.2x the full frame's alone. Each probe list is bound as a binary int4 array."""


def batch_candidates(conn, queries: list[Query], hash_size: int, radius: int) -> list[list[tuple]]:
    """Per query, its candidates as ``(id, distance, view, colour_hash, thumbnail, dedup_group,
    crop_windows)`` (view: :data:`FULL`, ``1 + j`` or ``-(1 + j)``), in one statement."""
    qq, qview, qbits = [], [], []
    lists: dict[str, list[list[tuple]]] = {"f": [[] for _ in KEY_COLUMNS], "w": [[] for _ in KEY_COLUMNS]}
    for n, query in enumerate(queries):
        views = [(0, query.phash, query.weak)] + [(-(1 + j), h, w) for j, (h, w) in enumerate(query.windows)]
        for view, phash, weak in views:
            qq.append(n), qview.append(view), qbits.append(bit_text(phash))
            row = row_keys(phash, hash_size)
            narrow = probe_arrays(row, weak, 0)
            if view == 0:
                for k, values in enumerate(probe_arrays(row, weak)):
                    lists["f"][k].append((n, view, values))
                    # the radius-1 key shares the full frame's values; the others take the narrow ones
                    lists["w"][k].append((n, view, values if WINDOW_PROBE_RADII[k] == PROBE_RADIUS else narrow[k]))
            else:  # a window of this image: its weak bits (192 values), the first key wider for some
                wide = probe_arrays(row, weak, 1)[0] if WINDOW_VIEW_RADII[-view - 1] else narrow[0]
                for k in range(SUBSTRINGS):
                    lists["f"][k].append((n, view, wide if k == 0 else narrow[k]))
    params = {"qq": Int4Array(qq), "qview": Int4Array(qview), "qbits": qbits, "radius": radius}
    for name, per_key in lists.items():
        for k, parts in enumerate(per_key):
            params[f"{name}q{k}"] = Int4Array(np.concatenate([np.full(len(v), n) for n, _, v in parts] or [[]]))
            params[f"{name}view{k}"] = Int4Array(np.concatenate([np.full(len(v), view) for _, view, v in parts] or [[]]))
            params[f"{name}v{k}"] = Int4Array(np.concatenate([v for _, _, v in parts] or [[]]))
    out: list[list[tuple]] = [[] for _ in queries]
    for row in conn.execute(BATCH_SQL, params).fetchall():
        out[row[0]].append(row[1:])
    return out


def backfill(conn) -> int:
    """Give rows filtered before the index existed their keys (schema migration 4; hashes of the
    default 144 bits); returns the count."""
    rows = conn.execute("SELECT id, phash FROM images WHERE octet_length(phash) = 18 AND phash_k0 IS NULL").fetchall()
    if not rows:
        return 0
    hash_size = 12
    ids = [r[0] for r in rows]
    table = keys(np.stack([np.frombuffer(bytes(r[1]), np.uint8) for r in rows]), hash_size)
    assignments = ", ".join(f"{c} = v.k{k}" for k, c in enumerate(KEY_COLUMNS))
    arrays = ", ".join("%s::int[]" for _ in KEY_COLUMNS)
    conn.execute(f"UPDATE images i SET {assignments}, phash_bits = ('x' || encode(i.phash, 'hex'))::varbit "
                 f"FROM unnest(%s::bigint[], {arrays}) "
                 f"AS v(id, {', '.join(f'k{k}' for k in range(SUBSTRINGS))}) WHERE i.id = v.id",
                 [ids] + [table[:, k].tolist() for k in range(SUBSTRINGS)])
    return len(ids)
