"""The dedup candidate search alone as the warehouse grows (``bench_curation.py --scale``).

For each size N: a fresh table of N synthetic 144-bit pHashes in the embedded Postgres, loaded
with COPY, the index (curation/hash_index.py) built after loading; then a sample of queries, each
a near duplicate of a planted row, timed through the warehouse's own candidate query.

Planted near duplicates are real: originals and copies (crops <= 5% a side, resizes to 50-100%,
JPEG q60-95 and all three, as in tests/test_curation_quality.py) made and fingerprinted with the
filter job's own functions (hash and weak bits). Each pair is moved to a random place in hash
space by XOR with a random mask (which keeps its Hamming distance and which bits differ), so the
bulk is uniform; real photographs' hashes are not (skewed buckets cost more than this shows).

Recall is against the exact scan (:class:`curation.dedup.HashIndex`) at ``max_hash_distance``,
over the planted pairs within that radius (``recall_vs_exact``). Uniform 144-bit hashes put
~2.4e-6 of a table within 44 bits of any query (~24 unrelated rows at 1e7): those are reported
apart (``unrelated_within_radius``, ``unrelated_found``), as the alignment rejects them anyway.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import time

import numpy as np

from curation.config import CurationConfig
from curation.dedup import HashIndex
from curation.hash_index import CANDIDATES_SQL, KEY_COLUMNS, SUBSTRING_BITS, Int4Array, bit_text, candidates, keys, probe_arrays, row_keys

QUERIES = 100
"""Planted pairs timed per size (the recall counts them all)."""
WORKER_QUERIES = 50
"""Queries each process runs for the 1/2/4-worker throughput."""


def planted_copies(count: int, seed: int = 0) -> list[tuple[object, object]]:
    """``(original, copy)`` images (PIL, or encoded bytes for the JPEG kinds), 4 copies an original:
    crops <= 5% a side, a resize to 50-100%, JPEG q60-95, all three."""
    from curation.synthetic import copy_of, layout, natural, photo

    rng = np.random.default_rng(seed)
    out = []
    for n in range((count + 3) // 4):
        picture = photo(rng, (512, 384), layout=layout(rng)) if n % 2 else natural(rng, (512, 384), grain=4.0)
        crops = lambda: tuple(rng.uniform(0, 0.05, 4))  # noqa: E731
        for copy in (copy_of(picture, crops(), 1.0, 95),
                     copy_of(picture, (0, 0, 0, 0), float(rng.uniform(0.5, 1.0)), 95),
                     copy_of(picture, (0, 0, 0, 0), 1.0, int(rng.integers(60, 96))),
                     copy_of(picture, crops(), float(rng.uniform(0.5, 1.0)), int(rng.integers(60, 96)))):
            out.append((picture, copy))
    return out[:count]


def real_pairs(count: int, seed: int = 0) -> list[tuple[bytes, bytes, bytes]]:
    """``(original phash, copy phash, copy weak bits)`` of ``count`` :func:`planted_copies`."""
    from PIL import Image

    from curation.filters import thumbnail
    from curation.screening import filter_outcome

    config = CurationConfig()

    def fingerprint(image):
        small = thumbnail(Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image.copy(),
                          config.filter.analysis_side)
        values = filter_outcome({"id": 0}, small, config).values
        return values["phash"], values["phash_weak"]

    return fingerprinted_pairs(count, seed, fingerprint)


def fingerprinted_pairs(count: int, seed: int, fingerprint) -> list[tuple]:
    """``(fingerprint(original)[0], *fingerprint(copy))`` of each of :func:`planted_copies` (each
    original fingerprinted once)."""
    originals: dict[int, object] = {}
    pairs = []
    for picture, copy in planted_copies(count, seed):  # the list keeps every picture alive: ids stay unique
        if id(picture) not in originals:
            originals[id(picture)] = fingerprint(picture)[0]
        pairs.append((originals[id(picture)], *fingerprint(copy)))
    return pairs


def _load(conn, hashes: np.ndarray, hash_size: int) -> None:
    """COPY ``hashes`` ((N, 18) uint8) into a fresh ``images`` table, then build the index."""
    conn.execute("DROP TABLE IF EXISTS images")
    key_columns = ", ".join(f"{c} integer" for c in KEY_COLUMNS)
    conn.execute(f"CREATE TABLE images (id bigint PRIMARY KEY, phash bytea, phash_bits varbit, {key_columns}, "
                 "colour_hash bytea, thumbnail bytea, dedup_group bigint)")
    # Binary COPY rows built by numpy (a text COPY formatted in Python took minutes at 1e7).
    nbytes = hashes.shape[1]
    fields = [("n", ">i2"), ("id_len", ">i4"), ("id", ">i8"), ("phash_len", ">i4"), ("phash", f"V{nbytes}"),
              ("bits_len", ">i4"), ("bits_count", ">i4"), ("bits", f"V{nbytes}")]  # varbit: bit count, bytes
    fields += [x for k in range(len(KEY_COLUMNS)) for x in ((f"k{k}_len", ">i4"), (f"k{k}", ">i4"))]
    fields += [("group_len", ">i4"), ("group", ">i8")]
    chunk = 1_000_000
    columns = f"id, phash, phash_bits, {', '.join(KEY_COLUMNS)}, dedup_group"
    with conn.cursor().copy(f"COPY images ({columns}) FROM STDIN BINARY") as copy:
        copy.write(b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8)  # signature, flags, header extension length
        for start in range(0, len(hashes), chunk):
            part = hashes[start:start + chunk]
            out = np.zeros(len(part), np.dtype(fields))
            ids = np.arange(start + 1, start + 1 + len(part))
            out["n"], out["id_len"], out["id"], out["phash_len"] = 4 + len(KEY_COLUMNS), 8, ids, nbytes
            out["phash"] = out["bits"] = part.view(f"V{nbytes}")[:, 0]
            out["bits_len"], out["bits_count"] = 4 + nbytes, 8 * nbytes
            for k, column in enumerate(keys(part, hash_size).T):
                out[f"k{k}_len"], out[f"k{k}"] = 4, column
            out["group_len"], out["group"] = 8, ids
            copy.write(out.tobytes())
        copy.write(b"\xff\xff")
    for c in KEY_COLUMNS:  # the schema's index (curation/schema.py, version 4)
        conn.execute(f"CREATE INDEX images_{c} ON images ({c}) INCLUDE (id, phash_bits) WHERE {c} IS NOT NULL")
    conn.execute("VACUUM ANALYZE images")  # sets the visibility map, as autovacuum does on a live table


def _index_bytes(conn) -> int:
    return sum(conn.execute(f"SELECT pg_relation_size('images_{c}')").fetchone()[0] for c in KEY_COLUMNS)


def _prewarm(dsn: str) -> None:
    """Read every page of the key indexes into shared buffers (pg_prewarm's job on a server sized
    for its warehouse; pgserver ships without it): a full index-only scan of each. Without it the
    first few hundred queries at 1e7 rows read ~640 of their ~16,000 index pages a query from the
    OS cache (sizes timed after a larger one's load start colder still)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET enable_bitmapscan = off")
        for c in KEY_COLUMNS:
            conn.execute(f"SELECT count(*) FROM images WHERE {c} IS NOT NULL AND {c} >= 0")


def _run_queries(dsn: str, queries: list[tuple[bytes, bytes]], radius: int, hash_size: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its server backend) for the queries."""
    import psutil
    import psycopg

    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        backend = psutil.Process(conn.info.backend_pid)
        cpu = lambda: time.process_time() + sum(backend.cpu_times()[:2])  # noqa: E731
        start, start_cpu = time.perf_counter(), cpu()
        for phash, weak in queries:
            candidates(conn, phash, weak, hash_size, radius)
        return time.perf_counter() - start, cpu() - start_cpu


def _worker(args) -> float:
    return _run_queries(*args)[0]


def load_and_recall(server, rows: int, pairs: list[tuple[bytes, bytes, bytes]], seed: int = 0) -> dict:
    """One size in its own database: load, then recall against the exact scan over every planted
    pair. Returns the figures, with ``dsn`` and ``queries`` ((phash, weak) of each planted copy)."""
    import psycopg

    config = CurationConfig().dedup
    radius, hash_size = config.max_hash_distance, config.hash_size
    rng = np.random.default_rng(seed)
    nbytes = hash_size ** 2 // 8
    hashes = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    hashes[:, 0] |= 0x80  # the DC bit is always set in a real pHash
    slots = rng.choice(rows, len(pairs), replace=False)
    masks = rng.integers(0, 256, (len(pairs), nbytes), dtype=np.uint8)
    masks[:, 0] &= 0x7F
    queries = []
    for slot, mask, (original, copy, weak) in zip(slots, masks, pairs):
        hashes[slot] = np.frombuffer(original, np.uint8) ^ mask
        queries.append(((np.frombuffer(copy, np.uint8) ^ mask).tobytes(), weak))
    name = f"scale_{rows}"
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = server.uri(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.perf_counter()
        _load(conn, hashes, hash_size)
        load_s = time.perf_counter() - start
        index_bytes = _index_bytes(conn)
        shared_buffers = conn.execute("SHOW shared_buffers").fetchone()[0]
    # The exact scan over every row, as the reference (ids are row numbers + 1).
    exact = HashIndex.from_hashes(np.arange(1, rows + 1), hashes, radius)
    del hashes
    planted_found = planted_total = unrelated = unrelated_found = 0
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        for slot, (phash, weak) in zip(slots, queries):
            truth = {key for key, _ in exact.query(int.from_bytes(phash, "big"))}
            got = {row[0] for row in candidates(conn, phash, weak, hash_size, radius)}
            assert got <= truth, "the index returned a row outside the radius"
            if slot + 1 in truth:
                planted_total += 1
                planted_found += slot + 1 in got
            unrelated += len(truth - {slot + 1})
            unrelated_found += len((got & truth) - {slot + 1})
    return {"rows": rows, "recall_vs_exact": round(planted_found / max(planted_total, 1), 4),
            "planted_within_radius": planted_total, "unrelated_within_radius": unrelated,
            "unrelated_found": unrelated_found, "index_bytes_per_row": round(index_bytes / rows, 1),
            "load_s": round(load_s, 1), "shared_buffers": shared_buffers, "dsn": dsn, "queries": queries}


def timing(results: list[dict], rounds: int = 5) -> None:
    """Per-image query cost of every size, in alternating rounds (a loaded machine's slow spells
    fall on every size alike; the best round counts), then 1/2/4 workers' images per second.
    Each round is timed on the wall clock (``ms_rounds``, ``ms_per_image``) and in CPU seconds of
    the querying process and its Postgres backend (``cpu_ms_rounds``, ``cpu_ms_per_image``): on a
    machine shared with other jobs the wall clock also measures the neighbours (as for the pipeline)."""
    config = CurationConfig().dedup
    radius, hash_size = config.max_hash_distance, config.hash_size
    for result in results:
        _prewarm(result["dsn"])
        _run_queries(result["dsn"], result["queries"][:30], radius, hash_size)  # warm the plan and the caches
    for _ in range(rounds):
        for result in results:
            sample = result["queries"][:QUERIES]
            wall, cpu = (seconds / len(sample) * 1e3 for seconds in _run_queries(result["dsn"], sample, radius, hash_size))
            result.setdefault("ms_rounds", []).append(round(wall, 3))
            result.setdefault("cpu_ms_rounds", []).append(round(cpu, 3))
            print(f"  {result['rows']} rows: {wall:.2f} ms an image, {cpu:.2f} ms of CPU "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for result in results:
        result["ms_per_image"] = min(result["ms_rounds"])
        result["cpu_ms_per_image"] = min(result["cpu_ms_rounds"])
        throughput, queries = {}, result["queries"]
        for workers in (1, 2, 4):
            jobs = [(result["dsn"], queries[(w * WORKER_QUERIES) % len(queries):][:WORKER_QUERIES], radius, hash_size)
                    for w in range(workers)]
            # spawned, not forked: a fork of this process (psycopg's and numpy's threads) once left a
            # worker waiting forever on a lock held at the fork; started before the clock
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                pool.map(abs, range(workers))
                start = time.perf_counter()
                pool.map(_worker, jobs)
                seconds = time.perf_counter() - start
            throughput[str(workers)] = round(sum(len(j[1]) for j in jobs) / seconds, 1)
            print(f"  {result['rows']} rows, {workers} workers: {throughput[str(workers)]} images/s", flush=True)
        result["images_per_s_by_workers"] = throughput
        result["load_average_1m"] = round(os.getloadavg()[0], 2)
    for result in results:
        result["split"] = split(result, radius, hash_size)


KEY_LIMIT = 1 << SUBSTRING_BITS
"""Probes moved past this limit (keys are SUBSTRING_BITS wide) agree with no row."""


def _probe_params(phash: bytes, weak: bytes, hash_size: int, radius: int, shift: int = 0) -> dict:
    arrays = probe_arrays(row_keys(phash, hash_size), weak)
    return {**{f"p{k}": Int4Array(values + shift) for k, values in enumerate(arrays)}, "bits": bit_text(phash),
            "radius": radius}


def split(result: dict, radius: int, hash_size: int, rounds: int = 3) -> dict:
    """Where a query's time goes at this size (issue 42), from the same queries:

    - ``descent_ms``: the probes moved past every key (``KEY_LIMIT``): each descent ends at the
      index's right edge, on the same pages every time: the executor's and the descents' cost with
      no cache misses and no matching entries (grows only with the B-tree's depth);
    - ``misses_and_matches_ms``: ``ms`` (the same queries as timed, in turns with the descents)
      minus that: random leaf (and inner) pages that are
      not in the CPU's caches, and the entries that agree on a probed key by chance (each one's
      distance is computed);
    - ``pages_per_image`` and ``levels`` (pages per probe of the descent-only variant): EXPLAIN
      (ANALYZE, BUFFERS)'s shared-buffer hits, the mean of 5 queries;
    - ``key_matches_per_image``: rows agreeing with a probe on a key (the same probes at radius
      144: every such row passes), the mean of 20 queries; expected ~3,648 x rows / 2**26."""
    import psycopg

    queries = result["queries"][:QUERIES]
    probes = sum(len(v) for v in probe_arrays(row_keys(queries[0][0], hash_size), queries[0][1]))
    with psycopg.connect(result["dsn"], autocommit=True, prepare_threshold=0) as conn:
        best = {0: float("inf"), KEY_LIMIT: float("inf")}
        for _ in range(rounds):  # the queries as timed and their descents alone, in turns
            for shift in best:
                start = time.perf_counter()
                for phash, weak in queries:
                    conn.execute(CANDIDATES_SQL, _probe_params(phash, weak, hash_size, radius, shift)).fetchall()
                best[shift] = min(best[shift], (time.perf_counter() - start) / len(queries) * 1e3)

        def pages(shift: int) -> float:
            hits = [conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + CANDIDATES_SQL,
                                 _probe_params(phash, weak, hash_size, radius, shift)).fetchone()[0][0]["Plan"]
                    ["Shared Hit Blocks"] for phash, weak in queries[:5]]
            return sum(hits) / len(hits)

        page_hits, descent_pages = pages(0), pages(KEY_LIMIT)
        bits = hash_size ** 2
        matches = [len(conn.execute(CANDIDATES_SQL, _probe_params(phash, weak, hash_size, bits)).fetchall())
                   for phash, weak in queries[:20]]
    return {"ms": round(best[0], 3), "descent_ms": round(best[KEY_LIMIT], 3),
            "misses_and_matches_ms": round(best[0] - best[KEY_LIMIT], 3),
            "pages_per_image": round(page_hits), "levels": round(descent_pages / probes, 2), "probes": probes,
            "key_matches_per_image": round(sum(matches) / len(matches), 1)}
