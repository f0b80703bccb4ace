"""The dedup job's index path under load: several ``krea2 curate work --jobs dedup`` processes at
once on a warehouse beyond ``curation.hash_scan.SCAN_ROWS`` (so every batch takes its candidates
from the multi-index probes, curation/hash_index.py, never the exact scan), with near duplicates
planted across the batches the workers take at the same moment: every planted group ends as one
group with one kept row, nothing else merges, no row is lost.

The warehouse: BACKGROUND rows already deduplicated (random hashes, their crop windows in the
window index as ``DedupJob.index_windows`` writes them), inserted with COPY, then the
planted rows: real fingerprints (``curation.screening.filter_outcome``, what the filter job
writes) of synthetic photographs, their JPEG copies (cropped <= 2% a side, resized to 75-125%,
q70-95) and byte copies, hashed and waiting for dedup. Those go through the real job with WORKERS
processes, released together: each holds its first claim behind a table lock until all of them
wait on it.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np
import psycopg
from PIL import Image

from curation.alignment import SIDE
from curation.config import CurationConfig
from curation.dedup import Fingerprint, matches
from curation.filters import thumbnail
from curation.hash_index import PROBES, SUBSTRING_BITS, SUBSTRINGS, WEAK_BITS, keys, probe_arrays, row_keys
from curation.hash_scan import SCAN_ROWS, HashIndex
from curation.hashing import hash_int
from curation.screening import filter_outcome
from curation.synthetic import copy_of, photo
from curation.windows import WINDOWS, record_layout, window_hashes
from curation_warehouse import FAST_QUEUE, REPO, database, query, server  # noqa: F401 (server: a fixture)
from krea2_diffusers.cli import main as krea2

BACKGROUND = 30_000
WORKERS = 4
BATCH = 8
BLOCKS = 8
"""Each block is three batches (claimed at once by three workers): the first members of BATCH
groups, their second members, then the third members of the triples and unrelated photographs."""
PHOTO = (160, 120)
CONFIG = CurationConfig()


# ---------------------------------------------------------------- the warehouse
def background(conn, count: int, rng: np.random.Generator) -> None:
    """``count`` rows already deduplicated (ids 1..count, each its own kept group), with random
    hashes, colours, thumbnails and crop windows, in both indexes."""
    dedup = CONFIG.dedup
    size, _, colour_size = record_layout(dedup.hash_size, dedup.colour_grid)

    def hashes(n: int) -> np.ndarray:
        table = rng.integers(0, 256, (n, size), dtype=np.uint8)
        table[:, 0] |= 0x80  # the DC bit, always set
        return table

    def weak(n: int) -> np.ndarray:  # per key, WEAK_BITS distinct positions, as weak_bits gives them
        order = np.argsort(rng.random((n, SUBSTRINGS, SUBSTRING_BITS)), axis=2)
        return order[:, :, :WEAK_BITS].astype(np.uint8).reshape(n, -1)

    phash, windows = hashes(count), hashes(count * len(WINDOWS)).reshape(count, -1)
    window_weak = np.concatenate([weak(count) for _ in WINDOWS], axis=1)
    window_colour = rng.integers(0, 256, (count, colour_size * len(WINDOWS)), dtype=np.uint8)
    crop_windows = np.concatenate([windows, window_weak, window_colour], axis=1)
    phash_weak, index_keys = weak(count), keys(phash, dedup.hash_size)
    colours = rng.integers(0, 256, (count, colour_size), dtype=np.uint8)
    thumbnails = rng.integers(0, 256, (count, SIDE * SIDE), dtype=np.uint8)
    # COPY text, one buffer a table (row by row through psycopg took 9 s, mostly client time).

    def hexed(table: np.ndarray) -> list[str]:  # bytea in hex, its backslash escaped for COPY
        return ["\\\\x" + row.tobytes().hex() for row in table]

    columns = ("id, uri, md5, width, height, phash, phash_weak, colour_hash, thumbnail, crop_windows, phash_k0, "
               "phash_k1, phash_k2, phash_bits, probe_done_at, filter_done_at, dedup_done_at, dedup_group, status")
    lines = (f"{i + 1}\t/background/{i}.jpg\t{i:032x}\t400\t320\t{h}\t{w}\t{c}\t{t}\t{x}\t{k0}\t{k1}\t{k2}\t{bits}"
             f"\tnow\tnow\tnow\t{i + 1}\tkept\n"
             for i, (h, w, c, t, x, (k0, k1, k2), bits) in enumerate(zip(
                 hexed(phash), hexed(phash_weak), hexed(colours), hexed(thumbnails), hexed(crop_windows),
                 index_keys.tolist(), bit_strings(phash))))
    with conn.cursor().copy(f"COPY images ({columns}) FROM STDIN") as copy:
        copy.write("".join(lines))
    conn.execute("SELECT setval('images_id_seq', %s)", (count,))
    # The window index as the rows' dedup batches left it (DedupJob.index_windows: ids, crops, keys, bits).
    table = window_hashes([row.tobytes() for row in crop_windows], dedup.hash_size)
    lines = (f"{n // len(WINDOWS) + 1}\t{n % len(WINDOWS)}\t{bits}\t{k0}\t{k1}\t{k2}\n"
             for n, ((k0, k1, k2), bits) in enumerate(zip(keys(table, dedup.hash_size).tolist(), bit_strings(table))))
    with conn.cursor().copy("COPY image_windows (id, crop, phash_bits, phash_k0, phash_k1, phash_k2) FROM STDIN") as copy:
        copy.write("".join(lines))


def bit_strings(table: np.ndarray) -> list[str]:
    """(N, bytes) uint8 hashes as curation.hash_index.bit_text writes each (a varbit literal), at once."""
    return [row.tobytes().decode() for row in np.unpackbits(table, axis=1) + ord("0")]


def fingerprinted(data: bytes) -> dict:
    """The row the probe and filter jobs would leave for an image file's bytes (hashed, dedup pending)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        small = thumbnail(image, CONFIG.filter.analysis_side)
    outcome = filter_outcome({"id": 0}, small, CONFIG)
    assert outcome.drop is None, outcome.drop  # a planted photograph passes the filters
    values = {k: v for k, v in outcome.values.items() if k != "filter_scores"}
    return {"md5": hashlib.md5(data).hexdigest(), "size_bytes": len(data), "width": width, "height": height, **values}


