"""The near-duplicate candidate index, kept in the warehouse: multi-index hashing over pHash substrings.

Each row the filter job hashed stores ``SUBSTRINGS`` keys (``phash_k0..k2``, 26-bit ints, one
B-tree each): the 78 lowest-frequency bits of its pHash (the DC bit, always set, left out), cut
into three runs of 26 in frequency order; and ``phash_weak``: per key, its ``WEAK_BITS`` bits
whose DCT coefficients lie closest to the median (the bits a copy flips), least certain first. A
query probes, per key, its value with each of the ``PROBES`` flip patterns of those ranked bits
that a copy most likely shows (:func:`probe_patterns`: 1,216 values a key, 3,648 in all); the
server keeps the rows within ``max_hash_distance``.

Why this: the radius (44 of 144 bits, ~30%) is far beyond pigeonhole multi-index hashing (45
substrings of 3 bits); plain substring keys probed at a fixed radius found 0.93-0.96 of the exact
scan's pairs at a flat cost (crops flip low frequencies too); pgvector 0.6.2 (``pgserver``) has no
bit vectors, and HNSW over +-1 float vectors builds at a few thousand rows a second here (hours at
1e7). A random row matches a probe with probability 2**-26: ~540 index entries a query at 1e7 rows,
~5 at 1e5. Schema 4-5 keys were 24 bits (2,200 chance entries at 1e7, which doubled the per-image
cost from 1e5 to 1e7: issue 42) probed by every subset of 6 weak bits with any one other bit;
with 26-bit keys that template found 0.991 / 0.994 of 1,600 real copy pairs (two draws) in
simulation, the ranked patterns 0.994 / 0.997 with the same 3,648 probes (24-bit keys: 0.997 / 0.996).

The crop windows (curation/windows.py) have the same keys in ``image_windows``: a dedup batch
(:func:`batch_candidates`, one statement for the whole batch) probes the full-frame index with
each image's full frame and windows and the window index with its full frame. Warehouses of up to
curation.hash_scan.SCAN_ROWS rows are scanned exactly instead (cheaper there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

SUBSTRINGS = 3
SUBSTRING_BITS = 26
WEAK_BITS = 14
"""Per key, the positions (0..SUBSTRING_BITS-1, MSB first) of its 14 least certain bits (smallest
coefficient margins), least certain first: ``phash_weak`` holds SUBSTRINGS * WEAK_BITS bytes."""
RANK_COST = 1.15
"""A flip pattern's cost: the sum of RANK_COST ** rank over the ranked bits it flips. The patterns
a query probes are the cheapest ones (a copy flips its least certain bits first; a few ranks
further down cost little more). Chosen on one draw of 1,600 real copy pairs from 1.15 / 1.3 / 1.5
(0.9944 / 0.9937 / 0.9931 at 26-bit keys), confirmed on another (0.9969)."""
PROBES = 1216
"""Patterns probed per key by a full frame (the budget of schema 5's 64 weak subsets x 19)."""
NARROW_PROBES = 64
"""Patterns per key of the narrow probes (the window index's second and third keys, the windows' views)."""
LEGACY_SUBSTRING_BITS, LEGACY_WEAK_BITS = 24, 6
"""Schema 4-5's layout: ``phash_weak`` of 18 bytes (6 positions in each 24-bit key); read through
:func:`ranked_weak`."""
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


@functools.lru_cache(maxsize=4)
def probe_patterns(count: int) -> np.ndarray:
    """(count, WEAK_BITS) 0/1 int64: the ``count`` cheapest subsets of the ranked bits (cost: the sum
    of RANK_COST ** rank over the subset; the empty one first), ties in subset order."""
    subsets = (np.arange(1 << WEAK_BITS)[:, None] >> np.arange(WEAK_BITS)[None]) & 1
    cost = subsets @ (RANK_COST ** np.arange(WEAK_BITS))
    return subsets[np.argsort(cost, kind="stable")[:count]].astype(np.int64)


def ranked_weak(weak: bytes | None) -> np.ndarray | None:
    """(SUBSTRINGS, WEAK_BITS) positions of ``phash_weak`` (None: none stored). Schema 4-5 rows
    (18 bytes: 6 positions in each 24-bit key) are translated: each known weak bit goes to the key
    and position it has now, by its old rank; the rest of a key's ranks are its other bits, highest
    frequency first (the smaller coefficients, closer to the median)."""
    if weak is None:
        return None
    if len(weak) == SUBSTRINGS * WEAK_BITS:
        return np.frombuffer(weak, np.uint8).reshape(SUBSTRINGS, WEAK_BITS)
    if len(weak) != SUBSTRINGS * LEGACY_WEAK_BITS:
        raise ValueError(f"phash_weak of {len(weak)} bytes; expected {SUBSTRINGS * WEAK_BITS} "
                         f"(or {SUBSTRINGS * LEGACY_WEAK_BITS} from schema 4-5)")
    old = np.frombuffer(weak, np.uint8).reshape(SUBSTRINGS, LEGACY_WEAK_BITS).astype(np.int64)
    # old[key, rank]: a position in that 24-bit key; its frequency index is key * 24 + position
    found = sorted((rank, key, int(key * LEGACY_SUBSTRING_BITS + old[key, rank]))
                   for key in range(SUBSTRINGS) for rank in range(LEGACY_WEAK_BITS))
    out = []
    for key in range(SUBSTRINGS):
        known = [g - key * SUBSTRING_BITS for _, _, g in found if g // SUBSTRING_BITS == key]
        rest = [p for p in range(SUBSTRING_BITS - 1, -1, -1) if p not in known]
        out.append((known + rest)[:WEAK_BITS])
    return np.array(out, np.uint8)


def probe_arrays(row: list[int], weak: bytes | None, count: int = PROBES) -> list[np.ndarray]:
    """Per key, the values probed (sorted int64): the key with each of the ``count`` cheapest flip
    patterns of its ranked weak bits (:func:`probe_patterns`). ``weak`` None (rows filtered before
    schema 4): the key and its single-bit flips (27 values a key, lower recall on cropped copies)."""
    positions = ranked_weak(weak)
    out = []
    for k, key in enumerate(row):
        if positions is None:
            flips = np.concatenate([[0], np.int64(1) << np.arange(SUBSTRING_BITS, dtype=np.int64)])
        else:
            flips = probe_patterns(count) @ (np.int64(1) << (SUBSTRING_BITS - 1 - positions[k].astype(np.int64)))
        out.append(np.unique(np.int64(key) ^ flips))
    return out


def probes(row: list[int], weak: bytes | None, count: int = PROBES) -> list[list[int]]:
    """:func:`probe_arrays` as lists."""
    return [values.tolist() for values in probe_arrays(row, weak, count)]


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
# at 1e7 rows a query meets ~540 entries that agree on a key by chance (2,200 with schema 5's 24-bit
# keys, where materialising them all before filtering cost 0.6-1.4 ms a query; ~0.01 ms at 1e5). The distance
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
WINDOW_PROBE_COUNTS = (PROBES, NARROW_PROBES, NARROW_PROBES)
"""Per key, the patterns a full frame's probe of the window index flips: the first
(lowest-frequency) key the full frame's own 1,216, the others 64 (1,344 values, not 3,648)."""
WINDOW_VIEW_PROBES = (PROBES, PROBES, NARROW_PROBES, NARROW_PROBES)
"""Per crop window (curation.windows.WINDOWS), the patterns its probes of the full-frame index flip
on the first key (the others: 64): 1,344 values for the 0.85 and 0.75 windows, 192 for the aspect
ones (their copies lie within 2 bits). Measured with schema 5's template (bench_curation.py --crops,
250 originals): with every window narrow the original's windows found 0.944 of the 10-15% crops
the exact scan finds, the crop's full frame finding the original's window 0.992; narrow probes on
every key of the window index found 0.94 of them in simulation."""


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
(3,648 values), the window index at :data:`WINDOW_PROBE_COUNTS` (1,344) and its 4 windows the
full-frame index at :data:`WINDOW_VIEW_PROBES` (2 x 1,344 + 2 x 192): 8,064 descents an image,
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
            narrow = probe_arrays(row, weak, NARROW_PROBES)
            if view == 0:
                for k, values in enumerate(probe_arrays(row, weak)):
                    lists["f"][k].append((n, view, values))
                    # the wide key shares the full frame's values; the others take the narrow ones
                    lists["w"][k].append((n, view, values if WINDOW_PROBE_COUNTS[k] == PROBES else narrow[k]))
            else:  # a window of this image: 64 patterns a key (192 values), the first key wider for some
                wide = probe_arrays(row, weak, WINDOW_VIEW_PROBES[-view - 1])[0]
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


def rekey(conn) -> int:
    """Schema migration 6: every stored key (images and image_windows) recomputed from the row's
    hash bits, now 26 bits a key (schema 4-5: 24), in the server (get_bit on ``phash_bits``, MSB
    first as packed; one UPDATE per hash size stored); returns the rows rewritten."""
    rewritten = 0
    for table, where in (("images", f"{KEY_COLUMNS[0]} IS NOT NULL"), ("image_windows", "true")):
        for (length,) in conn.execute(f"SELECT DISTINCT length(phash_bits) FROM {table} WHERE {where}").fetchall():
            # phash_bits holds the packed bytes: a hash of s**2 bits takes ceil(s**2 / 8) of them
            hash_size = next(s for s in range(1, length + 1) if 8 * math.ceil(s * s / 8) >= length)
            order = bit_order(hash_size)  # refuses a hash too short for the keys
            sets = ", ".join(f"{column} = " + " | ".join(
                f"(get_bit(phash_bits, {int(p)}) << {SUBSTRING_BITS - 1 - j})"
                for j, p in enumerate(order[k * SUBSTRING_BITS:(k + 1) * SUBSTRING_BITS])) for k, column in enumerate(KEY_COLUMNS))
            rewritten += conn.execute(f"UPDATE {table} SET {sets} WHERE {where} AND length(phash_bits) = %s",
                                      (length,)).rowcount
    return rewritten
