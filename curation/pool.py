"""``krea2 curate run --workers N``: N local worker processes and a progress bar per job.

Each worker is an ordinary ``work`` process (``python -m curation work ...``), exactly what one
would start by hand on other machines; this process only watches the queues, replaces workers
that a signal killed, and waits for them. Processes, not threads: the Python work of one worker
uses one core, so ``--workers`` (default: every core) is how a machine is filled.
"""

from __future__ import annotations

import subprocess
import sys
import time

from .warehouse import Warehouse


def worker_command(location: list[str], jobs: list[str], batch_size: int | None, config: str | None,
                   log_claims: bool = False, allow_random_weights: bool = False) -> list[str]:
    command = [sys.executable, "-m", "curation", "work", *location, "--jobs", ",".join(jobs)]
    if batch_size:
        command += ["--batch", str(batch_size)]
    if config:
        command += ["--config", config]
    if log_claims:
        command.append("--claim-log")
    if allow_random_weights:
        command.append("--allow-random-weights")
    return command


def _settled(status: dict) -> int:
    """Rows each job finished or gave up on: what a worker killed by a poison row cannot stop."""
    return sum(c["done"] + c["failed"] for c in status["jobs"].values())


def run_workers(warehouse: Warehouse, command: list[str], workers: int, jobs: list[str], poll_s: float,
                progress: bool = True, max_attempts: int = 4) -> int:
    """Start ``workers`` copies of ``command``, show per-job progress until all exit; returns the
    number of workers that failed.

    A worker killed by a signal (a decoder's segfault, the OOM killer) is replaced, so a poison row
    that kills every worker claiming it is failed after ``max_attempts`` deaths while the rest of
    the corpus completes; after ``max_attempts + 1`` replacements in a row with nothing settled in
    between, the pool stops replacing (and the deaths count as failures)."""
    from tqdm import tqdm

    def start() -> subprocess.Popen:
        # A worker's stdout is its own count of the rows it handled ({} for one that found none): the
        # bars below show the whole pool's, so it would only add lines among them. Its stderr stays.
        return subprocess.Popen(command, stdout=subprocess.DEVNULL)

    processes = [start() for _ in range(workers)]
    killed = 0
    stalled, last_settled = 0, None
    bars = {job: tqdm(desc=f"{job:>8}", unit="img", disable=not progress, position=i, leave=True)
            for i, job in enumerate(jobs)}
    try:
        while True:
            status = warehouse.status()
            for index, process in enumerate(processes):
                code = process.poll()
                if code is None or code >= 0:
                    continue
                settled = _settled(status)
                stalled = 0 if settled != last_settled else stalled + 1
                last_settled = settled
                if stalled > max_attempts:
                    killed += 1
                    processes[index] = None
                    continue
                print(f"krea2 curate run: worker {process.pid} killed by signal {-code}; starting another",
                      file=sys.stderr)
                processes[index] = start()
            processes_alive = [p for p in processes if p is not None]
            running = any(p.poll() is None for p in processes_alive)
            for job, bar in bars.items():
                c = status["jobs"][job]
                bar.total = c["done"] + c["claimable"] + c["in_flight"]
                bar.n = c["done"]
                bar.set_postfix(claimable=c["claimable"], failed=c["failed"], refresh=False)
                bar.refresh()
            if not running and all(p.returncode >= 0 for p in processes_alive):
                break
            time.sleep(poll_s)
    finally:
        for bar in bars.values():
            bar.close()
        for process in processes:
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait()
    return killed + sum(p.returncode != 0 for p in processes if p is not None)
