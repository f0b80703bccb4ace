"""Curation throughput against the decode + hash floor, measured in the same run on the same files.

    python bench/bench_curation.py [--images 2000] [--workers N] [--repeats 2] [--json OUT]
                                   [--hashes 1000 10000 100000]

1. Pipeline: probe + filter + dedup through Postgres with ``--workers`` worker processes
   (``python -m curation work``, what ``krea2 curate run`` starts; default one per core) on a
   fresh database of one embedded Postgres: images / wall seconds (process start to the last
   exit) / workers.
2. Floor: the same number of processes, each a plain loop over its share of the same files that
   reads, md5-hashes and fully decodes every image (what any pipeline must at least do):
   images / wall seconds / workers.
Both run ``--repeats`` times, alternating, and the best run of each counts (the machine may be
shared: the quietest figures are the ones that measure the code). The corpus: 512x384 JPEG
photographs (q90), every tenth a cropped, resized, recompressed copy of the one before.
3. ``--hashes``: the dedup candidate scan's cost per image (insert + query) as the warehouse grows.

``--json OUT`` writes ``{"images_per_s_per_core", "floor_images_per_s_per_core", "workers", ...}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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

SIZE = (512, 384)
COPY_EVERY = 10


def make_files(folder: Path, count: int) -> None:
    from curation.synthetic import copy_of, photo

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    picture = None
    for i in range(count):
        path = folder / f"i{i:06d}.jpg"
        if i % COPY_EVERY == COPY_EVERY - 1:
            path.write_bytes(copy_of(picture, tuple(rng.uniform(0, 0.04, 4)), 0.9, 80))
        else:
            picture = photo(rng, SIZE)
            picture.save(path, quality=90)


def floor_shard(corpus: Path, shard: int, shards: int) -> None:
    """Read, md5 and fully decode every ``shards``-th file from ``shard`` (the floor's loop)."""
    from PIL import Image

    for path in sorted(corpus.iterdir())[shard::shards]:
        data = path.read_bytes()
        hashlib.md5(data).hexdigest()
        with Image.open(path) as image:
            image.convert("RGB")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def floor(corpus: Path, workers: int) -> float:
    """Images per second per process of the floor loop in ``workers`` processes."""
    count = len(list(corpus.iterdir()))
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--floor-shard", str(corpus), str(i), str(workers)], env=_env())
             for i in range(workers)]
    assert all(p.wait() == 0 for p in procs), "a floor process failed"
    return count / (time.perf_counter() - start) / workers


def pipeline(server: EmbeddedServer, corpus: Path, workers: int, batch: int, run: int) -> float:
    """Images per second per worker of probe + filter + dedup through Postgres."""
    import psycopg

    name = f"bench_{run}"
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = server.uri(name)
    curate = [sys.executable, "-m", "curation"]
    subprocess.run([*curate, "init", "--dsn", dsn], check=True, env=_env(), stdout=subprocess.DEVNULL)
    subprocess.run([*curate, "ingest", str(corpus), "--dsn", dsn], check=True, env=_env(), stdout=subprocess.DEVNULL)
    start = time.perf_counter()
    procs = [subprocess.Popen([*curate, "work", "--dsn", dsn, "--jobs", "probe,filter,dedup", "--batch", str(batch)],
                              env=_env(), stdout=subprocess.DEVNULL) for _ in range(workers)]
    assert all(p.wait() == 0 for p in procs), "a worker failed"
    wall = time.perf_counter() - start
    with psycopg.connect(dsn) as conn:
        rows, pending, kept, copies = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'kept'), "
            "count(*) FILTER (WHERE drop_reason = 'near_duplicate') FROM images").fetchone()
    assert pending == 0, f"{pending} rows left pending"
    print(f"  pipeline run {run}: {rows} rows in {wall:.2f} s, {kept} kept, {copies} near duplicates")
    return rows / wall / workers


def hash_scaling(sizes: list[int]) -> None:
    config = DedupConfig()
    bits = config.hash_size ** 2
    rng = np.random.default_rng(0)
    for n in sizes:
        values = [int.from_bytes(rng.bytes(bits // 8), "big") for _ in range(n)]
        index = HashIndex(bits, config.max_hash_distance)
        start = time.perf_counter()
        for key, value in enumerate(values):
            index.query(value)
            index.add(key, value)
        took = time.perf_counter() - start
        print(f"dedup scan  n={n:>7}  {took:.2f} s  ({took / n * 1e6:.0f} us per image, last queries over {n} hashes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="OUT", default=None)
    parser.add_argument("--hashes", type=int, nargs="*", default=[])
    parser.add_argument("--floor-shard", nargs=3, metavar=("CORPUS", "SHARD", "SHARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_shard:
        floor_shard(Path(args.floor_shard[0]), int(args.floor_shard[1]), int(args.floor_shard[2]))
        return
    # A timeout's SIGTERM must still stop the embedded server (the finally below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        make_files(corpus, args.images)
        load = os.getloadavg()
        print(f"corpus: {args.images} JPEGs {SIZE[0]}x{SIZE[1]}; {args.workers} workers on {os.cpu_count()} CPUs; "
              f"load average {load[0]:.1f}")
        server = EmbeddedServer(Path(tmp) / "db", create=True)
        try:
            ours, floors = [], []
            for run in range(args.repeats):
                floors.append(floor(corpus, args.workers))
                print(f"  floor run {run}: {floors[-1]:.1f} images/s per core")
                ours.append(pipeline(server, corpus, args.workers, args.batch, run))
                print(f"  pipeline run {run}: {ours[-1]:.1f} images/s per core")
        finally:
            server.close()
    result = {"images_per_s_per_core": round(max(ours), 2), "floor_images_per_s_per_core": round(max(floors), 2),
              "workers": args.workers, "images": args.images, "ratio_to_floor": round(max(ours) / max(floors), 3),
              "load_average_1m_before": round(load[0], 2), "load_average_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    hash_scaling(args.hashes)


if __name__ == "__main__":
    main()