def planted_rows(rng: np.random.Generator) -> tuple[list[dict], list[list[int]]]:
    """The planted rows in id order and the groups (indices into them, of two or three members).

    Per block of 3 * BATCH rows, BATCH groups: pairs of a photograph and a near copy, 2 triples
    (two near copies), 1 byte copy; the first batch holds each group's first member (on odd
    blocks the copies come first: a copy placed before its original), the second batch the
    second members, the third the triples' third members and unrelated photographs."""
    def near(picture: Image.Image) -> bytes:  # milder than the quality test's copies: the photographs are
        # small (160 px), and one cropped by up to 3% and resized to 60% aligned at 0.69 (check_the_plant)
        return copy_of(picture, tuple(rng.uniform(0, 0.02, 4)), float(rng.uniform(0.75, 1.25)), int(rng.integers(70, 96)))

    rows, groups = [], []
    for block in range(BLOCKS):
        batches: list[list[bytes]] = [[], [], []]
        members = []
        for g in range(BATCH):
            picture = photo(rng, PHOTO)
            original = copy_of(picture, quality=95)
            if g < BATCH - 3:
                files = [original, near(picture)]
            elif g < BATCH - 1:
                files = [original, near(picture), near(picture)]
            else:
                files = [original, original]
            if block % 2:
                files = files[::-1]
            members.append([])
            for position, data in enumerate(files):
                members[-1].append((position, len(batches[position])))
                batches[position].append(data)
        while len(batches[2]) < BATCH:
            batches[2].append(copy_of(photo(rng, PHOTO), quality=int(rng.integers(70, 96))))
        base = len(rows)
        for position, batch in enumerate(batches):
            rows += [fingerprinted(data) for data in batch]
        groups += [[base + position * BATCH + slot for position, slot in group] for group in members]
    return rows, groups


