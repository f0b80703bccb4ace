"""``krea2 curate init|ingest|work|run|status|export|dedup-shards``: the curation warehouse from the command line.

Every subcommand takes ``--db DIR`` (an embedded Postgres in DIR, started when none runs there)
or ``--dsn postgresql://...`` (any server). Heavy imports stay inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _location(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--db", metavar="DIR", help="warehouse folder (embedded Postgres, started when none runs there)")
    where.add_argument("--dsn", metavar="URL", help="postgresql://user@host:port/database of a running server")
    parser.add_argument("--store", metavar="DIR", help="folder for files jobs write (embeddings); default: --db DIR")
    parser.add_argument("--config", metavar="YAML", help="curation config (thresholds, queue policy, models)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("curate", help="data curation: Postgres warehouse, job queue, filters, dedup -> packs",
                                   description="Curate an image corpus in a Postgres warehouse whose table is also the "
                                               "job queue of any number of workers; export kept images as packs.")
    sub = parser.add_subparsers(dest="curate_command", required=True)
    init = sub.add_parser("init", help="create (or migrate) the warehouse")
    _location(init)
    ingest = sub.add_parser("ingest", help="add images (folders, JSONL, Parquet); known files are skipped")
    ingest.add_argument("sources", nargs="+", metavar="PATH")
    _location(ingest)
    for name, text in (("work", "one worker: serve the queues until they are drained"),
                       ("run", "start --workers local workers and wait until every queue is drained")):
        command = sub.add_parser(name, help=text)
        _location(command)
        command.add_argument("--jobs", default="probe,filter,dedup", help="comma-separated jobs (default probe,filter,dedup)")
        command.add_argument("--batch", type=int, default=None, help="rows per claim (default: queue.batch_size)")
        command.add_argument("--claim-log", action="store_true", help="record every claim and release in claim_log")
        command.add_argument("--allow-random-weights", action="store_true",
                             help="let caption/embed run with model tiny-random (RANDOM weights, for tests)")
        if name == "work":
            command.add_argument("--follow", action="store_true", help="keep waiting for new rows instead of exiting")
        else:
            command.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                                 help="local worker processes (default: one per core)")
            command.add_argument("--no-progress", action="store_true", help="no progress bars")
    status = sub.add_parser("status", help="per-job done / claimable / failed / rows/s")
    _location(status)
    form = status.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object")
    form.add_argument("--prometheus", action="store_true", help="Prometheus text format (claimable = autoscaling signal)")
    export = sub.add_parser("export", help="kept images -> krea2-pack-v1 Parquet for `krea2 pretrain`")
    export.add_argument("out", metavar="OUT")
    _location(export)
    export.add_argument("--resolution", type=int, required=True)
    export.add_argument("--batch-size", type=int, required=True)
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--balance", choices=["clusters"], default=None, help="cluster-balanced sampling")
    export.add_argument("--per-cluster", type=int, default=None, help="cap per leaf cluster (default: median leaf size)")
    shards = sub.add_parser("dedup-shards", help="merge near-duplicate groups across warehouses (resumable)")
    shards.add_argument("--dsn", metavar="URL", action="append", required=True,
                        help="a shard's postgresql://... (give two or more)")
    shards.add_argument("--config", metavar="YAML", help="curation config (the dedup thresholds)")
    shards.add_argument("--batch", type=int, default=256,
                        help="representatives compared per committed step (what a killed run redoes; default 256)")
    return parser


def _print_status(status: dict) -> None:
    dropped = ", ".join(f"{k}={v}" for k, v in status["dropped"].items()) or "none"
    print(f"images {status['images']}: kept {status['kept']}, pending {status['pending']}, failed {status['failed']}; "
          f"dropped: {dropped}")
    print(f"{'job':>8} {'done':>9} {'claimable':>9} {'in_flight':>9} {'failed':>7} {'rows/s':>8}")
    for job, c in status["jobs"].items():
        print(f"{job:>8} {c['done']:>9} {c['claimable']:>9} {c['in_flight']:>9} {c['failed']:>7} {c['rows_per_s']:>8}")


def _dispatch(args: argparse.Namespace) -> int:
    from .config import load_config
    from .warehouse import open_warehouse

    config = load_config(args.config)
    command = args.curate_command
    if command == "dedup-shards":
        from .shards import dedup_shards

        print(json.dumps({"dropped": dedup_shards(args.dsn, config, args.batch)}))
        return 0
    with open_warehouse(args.db, args.dsn, args.store, config.queue, create=command == "init") as warehouse:
        if command == "init":
            print(f"{warehouse.where}: curation schema ready")
        elif command == "ingest":
            from .sources import ingest_records

            # One call for all sources: a path named twice, in one source or two, counts as repeated.
            records = (record for source in args.sources for record in ingest_records(source))
            print(json.dumps(warehouse.ingest(records)))
        elif command == "work":
            from .worker import parse_jobs, work

            handled = work(warehouse, config, parse_jobs(args.jobs), args.batch, args.follow, args.claim_log,
                           args.allow_random_weights)
            print(json.dumps(dict(handled)))
        elif command == "run":
            from .models import check_model
            from .pool import run_workers, worker_command
            from .worker import parse_jobs

            jobs = parse_jobs(args.jobs)
            location = ["--db", args.db] if args.db else ["--dsn", args.dsn]
            if args.store:
                location += ["--store", args.store]
            if args.workers < 1:
                raise ValueError(f"--workers must be at least 1, got {args.workers}")
            for job in jobs:  # refuse random weights here, not once per worker
                check_model(job, config, args.allow_random_weights)
            command_line = worker_command(location, jobs, args.batch, args.config, args.claim_log,
                                          args.allow_random_weights)
            failed = run_workers(warehouse, command_line,
                                 args.workers, jobs, config.queue.poll_s, not args.no_progress,
                                 config.queue.max_attempts)
            if failed:
                print(f"krea2 curate run: {failed} worker(s) exited with an error", file=sys.stderr)
                return 1
            _print_status(warehouse.status())  # what the pool left, as `krea2 curate status` prints it
        elif command == "status":
            status = warehouse.status()
            if args.json:
                print(json.dumps(status))
            elif args.prometheus:
                from .metrics import prometheus_text

                sys.stdout.write(prometheus_text(status))
            else:
                _print_status(status)
        elif command == "export":
            from .export import export_pack

            stats = export_pack(warehouse, args.out, args.resolution, args.batch_size, args.seed, args.balance,
                                args.per_cluster)
            print(json.dumps(stats.summary()))
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds: the embedded server handle is released on the way out


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from .server import WarehouseError

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _dispatch(args)
    except WarehouseError as err:  # also a job's model that is unavailable
        print(f"krea2 curate: error: {err}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    """``python -m curation ...`` (what ``run`` starts for each worker: no library import cost)."""
    parser = argparse.ArgumentParser(prog="python -m curation")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["curate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"krea2 curate: error: {err}", file=sys.stderr)
        return 2
