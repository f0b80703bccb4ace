"""Curation throughput and dedup scaling.

    python bench/bench_curation.py [--photos 60] [--workers 1 2 4] [--hashes 1000 10000 100000]

1. rows/s of probe+filter+dedup with 1, 2 and 4 worker processes (``python -m curation work``,
   exactly what ``krea2 curate run`` starts) on one synthetic corpus, each count on a fresh
   database of one embedded Postgres: wall time from start to the last worker's exit, and the
   queue's own span (first claim to last dedup write) which excludes process start-up.
2. dedup time as the number of hashes grows from 1e3 to 1e5: the multi-index hash index
   (insert + query each hash, as the dedup job does) next to a vectorised full scan (numpy XOR +
   popcount against every earlier hash), in the same process; the ratio shows the scan's
   quadratic growth against the index's near-linear growth.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from curation.config import DedupConfig  # noqa: E402
from curation.dedup import HashIndex  # noqa: E402
from curation.server import EmbeddedServer  # noqa: E402
from curation.synthetic import make_corpus  # noqa: E402

DEDUP = DedupConfig()
HASH_BITS, BANDS, MAX_DISTANCE = DEDUP.hash_size ** 2, DEDUP.bands, DEDUP.max_hash_distance
NEAR_SHARE = 0.1  # share of hashes planted as near copies of earlier ones


def throughput(server: EmbeddedServer, corpus: Path, workers: int, batch: int) -> dict:
    import psycopg

    name = f"bench_{workers}"
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = server.uri(name)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = [sys.executable, "-m", "curation"]
    subprocess.run([*run, "init", "--dsn", dsn], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([*run, "ingest", str(corpus), "--dsn", dsn], check=True, env=env, stdout=subprocess.DEVNULL)
    start = time.perf_counter()
    config = corpus.parent / "fast-retry.yaml"  # the corpus's one missing file must not stall the timing
    config.write_text("queue: {max_attempts: 2, backoff_s: 0.0}\n")
    procs = [subprocess.Popen([*run, "work", "--dsn", dsn, "--jobs", "probe,filter,dedup", "--batch", str(batch),
                               "--config", str(config)],
                              env=env, stdout=subprocess.DEVNULL) for _ in range(workers)]
    for proc in procs:
        proc.wait()
    wall = time.perf_counter() - start
    with psycopg.connect(dsn) as conn:
        rows, span, pending = conn.execute(
            "SELECT count(*), extract(epoch FROM greatest(max(probe_done_at), max(filter_done_at), max(dedup_done_at)) "
            "- min(probe_last_tried_at)), count(*) FILTER (WHERE status = 'pending') FROM images").fetchone()
    assert pending == 0, f"{pending} rows left pending"
    return {"workers": workers, "rows": rows, "wall_s": wall, "rows_per_s_wall": rows / wall,
            "queue_span_s": float(span), "rows_per_s_queue": rows / float(span)}


def planted_hashes(n: int, rng: np.random.Generator) -> list[int]:
    values: list[int] = []
    for _ in range(n):
        if values and rng.random() < NEAR_SHARE:
            flips = rng.choice(HASH_BITS, size=int(rng.integers(0, MAX_DISTANCE)), replace=False)
            values.append(values[int(rng.integers(len(values)))] ^ sum(1 << int(b) for b in flips))
        else:
            values.append(int.from_bytes(rng.bytes(HASH_BITS // 8), "big"))
    return values


def index_time(values: list[int]) -> tuple[float, int]:
    index = HashIndex(HASH_BITS, BANDS, MAX_DISTANCE)
    start = time.perf_counter()
    matches = 0
    for key, value in enumerate(values):
        matches += bool(index.query(value))
        index.add(key, value)
    return time.perf_counter() - start, matches


def scan_time(values: list[int], limit_s: float) -> tuple[float | None, int]:
    """Full scan against all earlier hashes (numpy); None when it would exceed ``limit_s``."""
    words = np.array([[(v >> (64 * w)) & (2**64 - 1) for w in range(3)] for v in values], dtype=np.uint64)
    start = time.perf_counter()
    matches = 0
    for i in range(1, len(values)):
        distance = np.bitwise_count(words[:i] ^ words[i]).sum(1)
        matches += bool((distance <= MAX_DISTANCE).any())
        if time.perf_counter() - start > limit_s:
            return None, matches
    return time.perf_counter() - start, matches


def worker_counts(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        files = len(make_corpus(corpus, photos=args.photos))
        print(f"corpus: {files} files ({args.photos} photographs + copies, variants, bad files); {os.cpu_count()} CPUs")
        server = EmbeddedServer(Path(tmp) / "db", create=True)
        try:
            base = None
            for workers in args.workers:
                r = throughput(server, corpus, workers, args.batch)
                base = base or r["rows_per_s_queue"]
                print(f"probe+filter+dedup  workers={workers}  rows={r['rows']}  wall {r['wall_s']:.2f} s "
                      f"({r['rows_per_s_wall']:.1f} rows/s)  queue span {r['queue_span_s']:.2f} s "
                      f"({r['rows_per_s_queue']:.1f} rows/s, x{r['rows_per_s_queue'] / base:.2f} vs first)")
        finally:
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=60, help="distinct photographs in the corpus (~2.3 files each)")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4], help="worker counts (none: skip)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hashes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--scan-limit-s", type=float, default=120.0, help="skip the full scan beyond this time")
    args = parser.parse_args()
    # A timeout's SIGTERM must still stop the embedded server (the finally below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    if args.workers:
        worker_counts(args)

    rng = np.random.default_rng(0)
    for n in args.hashes:
        values = planted_hashes(n, rng)
        t_index, m_index = index_time(values)
        t_scan, m_scan = scan_time(values, args.scan_limit_s)
        scan = f"{t_scan:.2f} s ({t_scan / t_index:.1f}x the index)" if t_scan is not None else f"> {args.scan_limit_s:.0f} s (stopped)"
        same = "" if t_scan is None else ("  same matches" if m_scan == m_index else f"  MISMATCH {m_scan} vs {m_index}")
        print(f"dedup  n={n:>6}  index {t_index:.2f} s ({t_index / n * 1e6:.0f} us/hash, {m_index} matched)  "
              f"full scan {scan}{same}")


if __name__ == "__main__":
    main()