def insert_planted(conn, rows: list[dict]) -> list[int]:
    """Rows as the filter job leaves them (hashed, in the index, dedup pending); returns their ids."""
    columns = ("uri", "md5", "size_bytes", "width", "height", "phash", "phash_weak", "colour_hash", "thumbnail",
               "crop_windows", "phash_k0", "phash_k1", "phash_k2", "phash_bits", "probe_done_at", "filter_done_at")
    now = datetime.now(timezone.utc)
    with conn.cursor().copy(f"COPY images ({', '.join(columns)}) FROM STDIN") as copy:
        for n, row in enumerate(rows):
            copy.write_row([f"/planted/{n:05d}.jpg", *(row[c] for c in columns[1:-2]), now, now])
    return [r[0] for r in conn.execute("SELECT id FROM images WHERE uri LIKE '/planted/%' ORDER BY uri")]


# ---------------------------------------------------------------- what the index must find
def fingerprint(row: dict) -> Fingerprint:
    return Fingerprint(row["colour_hash"], row["thumbnail"], row["crop_windows"])


def probed(query: dict, other: dict) -> bool:
    """The full-frame probes of ``query`` reach ``other``'s full frame: one of its keys is among
    the probed values and the whole hash lies within the radius (as the index's SQL checks)."""
    distance = bin(hash_int(query["phash"]) ^ hash_int(other["phash"])).count("1")
    values = probe_arrays(row_keys(query["phash"], CONFIG.dedup.hash_size), query["phash_weak"], PROBES)
    found = any(k in v for k, v in zip(row_keys(other["phash"], CONFIG.dedup.hash_size), values))
    return found and distance <= CONFIG.dedup.max_hash_distance


def check_the_plant(rows: list[dict], groups: list[list[int]]) -> None:
    """The answer does not depend on which worker comes first: within a group every member finds
    every other through the index's own probes and passes colour and alignment (or shares its md5),
    and no row matches a row outside its group (exact scan over the planted rows)."""
    for group in groups:
        for a in group:
            for b in group:
                if a != b and rows[a]["md5"] != rows[b]["md5"]:
                    assert probed(rows[a], rows[b]), (a, b)
                    assert matches([(b, 0, 0, fingerprint(rows[b]), None)], fingerprint(rows[a]), CONFIG.dedup), (a, b)
    group_of = {member: n for n, group in enumerate(groups) for member in group}
    scan = HashIndex.from_hashes(np.arange(len(rows)), np.stack([np.frombuffer(r["phash"], np.uint8) for r in rows]),
                                 CONFIG.dedup.max_hash_distance)
    for a, row in enumerate(rows):
        found = [(b, d, 0, fingerprint(rows[b]), None) for b, d in scan.query(hash_int(row["phash"])) if b != a]
        for b, _, _ in matches(found, fingerprint(row), CONFIG.dedup):
            assert group_of.get(a, -1 - a) == group_of.get(b, -1 - b), f"unplanted match {a} ~ {b}"


# ---------------------------------------------------------------- the test
def index_scans(conn) -> dict[str, int]:
    """Index scans of the second key's indexes: only the multi-index probes use them."""
    return dict(conn.execute("SELECT indexrelname, idx_scan FROM pg_stat_user_indexes "
                             "WHERE indexrelname IN ('images_phash_k1', 'image_windows_phash_k1')").fetchall())


