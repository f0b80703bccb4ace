"""Curation warehouse: the pinned CLI, filter/dedup verdicts on a corpus with known answers, a crash
of one of three parallel workers, retries, bad input, and export into a krea2-pack-v1 pack.

One embedded Postgres (pgserver, tests/curation_warehouse.py) serves every curation test module; each
case that needs a clean warehouse gets its own database on it (``--dsn``), the pinned ``--db DIR``
form attaches to the running server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psycopg
import pytest

from curation.dedup import HashIndex
from curation.hashing import hash_int
from curation.synthetic import make_corpus
from curation_warehouse import FAST_QUEUE, REPO, database, query, server  # noqa: F401 (server: a fixture)
from krea2_diffusers.cli import main as krea2

# The in-process jobs run tiny models (captions, embeddings): one thread (conftest.one_thread; with 2 threads
# a busy 2-core machine spends most of the time synchronising them).
pytestmark = pytest.mark.usefixtures("one_thread")


def _cli_raw(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = krea2([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _cli(capsys, *argv) -> tuple[int, str, str]:
    return _cli_raw(capsys, "curate", *argv)


def test_corpus_verdicts_status_and_export(server, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    expected = make_corpus(corpus, photos=6, crops=True)
    (corpus / "p000_a.txt").write_text("a red kite over a field")
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)
    db = server.folder  # the pinned --db form, attached to the running server

    assert _cli(capsys, "init", "--db", db)[0] == 0
    code, out, _ = _cli(capsys, "ingest", corpus, corpus, "--db", db)
    assert code == 0 and json.loads(out) == {"new": len(expected), "known": 0, "repeated": len(expected)}
    assert json.loads(_cli(capsys, "ingest", corpus, "--db", db)[1]) == {"new": 0, "known": len(expected), "repeated": 0}
    code, out, err = _cli(capsys, "work", "--db", db, "--jobs", "probe,filter,dedup", "--batch", "4", "--config", config)
    assert code == 0, err

    rows = {Path(r["uri"]).name: r for r in query(server.dsn, "SELECT * FROM images")}
    assert set(rows) == set(expected)
    assert not [n for n, r in rows.items() if r["status"] not in ("kept", "dropped", "failed")]
    fates = {n: r["status"] if r["status"] in ("kept", "failed") else r["drop_reason"] for n, r in rows.items()}
    assert fates == expected
    assert rows["p000_a.png"]["source_text"] == "a red kite over a field"
    assert "FileNotFoundError" in rows["r_missing.jpg"]["probe_error"] and rows["r_missing.jpg"]["probe_attempts"] == 2
    assert "truncated" in rows["r_truncated.jpg"]["probe_error"]
    assert rows["r_huge_header.png"]["width"] == 100_000 and rows["r_huge_header.png"]["filter_done_at"] is None

    # Duplicates point at their original (the largest, then the first ingested); colour variants
    # stay apart although their perceptual hashes alone are within the near-duplicate distance.
    for name, fate in expected.items():
        if fate in ("exact_duplicate", "near_duplicate"):
            original = rows[name[:4] + "_a.png"]
            assert rows[name]["duplicate_of"] == original["id"] == rows[name]["dedup_group"], name
    for name in (n for n in expected if n.endswith("_e_colour.png")):
        original = rows[name[:4] + "_a.png"]
        assert rows[name]["dedup_group"] != original["dedup_group"]
        distance = (hash_int(bytes(rows[name]["phash"])) ^ hash_int(bytes(original["phash"]))).bit_count()
        assert distance <= 16, f"{name}: the colour variant should fool a perceptual hash alone ({distance} bits)"
    _probes_agree_with_the_scan(server.dsn, rows, expected)

    code, out, _ = _cli(capsys, "status", "--db", db, "--json")
    status = json.loads(out)
    kept = sum(f == "kept" for f in expected.values())
    assert status["images"] == len(expected) and status["kept"] == kept and status["failed"] == 1
    assert status["dropped"]["near_duplicate"] == sum(f == "near_duplicate" for f in expected.values())
    assert set(status["jobs"]) >= {"probe", "filter", "dedup"}
    for job in ("probe", "filter", "dedup"):
        assert set(status["jobs"][job]) >= {"done", "claimable", "failed", "rows_per_s"}
        assert status["jobs"][job]["claimable"] == 0
    assert status["jobs"]["caption"]["claimable"] == kept  # the autoscaling signal of the next job
    prometheus = _cli(capsys, "status", "--db", db, "--prometheus")[1]
    assert f'krea2_curate_job_claimable{{job="caption"}} {kept}' in prometheus

    from finetune.packs import PackReader

    code, out, err = _cli(capsys, "export", tmp_path / "pack", "--db", db, "--resolution", 128, "--batch-size", 2)
    assert code == 0, err
    reader = PackReader(tmp_path / "pack")
    assert reader.info.resolution == 128 and reader.info.batch_size == 2
    packed = reader.rows(0, len(reader), ["source", "caption_long", "width", "height"])
    assert sorted(Path(r["source"]).name for r in packed) == sorted(n for n, f in expected.items() if f == "kept")
    assert {r["caption_long"] for r in packed if r["source"].endswith("p000_a.png")} == {"a red kite over a field"}
    for start in range(0, len(packed) - 1, 2):
        assert (packed[start]["width"], packed[start]["height"]) == (packed[start + 1]["width"], packed[start + 1]["height"])
    # krea2 pretrain accepts the export as a stage's pack (checked by its dry run, nothing trained).
    pretrain = tmp_path / "pretrain.yaml"
    pretrain.write_text(f"output_dir: {tmp_path / 'run'}\n"
                        "model: {architecture: tiny, init: scratch, text_encoder: tiny-random, vae: tiny-random}\n"
                        f"stages:\n  - {{name: s128, data: {tmp_path / 'pack'}, resolution: 128, batch_size: 2, steps: 2}}\n")
    code, out, err = _cli_raw(capsys, "pretrain", pretrain, "--dry-run")
    assert code == 0, err
    assert f"pack {tmp_path / 'pack'} ({len(packed)} rows" in out


def test_three_workers_one_killed(server, tmp_path):
    """Three worker processes; one is killed -9 while it holds a batch. The queue drains, every row
    gets a status, and the claim log shows no row claimed by two live workers at once."""
    dsn = database(server, "workers")
    corpus = tmp_path / "corpus"
    expected = make_corpus(corpus, photos=18, seed=1)
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    assert krea2(["curate", "ingest", str(corpus), "--dsn", dsn]) == 0

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    def worker(batch: int) -> subprocess.Popen:
        # `krea2 curate work`, the pinned command (the krea2 console script is this module's main)
        return subprocess.Popen([sys.executable, "-m", "krea2_diffusers.cli", "curate", "work", "--dsn", dsn,
                                 "--jobs", "probe,filter,dedup",
                                 "--batch", str(batch), "--claim-log", "--config", str(config)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    victim = worker(batch=12)
    others = [worker(batch=2), worker(batch=2)]
    killed_at = None
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 120
        while killed_at is None and time.monotonic() < deadline and victim.poll() is None:
            held = conn.execute("SELECT count(*) FROM claim_log WHERE worker LIKE %s AND released_at IS NULL",
                                (f"%:{victim.pid}",)).fetchone()[0]
            if held:
                killed_at = conn.execute("SELECT clock_timestamp()").fetchone()[0]
                os.kill(victim.pid, signal.SIGKILL)
            else:
                time.sleep(0.01)
    assert killed_at is not None, "the victim never held a batch (it finished or never started)"
    victim.wait()
    for process in others:
        assert process.wait(timeout=180) == 0, process.stderr.read().decode()

    rows = query(dsn, "SELECT uri, status, drop_reason FROM images")
    assert len(rows) == len(expected)
    fates = {Path(r["uri"]).name: r["status"] if r["status"] in ("kept", "failed") else r["drop_reason"] for r in rows}
    assert fates == expected

    claims = query(dsn, "SELECT job, image_id, worker, claimed_at, released_at FROM claim_log ORDER BY job, image_id, claimed_at")
    abandoned = [c for c in claims if c["released_at"] is None]
    assert abandoned and all(c["worker"].endswith(f":{victim.pid}") for c in abandoned)
    by_row: dict[tuple, list[dict]] = {}
    for claim in claims:
        by_row.setdefault((claim["job"], claim["image_id"]), []).append(claim)
    for key, history in by_row.items():
        for first, second in zip(history, history[1:]):
            if first["released_at"] is not None:
                assert first["released_at"] <= second["claimed_at"], f"{key} claimed by two live workers: {history}"
            else:  # the killed worker's claim: only taken over after the kill
                assert second["claimed_at"] > killed_at, f"{key} taken over before the kill: {history}"
        assert history[-1]["released_at"] is not None, f"{key} never finished: {history}"
    # the abandoned rows came back and were finished by the survivors
    assert {(c["job"], c["image_id"]) for c in abandoned} <= {k for k, h in by_row.items() if len(h) > 1}


def _probes_agree_with_the_scan(dsn: str, rows: dict[str, dict], expected: dict[str, str]) -> None:
    """The multi-index probes (what a warehouse of over SCAN_ROWS rows runs) return a subset of the
    exact scan's candidates (full frames and crop windows) with the same distances and views, and
    find every near duplicate of the corpus, the crop-window ones included."""
    from curation.config import DedupConfig
    from curation.hash_index import Query, batch_candidates
    from curation.hash_scan import scan_candidates
    from curation.windows import unpack

    config = DedupConfig()
    hashed = [n for n, r in rows.items() if r["phash"] is not None]
    queries = [Query(bytes(rows[n]["phash"]), bytes(rows[n]["phash_weak"]),
                     [(h, w) for h, w, _ in unpack(bytes(rows[n]["crop_windows"]), config.hash_size, config.colour_grid)])
               for n in hashed]
    with psycopg.connect(dsn) as conn:
        found = {True: scan_candidates(conn, queries, config.hash_size, config.max_hash_distance),
                 False: batch_candidates(conn, queries, config.hash_size, config.max_hash_distance)}
    by_id = {r["id"]: n for n, r in rows.items()}
    views = set()
    for name, exact, probed in zip(hashed, found[True], found[False]):
        exact_set, probed_set = {c[:3] for c in exact}, {c[:3] for c in probed}
        assert probed_set <= exact_set, name
        if expected[name] == "near_duplicate":
            original = rows[name[:4] + "_a.png"]["id"]
            assert any(c[0] == original for c in probed_set), name
            views |= {c[2] for c in probed_set if c[0] == original}
        assert {by_id[c[0]] for c in exact_set} >= {name}  # the row itself, at distance 0
    assert any(v > 0 for v in views)  # a copy found its original's window (the original came first)


def test_bad_connections_schema_and_backoff(server, tmp_path, capsys):
    code, _, err = _cli(capsys, "status", "--dsn", "postgresql://curator@127.0.0.1:1/warehouse_x")
    assert code == 2 and "127.0.0.1" in err and "warehouse_x" in err and "Traceback" not in err
    code, _, err = _cli(capsys, "status", "--db", tmp_path / "nothing-here")
    assert code == 2 and "no warehouse" in err and "krea2 curate init" in err

    dsn = database(server, "schema")
    code, _, err = _cli(capsys, "status", "--dsn", dsn)
    assert code == 2 and "krea2 curate init" in err
    assert _cli(capsys, "init", "--dsn", dsn)[0] == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE curation_schema SET version = 99")
    for command in ("status", "init"):
        code, _, err = _cli(capsys, command, "--dsn", dsn)
        assert code == 2 and "newer" in err and "99" in err

    # A failing row waits out its back-off, then fails for good after max_attempts (error kept).
    from curation.config import QueueConfig
    from curation.warehouse import Outcome, open_warehouse

    dsn = database(server, "backoff")
    with open_warehouse(dsn=dsn, create=True, queue=QueueConfig(max_attempts=2, backoff_s=0.5)) as warehouse:
        (tmp_path / "a.png").write_bytes(b"")
        manifest = tmp_path / "list.jsonl"
        manifest.write_text('{"path": "a.png"}\n{"path": "a.png"}\n')
        from curation.sources import ingest_records

        assert warehouse.ingest(ingest_records(manifest)) == {"new": 1, "known": 0, "repeated": 1}
        (row,) = warehouse.claim("probe", 10)
        assert warehouse.claim("probe", 10) == []  # claimed by a live worker (us)
        warehouse.write("probe", [Outcome(row["id"], error="OSError: storage hiccup")])
        assert warehouse.claim("probe", 10) == [] and warehouse.waiting(["probe"])
        time.sleep(0.6)
        (row,) = warehouse.claim("probe", 10)
        warehouse.write("probe", [Outcome(row["id"], error="OSError: still down")])
        assert not warehouse.waiting(["probe"])
        status = warehouse.status()
        assert status["failed"] == 1 and status["jobs"]["probe"]["failed"] == 1
        final = query(dsn, "SELECT status, drop_reason, probe_error, probe_attempts FROM images")[0]
        assert final == {"status": "failed", "drop_reason": "failed:probe", "probe_error": "OSError: still down",
                         "probe_attempts": 2}


def test_schema_3_claims_that_find_nothing_read_no_rows(server, capsys):
    """A version-2 warehouse migrates to 3, whose filter and dedup queue indexes hold only rows
    their upstream job finished: with every row still waiting for probe, the claims that find
    nothing (what a worker runs after each batch it handed from probe to filter to dedup) read no
    row, where version 2 read every row three times per claim."""
    from curation.schema import MIGRATIONS, schema_version
    from curation.warehouse import open_warehouse

    dsn = database(server, "queue_index")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE curation_schema (version integer NOT NULL)")
        for script in MIGRATIONS[:2]:
            conn.execute(script)
        conn.execute("INSERT INTO curation_schema (version) VALUES (2)")
        # A row deduplicated before version 4 gets its index keys when the warehouse migrates.
        phash = bytes(range(18))
        conn.execute("INSERT INTO images (uri, phash, dedup_group, status) VALUES ('/old.jpg', %s, 1, 'kept')", (phash,))
    assert _cli(capsys, "init", "--dsn", dsn)[0] == 0
    with open_warehouse(dsn=dsn) as warehouse:
        assert schema_version(warehouse.conn) == len(MIGRATIONS) == 6
        bits = np.unpackbits(np.frombuffer(phash, np.uint8))  # the 78 lowest frequencies but DC, 26 a key
        low = sorted(range(1, 144), key=lambda i: (i // 12 + i % 12, i))[:78]
        expected = [int("".join(map(str, bits[low[k * 26:(k + 1) * 26]])), 2) for k in range(3)]
        keys_sql = "SELECT phash_k0, phash_k1, phash_k2 FROM {} WHERE id = %s"
        assert list(warehouse.conn.execute(keys_sql.format("images"), (1,)).fetchone()) == expected
        # Version 6 rewrites schema 5's 24-bit keys, of rows and of windows, from the stored hash bits.
        from curation.hash_index import rekey
        warehouse.conn.execute("UPDATE images SET phash_k0 = 7, phash_k1 = 8, phash_k2 = 9")
        warehouse.conn.execute("INSERT INTO image_windows SELECT id, 0, phash_bits, 1, 2, 3 FROM images")
        assert rekey(warehouse.conn) == 2
        assert list(warehouse.conn.execute(keys_sql.format("images"), (1,)).fetchone()) == expected
        assert list(warehouse.conn.execute(keys_sql.format("image_windows"), (1,)).fetchone()) == expected
        warehouse.conn.execute("DELETE FROM image_windows")
        warehouse.conn.execute("DELETE FROM images")
        warehouse.ingest((f"/nowhere/{i}.jpg", None) for i in range(300))

        def entries_read() -> dict[str, int]:
            """Index entries each queue index handed to scans so far (statistics flushed first)."""
            warehouse.conn.execute("SELECT pg_stat_force_next_flush()")
            with psycopg.connect(dsn, autocommit=True) as other:
                return dict(other.execute("SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes "
                                          "WHERE indexrelname LIKE 'images_%_queue'").fetchall())

        before = entries_read()
        assert warehouse.claim("filter", 64) == [] and warehouse.claim("dedup", 64) == []
        after = entries_read()
        assert after["images_filter_queue"] == before["images_filter_queue"]
        assert after["images_dedup_queue"] == before["images_dedup_queue"]
        assert len(warehouse.claim("probe", 64)) == 64  # the probe queue still lists every row
        assert entries_read()["images_probe_queue"] >= before["images_probe_queue"] + 64


def test_hash_index_matches_brute_force():
    """The vectorised index finds exactly the hashes a Python scan finds within the distance,
    across its growth (more than its initial capacity of 1024)."""
    rng = np.random.default_rng(0)
    bits = 144
    base = [int.from_bytes(rng.bytes(18), "big") for _ in range(1100)]
    for distance in (16, 44):
        planted = []
        for value in base[:200]:  # near neighbours at 0..distance+3 flipped bits
            flips = rng.choice(bits, size=int(rng.integers(0, distance + 4)), replace=False)
            planted.append(value ^ sum(1 << int(b) for b in flips))
        everything = base + planted
        index = HashIndex(bits, max_distance=distance)
        for key, value in enumerate(everything):
            index.add(key, value)
        assert len(index) == len(everything)
        packed = np.frombuffer(b"".join(v.to_bytes(18, "big") for v in everything), np.uint8).reshape(-1, 18)
        scanned = HashIndex.from_hashes(np.arange(len(everything)), packed, distance)  # what a batch scan builds
        for query in everything[::29]:
            brute = sorted((k, (v ^ query).bit_count()) for k, v in enumerate(everything) if (v ^ query).bit_count() <= distance)
            assert sorted(index.query(query)) == brute == sorted(scanned.query(query))


def test_index_probes_are_the_cheapest_patterns_of_the_ranked_weak_bits():
    """Per key, a query probes its key with each of the PROBES cheapest flip patterns of its ranked
    weak bits (a pattern's cost: the sum of RANK_COST ** rank over the bits it flips), here found by
    brute force over every subset; schema 4-5's weak bits (6 per 24-bit key) are translated to the
    26-bit keys by their old rank."""
    from itertools import combinations

    from curation.hash_index import PROBES, RANK_COST, SUBSTRING_BITS, WEAK_BITS, probes, ranked_weak

    rng = np.random.default_rng(1)
    costs = sorted((sum(RANK_COST ** r for r in subset), subset)
                   for n in range(WEAK_BITS + 1) for subset in combinations(range(WEAK_BITS), n))
    bar = costs[PROBES - 1][0]
    assert costs[PROBES][0] > bar + 1e-9  # no tie at the cut, so the set is unambiguous
    for _ in range(3):
        key = [int(k) for k in rng.integers(0, 1 << SUBSTRING_BITS, 3)]
        weak = [rng.choice(SUBSTRING_BITS, WEAK_BITS, replace=False) for _ in range(3)]
        probed = [set(p) for p in probes(key, np.stack(weak).astype(np.uint8).tobytes())]
        for k in range(3):
            flip = lambda subset: key[k] ^ sum(1 << (SUBSTRING_BITS - 1 - int(weak[k][r])) for r in subset)  # noqa: E731
            assert probed[k] == {flip(subset) for cost, subset in costs[:PROBES]}
            assert flip(costs[PROBES][1]) not in probed[k] and flip(()) == key[k]

    # Schema 4-5: old key 0 ranks its bits 23, 22, 0, 1, 2, 3; old key 1 (frequency indexes 24-47)
    # its 0-5, i.e. 24, 25 (now key 0's last two) and 26-29 (now key 1's first four).
    legacy = np.array([[23, 22, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]], np.uint8)
    ranked = ranked_weak(legacy.tobytes())
    assert ranked.shape == (3, WEAK_BITS)
    assert ranked[0].tolist() == [23, 24, 22, 25, 0, 1, 2, 3, 21, 20, 19, 18, 17, 16]
    assert ranked[1][:4].tolist() == [0, 1, 2, 3]  # ranks 2-5 of old key 1, before anything unranked
    with pytest.raises(ValueError, match="phash_weak of 5 bytes"):
        ranked_weak(b"12345")
    # ... and schema 5's crop windows (4 x (18 hash + 18 weak + 32 colour) bytes) still unpack.
    from curation.windows import unpack

    blob = bytes(range(4 * 18)) + legacy.tobytes() * 4 + bytes(4 * 32)
    assert [len(w) for _, w, _ in unpack(blob, 12, 4)] == [18] * 4 and unpack(blob, 12, 4)[1][1] == legacy.tobytes()


def test_semantic_duplicates_inside_leaves():
    from curation.clusters import semantic_duplicates

    vectors = np.array([[1, 0, 0], [0.999, 0.0447, 0], [0, 1, 0], [0.6, 0.8, 0], [1, 0, 0]], dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    leaves = [(0,), (0,), (0,), (0,), (1,)]  # image 4 equals image 0 but lives in another leaf
    order = [(-10, 0), (-20, 1), (-10, 2), (-10, 3), (-10, 4)]  # image 1 is the largest
    found = semantic_duplicates(vectors, leaves, order, threshold=0.95)
    assert set(found) == {0} and found[0][0] == 1 and found[0][1] == pytest.approx(float(vectors[0] @ vectors[1]))


def test_run_workers_then_captions_embeddings_clusters(server, tmp_path, capsys):
    dsn = database(server, "models")
    corpus = tmp_path / "corpus"
    expected = make_corpus(corpus, photos=1, seed=2, bad=False)  # 3 kept: captioning is the slow part
    for name in expected:
        (corpus / name).with_suffix(".txt").write_text(f"source text of {name}")
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE + "caption: {model: tiny-random, max_new_tokens: 4, rewrite_max_new_tokens: 3, "
                      "max_pixels: 4096}\nembed: {model: tiny-random}\ncluster: {levels: [2, 1], semantic_threshold: -1.0}\n")
    store = tmp_path / "store"
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    assert krea2(["curate", "ingest", str(corpus), "--dsn", dsn]) == 0
    code, out, err = _cli(capsys, "run", "--dsn", dsn, "--workers", 2, "--batch", 2, "--config", config, "--no-progress")
    assert code == 0, err
    assert out.startswith(f"images {len(expected)}: kept "), out  # the pool's result, as `curate status` prints it
    kept = query(dsn, "SELECT id, uri, width::bigint * height AS area FROM images WHERE status = 'kept' ORDER BY id")
    assert sorted(Path(r["uri"]).name for r in kept) == sorted(n for n, f in expected.items() if f == "kept")

    # Random weights only when asked for, and then with the pipeline's notice.
    code, out, err = _cli(capsys, "work", "--dsn", dsn, "--store", store, "--jobs", "caption,embed,cluster",
                          "--batch", 3, "--config", config)
    assert code == 2 and "--allow-random-weights" in err and "RANDOM WEIGHTS" in err and "Traceback" not in err
    assert not query(dsn, "SELECT id FROM images WHERE caption_attempts > 0 OR embed_attempts > 0")
    code, out, err = _cli(capsys, "work", "--dsn", dsn, "--store", store, "--jobs", "caption,embed,cluster",
                          "--batch", 3, "--config", config, "--allow-random-weights")
    assert code == 0, err
    assert "model: tiny-random (RANDOM WEIGHTS" in err
    rows = query(dsn, "SELECT * FROM images WHERE dedup_done_at IS NOT NULL AND duplicate_of IS NULL ORDER BY id")
    assert len(rows) == len(kept)
    for row in rows:
        assert all(row[c] for c in ("caption_long", "caption_medium", "caption_short")), row["uri"]
        vector = np.load(row["embedding_path"])[row["embedding_row"]]
        assert Path(row["embedding_path"]).parent == store / "embeddings"
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        assert len(row["cluster_ids"]) == 2 and row["cluster_ids"][1] == 0
    # Threshold -1: every leaf keeps only its largest (then oldest) image, the rest point at it.
    leaves: dict[tuple, list[dict]] = {}
    for row in rows:
        leaves.setdefault(tuple(row["cluster_ids"]), []).append(row)
    for members in leaves.values():
        keeper = max(members, key=lambda r: (r["width"] * r["height"], -r["id"]))
        for row in members:
            if row is keeper:
                assert row["status"] == "kept"
            else:
                assert (row["status"], row["drop_reason"], row["semantic_duplicate_of"]) == (
                    "dropped", "semantic_duplicate", keeper["id"])

    code, out, err = _cli(capsys, "export", tmp_path / "pack", "--dsn", dsn, "--resolution", 64, "--batch-size", 1,
                          "--balance", "clusters", "--per-cluster", 1)
    assert code == 0, err
    from finetune.packs import PackReader

    reader = PackReader(tmp_path / "pack")
    packed = reader.rows(0, len(reader), ["caption_long", "caption_short", "metadata"])
    assert len(packed) == len(leaves)
    assert sorted(tuple(json.loads(r["metadata"])["cluster_ids"]) for r in packed) == sorted(leaves)
    assert all(r["caption_long"] and r["caption_short"] for r in packed)


def test_larger_late_arrival_takes_over_its_group(server, tmp_path, capsys):
    from PIL import Image

    from curation.synthetic import photo

    dsn = database(server, "takeover")
    picture = photo(np.random.default_rng(5))
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    picture.resize((320, 256), Image.Resampling.LANCZOS).save(first / "small.jpg", quality=90)
    picture.save(second / "large.png")
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)
    assert _cli(capsys, "init", "--dsn", dsn)[0] == 0
    for folder in (first, second):
        assert _cli(capsys, "ingest", folder, "--dsn", dsn)[0] == 0
        assert _cli(capsys, "work", "--dsn", dsn, "--config", config)[0] == 0
    rows = {Path(r["uri"]).name: r for r in query(dsn, "SELECT * FROM images")}
    assert rows["large.png"]["status"] == "kept" and rows["large.png"]["duplicate_of"] is None
    assert (rows["small.jpg"]["status"], rows["small.jpg"]["drop_reason"], rows["small.jpg"]["duplicate_of"]) == (
        "dropped", "near_duplicate", rows["large.png"]["id"])


def test_real_model_defaults_fail_clearly_offline(server, tmp_path, capsys):
    """caption and embed default to real models (the pipeline's Qwen3-VL, SigLIP-2); absent and
    offline, the worker stops with one line naming the model before it claims any row."""
    dsn = database(server, "offline")
    corpus = tmp_path / "corpus"
    make_corpus(corpus, photos=1, seed=3, bad=False)
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)
    assert _cli(capsys, "init", "--dsn", dsn)[0] == 0
    assert _cli(capsys, "ingest", corpus, "--dsn", dsn)[0] == 0
    assert _cli(capsys, "work", "--dsn", dsn, "--config", config)[0] == 0
    # A fresh process: the hub library reads HF_HUB_OFFLINE when it is imported.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "curation", "work", "--dsn", dsn, "--store", str(tmp_path),
                             "--jobs", "caption", "--config", str(config)], env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "caption.model 'Qwen/Qwen3-VL-4B-Instruct' cannot be loaded" in result.stderr
    assert "Traceback" not in result.stderr
    config.write_text(FAST_QUEUE + f"embed: {{model: {tmp_path / 'no-such-encoder'}}}\n")
    code, _, err = _cli(capsys, "work", "--dsn", dsn, "--store", tmp_path, "--jobs", "embed", "--config", config)
    assert code == 2 and "embed.model" in err and "no-such-encoder" in err and "Traceback" not in err
    assert not query(dsn, "SELECT id FROM images WHERE caption_attempts > 0 OR embed_attempts > 0")
    from curation.config import CurationConfig

    assert CurationConfig().embed.model == "google/siglip2-base-patch16-224"
