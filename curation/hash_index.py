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
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

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


def probes(row: list[int], weak: bytes | None) -> list[list[int]]:
    """Per key, the values probed: the key with any subset of its weak bits flipped, each also with
    up to PROBE_RADIUS other bits flipped. ``weak`` None (rows filtered before schema 4): the
    radius alone (25 values a key, lower recall on cropped copies)."""
    weak_sets = np.frombuffer(weak, np.uint8).reshape(SUBSTRINGS, WEAK_BITS) if weak else [[]] * SUBSTRINGS
    out = []
    for key, positions in zip(row, weak_sets):
        shifts = [SUBSTRING_BITS - 1 - int(p) for p in positions]
        subsets = np.array([sum(1 << shifts[i] for i in range(len(shifts)) if m >> i & 1)
                            for m in range(1 << len(shifts))], np.int64)
        others = [b for b in range(SUBSTRING_BITS) if b not in shifts]
        singles = [0]
        for radius in range(1, PROBE_RADIUS + 1):
            singles += [sum(1 << b for b in bits) for bits in itertools.combinations(others, radius)]
        out.append(np.unique((np.int64(key) ^ subsets)[:, None] ^ np.array(singles, np.int64)[None]).tolist())
    return out


def bit_text(phash: bytes) -> str:
    """The hash as a bit string literal for SQL's ``varbit`` (MSB first, as packed)."""
    return "".join(f"{byte:08b}" for byte in phash)


CANDIDATES_SQL = (
    "WITH hits AS MATERIALIZED (" + " UNION ALL ".join(
        f"SELECT h.id, h.phash_bits FROM unnest(%(p{k})s::int[]) AS p{k}(v) CROSS JOIN LATERAL "
        f"(SELECT id, phash_bits FROM images WHERE {c} = p{k}.v OFFSET 0) AS h" for k, c in enumerate(KEY_COLUMNS)) + "), "
    "near AS (SELECT DISTINCT id, bit_count(phash_bits # %(bits)s::varbit) AS distance FROM hits) "
    "SELECT i.id, near.distance, i.colour_hash, i.thumbnail, i.dedup_group FROM near JOIN images i ON i.id = near.id "
    "WHERE near.distance <= %(radius)s")
# Each probed value is looked up on its own (a LATERAL subquery the planner cannot flatten: one
# index-only descent a value); planned as a join, the planner hashed the whole table at 1e5 rows
# (its cost model prices 3,648 descents above a scan), 50x slower. The distance is computed on the
# index entries (INCLUDE phash_bits), once per distinct row: on the hash as a bit string, because
# decoding the bytea one (hex, then varbit) cost ~4 us an entry, doubling the query at 1e7 rows.
"""Placed rows (only they carry keys) agreeing with the query on a probed key and within the
radius on the whole hash. Each key's index holds the hash as a bit string (INCLUDE phash_bits), so
the distance is computed on index entries (an index-only scan) and only rows within the radius are read:
their colour hash and thumbnail come back, for these candidates only."""


def candidates(conn, phash: bytes, weak: bytes | None, hash_size: int, radius: int) -> list[tuple]:
    """``(id, distance, colour_hash, thumbnail, dedup_group)`` of the candidate rows for a hash."""
    params = {f"p{k}": values for k, values in enumerate(probes(row_keys(phash, hash_size), weak))}
    return conn.execute(CANDIDATES_SQL, {**params, "bits": bit_text(phash), "radius": radius}).fetchall()


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
