"""Asking a running training for a sample set or a checkpoint at its next step, without stopping it.

A request is an empty file in the run folder: ``<output_dir>/requests/sample`` (the validation
samples, and the report's measures, at the next step) or ``<output_dir>/requests/save`` (a
checkpoint at the next step). :func:`ask` writes one: the Train tab's "Sample now" and "Save now";
``mkdir -p RUN/requests && touch RUN/requests/save`` does the same from a terminal.

The trainer's main process calls :func:`take` after every step. Its cost when nothing was asked is
one failed rename (a path lookup, as a stat); it takes every request at once by renaming the
folder away, so a request is never seen twice and never lost: one written while the folder is
being taken lands in the taken folder, which is only removed once empty (seen now), or finds the
folder gone and :func:`ask` makes a new one (seen at the next step). The trainer sends the
decision to the other processes in the stop request's collective (:func:`between_steps`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "REQUESTS", "BetweenSteps", "ask", "between_steps", "clear", "take"]

logger = logging.getLogger("finetune")

REQUESTS = "requests"
KINDS = ("sample", "save")
ASK_ATTEMPTS = 100  # each attempt fails only if the trainer took the folder in between: a handful at most


def ask(run_dir: str | Path, kind: str) -> Path:
    """Ask the run in ``run_dir`` for ``kind`` (one of :data:`KINDS`) at its next step; returns the
    request file. Asking twice before the step asks once."""
    if kind not in KINDS:
        raise ValueError(f"a run request is one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    folder = Path(run_dir) / REQUESTS
    for _ in range(ASK_ATTEMPTS):
        folder.mkdir(exist_ok=True)
        try:
            (folder / kind).touch()  # one open(O_CREAT): the entry appears whole
            return folder / kind
        except FileNotFoundError:  # taken between the two calls: make the folder again
            continue
    raise OSError(f"could not write {folder / kind}: the folder kept disappearing")


def take(run_dir: str | Path) -> set[str]:
    """The requests waiting in ``run_dir`` (a subset of :data:`KINDS`), removed; empty when none."""
    folder = Path(run_dir) / REQUESTS
    taken = folder.with_name(f".{REQUESTS}-taken-{os.getpid()}")
    try:
        os.rename(folder, taken)
    except FileNotFoundError:
        return set()
    except OSError:  # left by a killed process of the same pid (its requests are stale): drop it, take again
        shutil.rmtree(taken, ignore_errors=True)
        os.rename(folder, taken)
    names: set[str] = set()
    while True:  # a request created in the folder while it moved: seen before the folder goes
        for entry in os.scandir(taken):
            names.add(entry.name)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        try:
            os.rmdir(taken)  # once removed, a late ask() finds no folder and makes a new one
            break
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    unknown = names - set(KINDS)
    if unknown:
        logger.warning("%s: ignored unknown request(s) %s (known: %s)", folder, sorted(unknown), ", ".join(KINDS))
    return names & set(KINDS)


def clear(run_dir: str | Path) -> None:
    """Drop the requests of a run that is not running (a new start must not act on stale ones)."""
    shutil.rmtree(Path(run_dir) / REQUESTS, ignore_errors=True)


@dataclass(frozen=True)
class BetweenSteps:
    """What every process does after a step, decided together."""

    stop: bool
    """A stop signal reached any process (:class:`~finetune.stop.StopRequest`)."""
    sample: bool
    """The main process found a ``sample`` request."""
    save: bool
    """The main process found a ``save`` request."""


def between_steps(runtime, stop_requested: bool, run_dir: str | Path, step: int) -> BetweenSteps:
    """After step ``step``: the stop flag (any process's) and the requests (the main process's: only
    it reads the folder) in one all-reduce, the stop check's own: no collective is added per step.
    ``runtime``: the :class:`~finetune.engine.runtime.Runtime`."""
    asked = take(run_dir) if runtime.is_main else set()
    if asked:
        logger.info("step %d: %s asked for (%s)", step, " and ".join(sorted(asked)), Path(run_dir) / REQUESTS)
    flags = runtime.means({"stop": float(stop_requested), **{kind: float(kind in asked) for kind in KINDS}})
    return BetweenSteps(**{name: value > 0 for name, value in flags.items()})
