"""One worker: claim -> work -> write, for any subset of the jobs, until its queues are drained.

The loop takes one batch of each served job in pipeline order (so a single worker also feeds its
own downstream jobs) and, when nothing is claimable, either waits (``follow``, or rows that could
still feed its queues are held by live workers or waiting out a back-off) or exits. A batch that
raises outside the per-row handling is recorded as a retryable error on every row it held.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from typing import Callable

from .config import CurationConfig
from .schema import JOBS
from .warehouse import Outcome, Warehouse

logger = logging.getLogger(__name__)


class RowJob:
    """A job that handles each row on its own (probe, filter)."""

    def __init__(self, name: str, fn: Callable[[dict, CurationConfig], Outcome], config: CurationConfig):
        self.name, self.fn, self.config = name, fn, config

    def ready(self, warehouse: Warehouse) -> bool:
        return True

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        warehouse.write(self.name, [self.fn(row, self.config) for row in rows])


def make_job(name: str, config: CurationConfig):
    """The runner of job ``name``; model-backed jobs import their libraries only here."""
    if name == "probe":
        from .screening import probe_row

        return RowJob(name, probe_row, config)
    if name == "filter":
        from .screening import filter_row

        return RowJob(name, filter_row, config)
    if name == "dedup":
        from .dedup import DedupJob

        return DedupJob(config.dedup)
    if name == "caption":
        from .captions import CaptionJob

        return CaptionJob(config.caption)
    if name == "embed":
        from .embeddings import EmbedJob

        return EmbedJob(config.embed)
    if name == "cluster":
        from .clusters import ClusterJob

        return ClusterJob(config.cluster)
    raise ValueError(f"unknown job {name!r}; jobs are {', '.join(JOBS)}")


def parse_jobs(text: str) -> list[str]:
    """``"probe,filter,dedup"`` -> jobs in pipeline order; unknown names are refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown or not names:
        raise ValueError(f"--jobs: unknown job(s) {unknown or text!r}; choose from {', '.join(JOBS)}")
    return [job for job in JOBS if job in names]


def work(warehouse: Warehouse, config: CurationConfig, jobs: list[str], batch_size: int | None = None,
         follow: bool = False, log_claims: bool = False) -> Counter:
    """Serve ``jobs`` until their queues are empty (or forever with ``follow``); returns rows per job."""
    batch_size = batch_size or config.queue.batch_size
    runners = {job: make_job(job, config) for job in jobs}
    handled: Counter = Counter()
    while True:
        progressed = False
        for job in jobs:
            runner = runners[job]
            if not runner.ready(warehouse):
                continue
            rows = warehouse.claim(job, batch_size, log_claims)
            if not rows:
                continue
            try:
                runner.run(warehouse, rows)
            except Exception as err:  # the batch's rows go back to the queue with the error
                logger.warning("%s batch of %d rows failed: %s", job, len(rows), err)
                if warehouse.conn.info.transaction_status != 0:  # recover from an aborted transaction
                    warehouse.conn.rollback()
                message = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
                warehouse.write(job, [Outcome(row["id"], error=message) for row in rows])
            handled[job] += len(rows)
            progressed = True
        if progressed:
            continue
        if follow or warehouse.waiting(jobs):
            time.sleep(config.queue.poll_s)
            continue
        return handled

