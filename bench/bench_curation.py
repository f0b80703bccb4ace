"""Curation throughput against the decode + hash floor, measured in the same run on the same files.

    python bench/bench_curation.py [--images 2000] [--workers N] [--repeats 2] [--json OUT]
                                   [--hashes 1000 10000 100000]

1. Pipeline: probe + filter + dedup through Postgres with ``--workers`` worker processes
   (``python -m curation work``, what ``krea2 curate run`` starts; default one per core) on a
   fresh database of one embedded Postgres.
2. Floor: the same number of processes, each a plain loop over its share of the same files that
   reads, md5-hashes and fully decodes every image (what any pipeline must at least do).
Images per core is images / CPU seconds spent (the processes' and, for the pipeline, the Postgres
server's: its backends included), i.e. the rate of a core the work has to itself; on a machine
shared with other jobs a wall-clock rate measures the neighbours (both are printed, the JSON
keeps the wall rates as ``wall_*``). Both run ``--repeats`` times, alternating, and the best run
of each counts. The corpus: 512x384 JPEG
photographs (q90), every tenth a cropped, resized, recompressed copy of the one before.
3. ``--hashes``: the in-memory exact scan's cost per image (insert + query) as it grows (the reference).
4. ``--scale 1e5,1e6,1e7``: the dedup stage alone, the warehouse's candidate index on synthetic
   hashes with real planted near duplicates (bench/dedup_scale.py): per-image cost against the
   table's size, recall against the exact scan, index bytes per row, 1/2/4 workers. Runs alone.

5. ``--crops N``: near-duplicate recall per kind of copy (crops up to 5%, 5-10%, 10-15% a side,
   16:9 and 1:1 centre crops, resizes, JPEG) and precision over N originals with their colour
   variants and layout look-alikes, both arrival orders, and the warehouse probes' recall against
   the exact scan (bench/dedup_crops.py). Runs alone.

``--json OUT`` writes ``{"images_per_s_per_core", "floor_images_per_s_per_core", "workers", ...}``,
with ``--scale`` ``{"scale": [{"rows", "ms_per_image", "recall_vs_exact", "index_bytes_per_row", ...}]}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import resource
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


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _server_cpu(server: EmbeddedServer | None) -> float:
    """CPU seconds of the Postgres server: its live processes plus the backends it has reaped."""
    import psutil

    if server is None:
        return 0.0
    pid = int((server.folder / "pgdata" / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    total = 0.0
    for process in [postmaster, *postmaster.children()]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # a backend that ended meanwhile is counted by the postmaster
            continue
        total += times.user + times.system + (times.children_user + times.children_system if process is postmaster else 0)
    return total


def timed(command_lines: list[list[str]], server: EmbeddedServer | None = None) -> tuple[float, float]:
    """Run the processes side by side; returns (wall seconds, CPU seconds of them and of the server)."""
    cpu, server_cpu, start = _children_cpu(), _server_cpu(server), time.perf_counter()
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.DEVNULL) for c in command_lines]
    assert all(p.wait() == 0 for p in procs), "a process failed"
    wall = time.perf_counter() - start
    return wall, _children_cpu() - cpu + _server_cpu(server) - server_cpu


def floor(corpus: Path, workers: int) -> tuple[float, float]:
    """(images per second per process, images per CPU second) of the floor loop in ``workers`` processes."""
    count = len(list(corpus.iterdir()))
    wall, cpu = timed([[sys.executable, __file__, "--floor-shard", str(corpus), str(i), str(workers)]
                       for i in range(workers)])
    return count / wall / workers, count / cpu


def pipeline(server: EmbeddedServer, corpus: Path, workers: int, batch: int, run: int) -> tuple[float, float]:
    """(images per second per worker, images per CPU second of workers + Postgres) of probe +
    filter + dedup through Postgres."""
    import psycopg

    name = f"bench_{run}"
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = server.uri(name)
    curate = [sys.executable, "-m", "curation"]
    subprocess.run([*curate, "init", "--dsn", dsn], check=True, env=_env(), stdout=subprocess.DEVNULL)
    subprocess.run([*curate, "ingest", str(corpus), "--dsn", dsn], check=True, env=_env(), stdout=subprocess.DEVNULL)
    wall, cpu = timed([[*curate, "work", "--dsn", dsn, "--jobs", "probe,filter,dedup", "--batch", str(batch)]] * workers,
                      server)
    with psycopg.connect(dsn) as conn:
        rows, pending, kept, copies = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'kept'), "
            "count(*) FILTER (WHERE drop_reason = 'near_duplicate') FROM images").fetchone()
    assert pending == 0, f"{pending} rows left pending"
    print(f"  pipeline run {run}: {rows} rows in {wall:.2f} s ({cpu:.1f} CPU s), {kept} kept, {copies} near duplicates")
    return rows / wall / workers, rows / cpu


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


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(part)) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale {text!r}: give sizes like 1e5,1e6,1e7") from None
    if any(n < 1000 for n in sizes):
        raise argparse.ArgumentTypeError(f"--scale {text!r}: each size must be at least 1000 rows")
    return sizes


def _configure(folder: Path, shared_buffers_mb: int) -> None:
    import psycopg

    server = EmbeddedServer(folder, create=True)
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET shared_buffers = '{shared_buffers_mb}MB'")
    server.close()  # the last handle stops the server


def scale(sizes: list[int], pairs: int, out: str | None, buffers: bool = True) -> None:
    from dedup_scale import load_and_recall, real_pairs, timing
    from full_size_record import cpu_record, describe_cpu

    # The cost past the cache depends on the CPU's last-level cache (an 18 MB index fits a 32 MB L3 at 1e5
    # rows, a 600 MB one fits none): the record names it.
    cpu = cpu_record()
    print(f"cpu: {describe_cpu(cpu)}", flush=True)
    start = time.perf_counter()
    planted = real_pairs(pairs)
    print(f"{len(planted)} real copy pairs fingerprinted in {time.perf_counter() - start:.1f} s; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # Shared buffers that hold the largest index (~180 B a row), as a server sized for its
        # warehouse would: with pgserver's default 128 MB every probe of a 1e7-row index misses them.
        # Set by a child process (pgserver keeps one server object per folder and process, so this
        # one starts the server afresh, with the setting).
        buffers_mb = max(128, int(max(sizes) * 200 * 1.3 / 2 ** 20)) if buffers else 128
        child = multiprocessing.get_context("fork").Process(target=_configure, args=(Path(tmp) / "db", buffers_mb))
        child.start()
        child.join()
        assert child.exitcode == 0, "could not configure the embedded server"
        server = EmbeddedServer(Path(tmp) / "db")
        print(f"shared_buffers {buffers_mb} MB", flush=True)
        try:
            for n in sizes:
                results.append(load_and_recall(server, n, planted))
                print(json.dumps({k: v for k, v in results[-1].items() if k not in ("dsn", "queries")}), flush=True)
            timing(results)
        finally:
            server.close()
    print("split per size (bench/dedup_scale.py: split): ms an image = descents + misses and matches")
    for result in results:
        part = result["split"]
        print(f"  {result['rows']:>11,} rows: {part['ms']:.2f} ms = {part['descent_ms']:.2f} descents "
              f"({part['probes']} probes, {part['levels']:.2f} pages each on the hot path) + "
              f"{part['misses_and_matches_ms']:.2f} misses and matches ({part['pages_per_image']} pages an image, "
              f"{part['key_matches_per_image']:.0f} key matches)")
    for result in results:
        result.pop("dsn"), result.pop("queries")
        print(json.dumps(result))
    if out:
        Path(out).write_text(json.dumps({"scale": results, "cpu": cpu}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="OUT", default=None)
    parser.add_argument("--hashes", type=int, nargs="*", default=[])
    parser.add_argument("--scale", type=_sizes, default=None, metavar="N[,N...]",
                        help="the dedup index alone at these table sizes (e.g. 1e5,1e6,1e7)")
    parser.add_argument("--pairs", type=int, default=300, help=argparse.SUPPRESS)
    parser.add_argument("--crops", type=int, default=None, metavar="N",
                        help="near-duplicate recall per kind of copy on N originals (crop windows included)")
    parser.add_argument("--default-buffers", action="store_true",
                        help="with --scale: keep pgserver's 128 MB shared_buffers (default: sized to the index)")
    parser.add_argument("--floor-shard", nargs=3, metavar=("CORPUS", "SHARD", "SHARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_shard:
        floor_shard(Path(args.floor_shard[0]), int(args.floor_shard[1]), int(args.floor_shard[2]))
        return
    # A timeout's SIGTERM must still stop the embedded server (the finally below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.scale:
        scale(args.scale, args.pairs, args.json, not args.default_buffers)
        return
    if args.crops:
        from dedup_crops import run as crops

        with tempfile.TemporaryDirectory() as tmp:
            result = crops(args.crops, Path(tmp) / "db")
        print(json.dumps(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return

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
                print(f"  floor run {run}: {floors[-1][0]:.1f} images/s per process, {floors[-1][1]:.1f} per CPU second")
                ours.append(pipeline(server, corpus, args.workers, args.batch, run))
                print(f"  pipeline run {run}: {ours[-1][0]:.1f} images/s per worker, {ours[-1][1]:.1f} per CPU second")
        finally:
            server.close()
    best = lambda runs, k: max(r[k] for r in runs)  # noqa: E731
    result = {"images_per_s_per_core": round(best(ours, 1), 2), "floor_images_per_s_per_core": round(best(floors, 1), 2),
              "workers": args.workers, "images": args.images, "ratio_to_floor": round(best(ours, 1) / best(floors, 1), 3),
              "wall_images_per_s_per_worker": round(best(ours, 0), 2),
              "floor_wall_images_per_s_per_process": round(best(floors, 0), 2),
              "load_average_1m_before": round(load[0], 2), "load_average_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    hash_scaling(args.hashes)


if __name__ == "__main__":
    main()
