"""The proving ground's independent stages on several processes (issue 39's <= 50 minutes on 2 cores).

Once the base model exists, its CFG sweep, the three concept LoRAs, the edit LoRA, DPO, GRPO, DRaFT
and the TDM student depend on nothing but the base, the judge, the reward and their own seeds. Each
is a :class:`Task`: a module-level function called with a copy of the run's :class:`~proving.stages.Stages`
whose ``rows`` starts empty; it returns its value and the rows it sampled. With one worker every task
runs in this process, in order; with more, a spawned pool runs them, longest first (the order of the
list), and hands each result back as it finishes. Every task draws its randomness from its own seeds
(training seeds, sampling blocks), never from a process's global state, so the rows are the same
either way (checked by hand on the quick run: identical JSON with 1 and 2 workers, timings aside; CI's
quick run uses 1, as its other pytest worker holds the second core; tests/test_proving_parallel.py runs the pool).

A worker is a fresh interpreter (``spawn``: a fork would copy torch's thread pools and any lock held at
the fork): :func:`prepare_worker` gives it the thread rule and the in-process flag of the parent, and
ends it when the run's process ends (a killed run leaves nothing running).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Task:
    """``fn(stages, **kwargs)`` under the name ``name`` (its phase in the run's clock)."""

    name: str
    fn: Callable
    kwargs: dict = field(default_factory=dict)


@dataclass
class Done:
    value: object
    rows: dict
    seconds: float


def call(task: Task, stages) -> Done:
    """Run one task on a copy of ``stages`` with no rows; returns its value, rows and seconds."""
    start = time.perf_counter()
    own = dataclasses.replace(stages, rows={})
    value = task.fn(own, **task.kwargs)
    return Done(value, own.rows, time.perf_counter() - start)


def prepare_worker(width: int | None, in_process: bool) -> None:
    """A worker's setup: it ends with the run's process (:mod:`proving.lifetime`), the thread rule for a
    ``width``-wide model (None: leave torch's) and :data:`proving.pretraining.IN_PROCESS`."""
    from . import pretraining
    from .lifetime import die_with_parent

    die_with_parent()
    pretraining.IN_PROCESS = in_process
    if width is not None:
        from krea2_diffusers.cpu_threads import choose_cpu_threads

        choose_cpu_threads(width=width)


def run_tasks(tasks: list[Task], stages, workers: int, on_done: Callable[[str, Done], None],
              width: int | None = None, in_process: bool = False) -> dict[str, Done]:
    """Every task, on ``workers`` processes (1: here, in order). ``on_done(name, done)`` runs in this
    process as each finishes (the rows are merged into ``stages.rows`` before it). Returns {name: Done}.
    A task that raises stops the run with its error once the running ones end."""
    results: dict[str, Done] = {}

    def finish(name: str, done: Done) -> None:
        stages.rows.update(done.rows)
        results[name] = done
        on_done(name, done)

    if workers <= 1:
        for task in tasks:
            finish(task.name, call(task, stages))
        return results
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=prepare_worker, initargs=(width, in_process))
    with pool:
        pending = {pool.submit(call, task, stages): task.name for task in tasks}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                name = pending.pop(future)
                try:
                    done = future.result()
                except BaseException:
                    for other in pending:
                        other.cancel()
                    raise
                finish(name, done)
    return results