def deadlocks(conn) -> int:
    return conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def test_four_workers_on_the_index_find_every_planted_pair(server, tmp_path):
    dsn = database(server, "dedup_index_load")
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    rng = np.random.default_rng(38)
    rows, groups = planted_rows(rng)
    check_the_plant(rows, groups)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Two batches each waiting for the other's copy are a deadlock by design (DedupJob), found
        # after deadlock_timeout: at its default 1 s, 15 of them took 15 of the workers' 17 s (288 rows).
        conn.execute("ALTER DATABASE dedup_index_load SET deadlock_timeout = '100ms'")
        background(conn, BACKGROUND, rng)
        ids = insert_planted(conn, rows)
        hashed = conn.execute("SELECT count(*) FROM images WHERE phash_k0 IS NOT NULL").fetchone()[0]
        assert hashed == BACKGROUND + len(rows) > SCAN_ROWS  # every batch takes the index path
        conn.execute("ANALYZE images")
        conn.execute("ANALYZE image_windows")
        before, deadlocks_before = index_scans(conn), deadlocks(conn)

    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "curation", "work", "--dsn", dsn, "--jobs", "dedup", "--batch", str(BATCH),
               "--claim-log", "--config", str(config)]
    workers = []
    try:
        with psycopg.connect(dsn) as gate:
            # Every worker's first claim waits behind this lock, so all of them start together.
            gate.execute("LOCK TABLE images IN EXCLUSIVE MODE")
            workers += [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                        for _ in range(WORKERS)]
            deadline = time.monotonic() + 120
            with psycopg.connect(dsn, autocommit=True) as watch:
                while watch.execute("SELECT count(*) FROM pg_locks WHERE relation = 'images'::regclass "
                                    "AND NOT granted").fetchone()[0] < WORKERS:
                    assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "workers did not start"
                    time.sleep(0.05)
            released = time.monotonic()
        for worker in workers:
            assert worker.wait(timeout=300) == 0, worker.stderr.read().decode()[-3000:]
        elapsed = time.monotonic() - released
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    with psycopg.connect(dsn, autocommit=True) as conn:
        after, resolved = index_scans(conn), deadlocks(conn) - deadlocks_before
    # The probes ran for every planted row: 1,216 descents a row into the full-frame index's second
    # key (its full frame's probes), 64 into the window index's (the scan path uses neither index).
    assert after["images_phash_k1"] - before["images_phash_k1"] >= 1216 * len(rows), (before, after)
    assert after["image_windows_phash_k1"] - before["image_windows_phash_k1"] >= 64 * len(rows), (before, after)

    found = {r["id"]: r for r in query(dsn, "SELECT id, status, drop_reason, dedup_group, duplicate_of, width, height, "
                                            "dedup_done_at FROM images WHERE uri LIKE '/planted/%%'")}
    assert len(found) == len(rows) and all(r["dedup_done_at"] is not None for r in found.values())
    md5_of = {i: row["md5"] for i, row in zip(ids, rows)}
    in_groups = set()
    for group in groups:
        members = [found[ids[m]] for m in group]
        assert len({r["dedup_group"] for r in members}) == 1, members  # the planted group, found whole
        kept = max(members, key=lambda r: (r["width"] * r["height"], -r["id"]))  # largest, then oldest
        for r in members:
            if r is kept:
                assert r["status"] == "kept" and r["duplicate_of"] is None, members
            else:
                reason = "exact_duplicate" if md5_of[r["id"]] == md5_of[kept["id"]] else "near_duplicate"
                assert (r["status"], r["drop_reason"], r["duplicate_of"]) == ("dropped", reason, kept["id"]), members
        in_groups |= {ids[m] for m in group}
    singles = [r for i, r in found.items() if i not in in_groups]
    assert all(r["status"] == "kept" and r["dedup_group"] == r["id"] for r in singles), singles
    untouched = query(dsn, "SELECT count(*) AS n FROM images WHERE uri LIKE '/background/%%' AND status = 'kept' "
                           "AND dedup_group = id AND duplicate_of IS NULL")[0]["n"]
    assert untouched == BACKGROUND

    # The race was real: members of one group held at the same time by two workers (34-41 of 64 in
    # runs here, 28 of 96 with deadlocks found after 1 s: a lower bound that shows it, not a timing test).
    claims = {r["image_id"]: r for r in query(dsn, "SELECT image_id, worker, claimed_at, released_at FROM claim_log "
                                                   "WHERE job = 'dedup'")}
    raced = 0
    for group in groups:
        held = [claims[ids[m]] for m in group]
        raced += any(a["worker"] != b["worker"] and a["claimed_at"] < b["released_at"] and b["claimed_at"] < a["released_at"]
                     for a in held for b in held)
    print(f"{len(rows)} planted rows through the index ({BACKGROUND + len(rows)} hashed), {WORKERS} workers, "
          f"{elapsed:.1f} s, {resolved} deadlocks resolved; {raced} of {len(groups)} groups held by two workers at once")
    assert raced >= len(groups) // 6, raced
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute("DROP DATABASE dedup_index_load")  # 100 MB of the session's one server
