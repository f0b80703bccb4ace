"""Curation under worker deaths: a poison row that kills every worker claiming it ends ``failed``
after max_attempts deaths while the rest completes, and 16 workers with 4 killed -9 at random
moments finish 400 images (each probe batch held 0.4 s by the delay hook) with every row settled
exactly once and no row held by two live workers at once (claim log)."""

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

from curation.synthetic import make_corpus, photo
from curation.worker import CRASH_HOOK, DELAY_HOOK
from curation_warehouse import FAST_QUEUE, REPO, database, query, server  # noqa: F401 (server: a fixture)
from krea2_diffusers.cli import main as krea2

CHAOS_IMAGES = 400  # 50 batches of 8
DELAY_S = 0.4  # a probe batch is held this long (the delay hook)


def _fates(dsn: str) -> dict[str, str]:
    rows = query(dsn, "SELECT uri, status, drop_reason FROM images")
    return {Path(r["uri"]).name: r["status"] if r["status"] in ("kept", "failed", "pending") else r["drop_reason"]
            for r in rows}


def test_poison_row_fails_after_max_attempts_deaths(server, tmp_path, capsys, monkeypatch):
    dsn = database(server, "poison")
    corpus = tmp_path / "corpus"
    expected = make_corpus(corpus, photos=4, seed=3, bad=False)
    photo(np.random.default_rng(99)).save(corpus / "p001_z_poison.png")
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE)  # max_attempts 2
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    assert krea2(["curate", "ingest", str(corpus), "--dsn", dsn]) == 0
    monkeypatch.setenv(CRASH_HOOK, "/p001_z_poison.png")  # workers inherit it: probing that file kills them
    capsys.readouterr()
    code = krea2(["curate", "run", "--dsn", dsn, "--workers", "2", "--batch", "4", "--claim-log", "--config",
                  str(config), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("killed by signal 9") == 2, err  # the pool replaced both workers the row killed

    assert _fates(dsn) == {**expected, "p001_z_poison.png": "failed"}
    (poison,) = query(dsn, "SELECT * FROM images WHERE uri LIKE '%%/p001_z_poison.png'")
    assert (poison["drop_reason"], poison["probe_error"]) == ("failed:probe", "worker died while processing (2 times)")
    assert (poison["probe_attempts"], poison["probe_deaths"], poison["probe_claimed_by"]) == (2, 2, None)
    # Its first claim took innocent rows down with it; its retry was a batch of one, so they were
    # each charged one death and then finished.
    claims = query(dsn, "SELECT image_id, backend_pid, claimed_at, released_at FROM claim_log WHERE job = 'probe' "
                        "ORDER BY claimed_at, image_id")
    mine = [c for c in claims if c["image_id"] == poison["id"]]
    assert len(mine) == 2 and all(c["released_at"] is None for c in mine)
    # A killed worker's batch: the claims its backend never released.
    first_batch = [c for c in claims if c["backend_pid"] == mine[0]["backend_pid"] and c["released_at"] is None]
    retry_batch = [c for c in claims if c["backend_pid"] == mine[1]["backend_pid"] and c["released_at"] is None]
    assert len(first_batch) > 1 and len(retry_batch) == 1
    innocents = [c["image_id"] for c in first_batch if c["image_id"] != poison["id"]]
    for row in query(dsn, "SELECT probe_deaths, probe_done_at FROM images WHERE id = ANY(%s)", (innocents,)):
        assert row["probe_deaths"] == 1 and row["probe_done_at"] is not None

    capsys.readouterr()
    assert krea2(["curate", "status", "--dsn", dsn, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["failed"] == 1 and status["pending"] == 0
    assert status["jobs"]["probe"]["failed"] == 1
    assert status["jobs"]["probe"]["deaths"] == 2 + len(innocents)


def _small_corpus(folder: Path, count: int, copy_every: int) -> dict[str, str]:
    """``count`` 64x48 PNGs; every ``copy_every``-th is a byte copy of the previous photograph.
    Returns copy name -> original name."""
    folder.mkdir()
    rng = np.random.default_rng(4)
    copies, last = {}, None
    for i in range(count):
        name = f"i{i:05d}.png"
        if i % copy_every == copy_every - 1:
            (folder / name).write_bytes((folder / last).read_bytes())
            copies[name] = last
            continue
        photo(rng, (64, 48)).save(folder / name, compress_level=1)
        last = name
    return copies


def test_sixteen_workers_four_killed(server, tmp_path):
    dsn = database(server, "chaos")
    # A small corpus held longer: each probe batch waits DELAY_S before its write (the delay hook), so
    # at any moment several workers hold claims without thousands of images to process.
    copies = _small_corpus(tmp_path / "corpus", CHAOS_IMAGES, copy_every=10)
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE + "filter: {min_side: 32}\n")
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    assert krea2(["curate", "ingest", str(tmp_path / "corpus"), "--dsn", dsn]) == 0

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **{DELAY_HOOK: str(DELAY_S)})
    command = [sys.executable, "-m", "curation", "work", "--dsn", dsn, "--batch", "8", "--claim-log",
               "--config", str(config)]
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for _ in range(16)]
    by_pid = {process.pid: process for process in workers}
    rng = np.random.default_rng(0)
    killed_at: dict[int, object] = {}
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        # Four kill moments drawn at once, counted from the first claim; at each, the victim is drawn
        # among the workers holding a batch then (so a worker that started late or found the queue
        # empty is never waited for).
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not conn.execute("SELECT count(*) FROM claim_log").fetchone()[0]:
            time.sleep(0.02)
        start = time.monotonic()
        moments = sorted(start + float(t) for t in rng.uniform(0.0, 1.5, size=4))
        while moments and time.monotonic() < deadline:
            if time.monotonic() < moments[0]:
                time.sleep(0.02)
                continue
            holders = [int(w.rsplit(":", 1)[1]) for (w,) in conn.execute(
                "SELECT DISTINCT worker FROM claim_log WHERE released_at IS NULL ORDER BY worker").fetchall()]
            holders = [pid for pid in holders if pid in by_pid and pid not in killed_at and by_pid[pid].poll() is None]
            if not holders:
                time.sleep(0.02)
                continue
            victim = holders[int(rng.integers(len(holders)))]
            os.kill(victim, signal.SIGKILL)
            killed_at[victim] = conn.execute("SELECT clock_timestamp()").fetchone()[0]
            moments.pop(0)
    assert len(killed_at) == 4, "the queue drained before four workers were killed holding a batch"
    for process in workers:
        if process.pid not in killed_at:
            assert process.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, process.stderr.read().decode()
        else:
            process.wait()

    # Nothing lost: every row settled, copies grouped with their original, nothing failed.
    rows = query(dsn, "SELECT id, uri, status, drop_reason, probe_done_at, filter_done_at, dedup_done_at FROM images")
    assert len(rows) == CHAOS_IMAGES
    assert {r["status"] for r in rows} <= {"kept", "dropped"}
    fates = {Path(r["uri"]).name: r["drop_reason"] for r in rows}
    for copy, original in copies.items():  # the same bytes: the same filter verdict, or grouped
        assert fates[copy] == (fates[original] or "exact_duplicate"), (copy, fates[copy], fates[original])
    assert sum(f == "exact_duplicate" for f in fates.values()) > 0.75 * len(copies)
    # Nothing grouped twice (no lock over the warehouse: serializable batches): each group has one
    # kept row, which its duplicates point at, and no two kept rows share an md5.
    grouped = query(dsn, "SELECT id, md5, status, dedup_group, duplicate_of FROM images WHERE dedup_group IS NOT NULL")
    kept_of = {r["dedup_group"]: r["id"] for r in grouped if r["status"] == "kept"}
    assert sum(r["status"] == "kept" for r in grouped) == len(kept_of) == len({r["dedup_group"] for r in grouped})
    assert all(r["duplicate_of"] == kept_of[r["dedup_group"]] for r in grouped if r["status"] == "dropped")
    kept_md5 = [r["md5"] for r in grouped if r["status"] == "kept"]
    assert len(kept_md5) == len(set(kept_md5))
    for row in rows:
        reached = ["probe"] + (["filter"] if row["drop_reason"] in (None, "exact_duplicate", "near_duplicate") or
                               row["filter_done_at"] else [])
        assert all(row[f"{job}_done_at"] for job in reached), row

    # Claim log: each (job, row) finished exactly once; a later claim starts only after the earlier
    # one was released or its worker was killed; only the killed workers left claims open.
    claims = query(dsn, "SELECT job, image_id, worker, claimed_at, released_at, outcome FROM claim_log "
                        "ORDER BY job, image_id, claimed_at")
    killed_workers = {f":{pid}": at for pid, at in killed_at.items()}
    by_row: dict[tuple, list[dict]] = {}
    for claim in claims:
        by_row.setdefault((claim["job"], claim["image_id"]), []).append(claim)
    assert {row["id"] for row in rows} == {image for job, image in by_row if job == "probe"}
    open_claims = 0
    for key, history in by_row.items():
        assert [c["outcome"] for c in history if c["released_at"] is not None] == ["done"], (key, history)
        for first, second in zip(history, history[1:]):
            if first["released_at"] is not None:
                assert first["released_at"] <= second["claimed_at"], f"{key} held by two live workers: {history}"
            else:
                killer = next(at for suffix, at in killed_workers.items() if first["worker"].endswith(suffix))
                assert second["claimed_at"] > killer, f"{key} taken over before its worker died: {history}"
                open_claims += 1
        assert history[-1]["released_at"] is not None, f"{key} never finished: {history}"
    assert open_claims >= 4  # every victim held at least one row when it was killed


def test_dedup_batch_commits_its_claim_log_release_with_its_rows(server, tmp_path, monkeypatch):
    """A dedup worker that dies between placing its batch and closing its claim-log entries leaves
    either both (rows placed, claims released: one transaction) or neither; CI once saw a placed row
    whose claim stayed open, the release having run after the commit."""
    from curation.config import load_config
    from curation.dedup import DedupJob
    from curation.warehouse import Warehouse, open_warehouse

    dsn = database(server, "dedup_release")
    _small_corpus(tmp_path / "corpus", 16, copy_every=4)
    assert krea2(["curate", "init", "--dsn", dsn]) == 0
    assert krea2(["curate", "ingest", str(tmp_path / "corpus"), "--dsn", dsn]) == 0
    config = tmp_path / "curate.yaml"
    config.write_text(FAST_QUEUE + "filter: {min_side: 32}\n")
    assert krea2(["curate", "run", "--dsn", dsn, "--jobs", "probe,filter", "--workers", "1", "--config", str(config),
                  "--no-progress"]) == 0

    class Killed(BaseException):  # what a SIGKILL leaves: nothing after this point runs
        pass

    def die(self, job, ids, outcome):
        raise Killed

    with open_warehouse(dsn=dsn) as warehouse:
        warehouse.log_claims = True
        rows = warehouse.claim("dedup", 16)
        assert rows
        monkeypatch.setattr(Warehouse, "release_log", die)
        try:
            DedupJob(load_config(config).dedup).run(warehouse, rows)
        except Killed:
            pass
    ids = [r["id"] for r in rows]
    placed = query(dsn, "SELECT id FROM images WHERE id = ANY(%s) AND dedup_done_at IS NOT NULL", (ids,))
    open_claims = query(dsn, "SELECT image_id FROM claim_log WHERE job = 'dedup' AND released_at IS NULL")
    assert placed == [] and len(open_claims) == len(ids), (placed, open_claims)


def _shard_rows(dsn: str, fingerprints: list[tuple], start: int) -> None:
    """Rows that passed probe and filter, with the given (md5, phash, weak, colour, thumbnail, side)
    and the index keys the filter job writes with them."""
    from curation.hash_index import bit_text, row_keys

    with psycopg.connect(dsn, autocommit=True) as conn:
        for n, (md5, phash, weak, colour, thumb, side) in enumerate(fingerprints):
            conn.execute("INSERT INTO images (uri, md5, width, height, phash, phash_weak, colour_hash, thumbnail, "
                         "phash_k0, phash_k1, phash_k2, phash_bits, probe_done_at, filter_done_at) "
                         "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::varbit, now(), now())",
                         (f"/shard/{start + n}.jpg", md5, side, side, phash, weak, colour, thumb,
                          *row_keys(phash, 12), bit_text(phash)))


def test_dedup_shards_merges_resumes_after_kill_and_is_idempotent(server, tmp_path):
    """Two warehouses hold copies of the same images (hash a few bits apart, same colour and
    thumbnail, other md5; one byte-identical): after `dedup-shards` each pair keeps one row, the
    larger, else the older (shard A's, ingested first); unrelated rows stay. A run killed with -9
    mid-run resumes from the progress it recorded, and a second full run changes nothing."""
    from curation.hash_index import weak_bits

    rng = np.random.default_rng(3)
    shard_a, shard_b = database(server, "shard_a"), database(server, "shard_b")
    originals, copies, sides = [], [], []
    for n in range(40):
        phash = bytearray(rng.integers(0, 256, 18, dtype=np.uint8).tobytes())
        phash[0] |= 0x80
        colour, thumb = rng.integers(0, 256, 32, np.uint8).tobytes(), rng.integers(0, 256, 1024, np.uint8).tobytes()
        fingerprint = (f"a{n}", bytes(phash), weak_bits(rng.random(144), 12), colour, thumb, 300)
        originals.append(fingerprint)
        if n < 30:  # a copy in shard B: 3 bits flipped, larger for every third
            copied = bytearray(phash)
            for bit in rng.choice(np.arange(8, 144), 3, replace=False):
                copied[bit // 8] ^= 0x80 >> (bit % 8)
            sides.append(400 if n % 3 == 0 else 300)
            copies.append((f"a{n}" if n == 29 else f"b{n}", bytes(copied), weak_bits(rng.random(144), 12),
                           fingerprint[3], fingerprint[4], sides[-1]))
        else:
            copies.append((f"b{n}", rng.integers(0, 256, 18, np.uint8).tobytes(), weak_bits(rng.random(144), 12),
                           rng.integers(0, 256, 32, np.uint8).tobytes(), rng.integers(0, 256, 1024, np.uint8).tobytes(), 300))
    for dsn, rows, start in ((shard_a, originals, 0), (shard_b, copies, 100)):
        assert krea2(["curate", "init", "--dsn", dsn]) == 0
        _shard_rows(dsn, rows, start)
        assert krea2(["curate", "work", "--dsn", dsn, "--jobs", "dedup"]) == 0
    assert all(r["status"] == "kept" for dsn in (shard_a, shard_b) for r in query(dsn, "SELECT status FROM images"))

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # One pair per committed batch (30 commits). The kill must land mid-run on any machine: polling for the
    # first drop raced (under load all 30 commits landed between two polls: count() == 30, seen twice in CI).
    # So this transaction holds shard A's progress table: the worker commits its first batch's drop, then
    # waits at its first progress write, where it is killed.
    command = [sys.executable, "-m", "curation", "dedup-shards", "--dsn", shard_a, "--dsn", shard_b, "--batch", "1"]
    holder = psycopg.connect(shard_a)
    holder.execute("LOCK TABLE shard_progress IN EXCLUSIVE MODE")
    waiting = ("SELECT count(*) AS n FROM pg_locks WHERE NOT granted AND relation = 'shard_progress'::regclass")
    try:
        run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while run.poll() is None and time.monotonic() < deadline and not query(shard_a, waiting)[0]["n"]:
            time.sleep(0.01)
        assert run.poll() is None, f"dedup-shards ended before it could be killed: {run.stderr.read()}"
        assert query(shard_a, waiting)[0]["n"], "dedup-shards never reached its first progress write"
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
    finally:
        holder.rollback()
        holder.close()
    dropped = "SELECT count(*) AS n FROM images WHERE drop_job = 'dedup-shards'"
    count = lambda: query(shard_a, dropped)[0]["n"] + query(shard_b, dropped)[0]["n"]  # noqa: E731
    assert count() == 1  # the first batch's pair, committed; 29 to go

    def state() -> list:
        return [query(dsn, "SELECT uri, status, drop_reason, shard_duplicate_of FROM images ORDER BY uri")
                for dsn in (shard_a, shard_b)]

    for _ in range(2):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        if _ == 0:
            merged = state()
    assert state() == merged  # the second full run changed nothing
    uuid_a, uuid_b = (query(dsn, "SELECT id::text FROM curation_shard")[0]["id"] for dsn in (shard_a, shard_b))
    rows_a = {Path(r["uri"]).stem: r for r in merged[0]}
    rows_b = {Path(r["uri"]).stem: r for r in merged[1]}
    for n in range(40):
        a, b = rows_a[str(n)], rows_b[str(100 + n)]
        if n >= 30:
            assert a["status"] == b["status"] == "kept", (n, a, b)
            continue
        reason = "exact_duplicate" if n == 29 else "near_duplicate"
        if sides[n] > 300:  # B's copy is larger: it stays, A's original points at it
            assert (a["status"], a["drop_reason"], b["status"]) == ("dropped", reason, "kept"), (n, a, b)
            assert a["shard_duplicate_of"].startswith(uuid_b + ":")
        else:  # same size: the older (A's, ingested first) stays
            assert (a["status"], b["status"], b["drop_reason"]) == ("kept", "dropped", reason), (n, a, b)
            assert b["shard_duplicate_of"].startswith(uuid_a + ":")
