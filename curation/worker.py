"""One worker: claim -> work -> write, for any subset of the jobs, until its queues are drained.

The loop takes one batch of each served job in pipeline order and runs it through the following
jobs it serves (probe -> filter -> dedup: each write claims the survivors for the next job in the
same transaction, and filter reuses probe's decoded thumbnails) and, when nothing is claimable, either waits (``follow``, or rows that could
still feed its queues are held by live workers or waiting out a back-off) or exits. A batch that
raises outside the per-row handling is recorded as a retryable error on every row it held.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections import Counter

from .config import CurationConfig
from .models import ModelUnavailable, check_model
from .schema import JOBS, UPSTREAM
from .screening import DecodedImages, filter_row, probe_row
from .warehouse import Outcome, Warehouse

logger = logging.getLogger(__name__)

CRASH_HOOK = "KREA2_CURATION_CRASH_ON"
"""Test hook (environment): a worker about to probe a URI ending with this value kills itself
with SIGKILL, as a decoder segfault or the OOM killer would (tests/test_curation_faults.py)."""
DELAY_HOOK = "KREA2_CURATION_PROBE_DELAY_S"
"""Test hook (environment): seconds a worker waits after probing a batch, before writing it, so
that a test can catch workers holding claims with a small corpus (tests/test_curation_faults.py)."""
HANDS_OFF = ("filter", "dedup")
"""Jobs that take a batch straight from their upstream job's write (probe -> filter -> dedup)."""


class ScreeningJob:
    """A per-row screening job sharing this worker's decoded thumbnails (probe fills, filter takes)."""

    def __init__(self, config: CurationConfig, decoded: DecodedImages):
        self.config, self.decoded = config, decoded

    def ready(self, warehouse: Warehouse) -> bool:
        return True


class ProbeJob(ScreeningJob):
    """Probe each row; thumbnails of rows handed to this worker's filter job are kept for it."""

    def run(self, warehouse: Warehouse, rows: list[dict], hand_off: str | None = None) -> list[dict]:
        outcomes = []
        self.decoded.clear()
        crash_on = os.environ.get(CRASH_HOOK)
        delay = float(os.environ.get(DELAY_HOOK) or 0)
        for row in rows:
            if crash_on and row["uri"].endswith(crash_on):
                os.kill(os.getpid(), signal.SIGKILL)
            outcome, small = probe_row(row, self.config)
            outcomes.append(outcome)
            if small is not None and hand_off == "filter":
                self.decoded.keep(row["id"], small)
        if delay > 0:
            time.sleep(delay)
        handed = warehouse.write("probe", outcomes, hand_off=hand_off)
        if hand_off != "filter":
            self.decoded.clear()
        return handed


class FilterJob(ScreeningJob):
    """Filter each row, from probe's thumbnail when this worker probed it."""

    def run(self, warehouse: Warehouse, rows: list[dict], hand_off: str | None = None) -> list[dict]:
        outcomes = [filter_row(row, self.config, self.decoded) for row in rows]
        self.decoded.clear()
        return warehouse.write("filter", outcomes, hand_off=hand_off)


def make_job(name: str, config: CurationConfig, decoded: DecodedImages | None = None,
             allow_random_weights: bool = False):
    """The runner of job ``name``; model-backed jobs import their libraries only here. ``decoded``
    is shared by probe and filter so a row is decoded once per worker."""
    decoded = decoded if decoded is not None else DecodedImages()
    check_model(name, config, allow_random_weights)
    if name == "probe":
        return ProbeJob(config, decoded)
    if name == "filter":
        return FilterJob(config, decoded)
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
         follow: bool = False, log_claims: bool = False, allow_random_weights: bool = False) -> Counter:
    """Serve ``jobs`` until their queues are empty (or forever with ``follow``); returns rows per job.

    A claimed batch runs through every following job this worker serves (probe -> filter -> dedup):
    each write claims the surviving rows for the next job in the same transaction."""
    batch_size = batch_size or config.queue.batch_size
    warehouse.log_claims = log_claims
    decoded = DecodedImages()
    runners = {job: make_job(job, config, decoded, allow_random_weights) for job in jobs}
    handled: Counter = Counter()
    while True:
        progressed = False
        for first in jobs:
            if not runners[first].ready(warehouse):
                continue
            job, rows = first, warehouse.claim(first, batch_size)
            while rows:
                following = next((j for j in jobs if UPSTREAM[j] == job and j in HANDS_OFF), None)
                try:
                    runner = runners[job]
                    handed = (runner.run(warehouse, rows, following) if following
                              else runner.run(warehouse, rows)) or []
                except ModelUnavailable:
                    raise
                except Exception as err:  # the batch's rows go back to the queue with the error
                    logger.warning("%s batch of %d rows failed: %s", job, len(rows), err)
                    if warehouse.conn.info.transaction_status != 0:  # recover from an aborted transaction
                        warehouse.conn.rollback()
                    message = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
                    warehouse.write(job, [Outcome(row["id"], error=message) for row in rows])
                    handed = []
                handled[job] += len(rows)
                progressed = True
                job, rows = following, handed
        if progressed:
            continue
        if follow or warehouse.waiting(jobs):
            time.sleep(config.queue.poll_s)
            continue
        return handled
