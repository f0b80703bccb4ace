"""``krea2 curate run --workers N``: N local worker processes and a progress bar per job.

Each worker is an ordinary ``work`` process (``python -m curation work ...``), exactly what one
would start by hand on other machines; this process only watches the queues and waits for them.
"""

from __future__ import annotations

import subprocess
import sys
import time

from .warehouse import Warehouse


def worker_command(location: list[str], jobs: list[str], batch_size: int | None, config: str | None,
                   log_claims: bool = False) -> list[str]:
    command = [sys.executable, "-m", "curation", "work", *location, "--jobs", ",".join(jobs)]
    if batch_size:
        command += ["--batch", str(batch_size)]
    if config:
        command += ["--config", config]
    if log_claims:
        command.append("--claim-log")
    return command


def run_workers(warehouse: Warehouse, command: list[str], workers: int, jobs: list[str], poll_s: float,
                progress: bool = True) -> int:
    """Start ``workers`` copies of ``command``, show per-job progress until all exit; returns the
    number of workers that failed."""
    from tqdm import tqdm

    processes = [subprocess.Popen(command) for _ in range(workers)]
    bars = {job: tqdm(desc=f"{job:>8}", unit="img", disable=not progress, position=i, leave=True)
            for i, job in enumerate(jobs)}
    try:
        while True:
            running = any(p.poll() is None for p in processes)
            counts = warehouse.status()["jobs"]
            for job, bar in bars.items():
                c = counts[job]
                bar.total = c["done"] + c["claimable"] + c["in_flight"]
                bar.n = c["done"]
                bar.set_postfix(claimable=c["claimable"], failed=c["failed"], refresh=False)
                bar.refresh()
            if not running:
                break
            time.sleep(poll_s)
    finally:
        for bar in bars.values():
            bar.close()
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait()
    return sum(p.returncode != 0 for p in processes)
