"""The queue's marks on disk: a run waiting for its turn holds ``RUN/queued.json``.

A start while another run trains creates the run folder at once and queues it; the runs start in
the order they were queued, each once the run before it ends (done, stopped or failed). The queue
itself lives in the app that queued the runs (:class:`train_tab.runs.Runs` starts them, from a
thread of its own); the file is what everyone else sees: the runs list shows the run ``queued``,
``/train_status`` its place, and another app on the same runs folder waits behind it.

``queued.json`` is ``{"pid", "started", "queued"}``: the app's process (pid and start time, as
``lock.json`` names a trainer) and when the run was queued. A file whose app has exited is stale:
that run is no longer queued (it never started; Resume starts it).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from krea2_diffusers.files import atomic_write
from krea2_diffusers.processes import process_start_time

QUEUED_NAME = "queued.json"


@dataclass(frozen=True)
class Ticket:
    """A run's place in the queue."""

    pid: int
    """The app holding the queue."""
    started: float
    """That app's process start time (a reused pid is another process)."""
    queued: float
    """When the run was queued (seconds since the epoch): the queue's order."""

    @property
    def mine(self) -> bool:
        """Queued by this process (which is alive, so the pid is enough)."""
        return self.pid == os.getpid()

    def live(self) -> bool:
        return process_start_time(self.pid) == self.started


def enqueue(folder: Path) -> Ticket:
    """Queue the run in ``folder`` for this process; written whole (atomically)."""
    ticket = Ticket(os.getpid(), process_start_time(os.getpid()), time.time())
    with atomic_write(folder / QUEUED_NAME, "w") as handle:
        handle.write(json.dumps(asdict(ticket)))
    return ticket


def ticket_of(folder: Path) -> Ticket | None:
    """The run's live ticket; None when it is not queued (no file, an unreadable or a stale one)."""
    try:
        raw = json.loads((folder / QUEUED_NAME).read_text())
        ticket = Ticket(int(raw["pid"]), float(raw["started"]), float(raw["queued"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ticket if ticket.live() else None


def leave(folder: Path) -> None:
    """The run leaves the queue (it starts, or it is stopped)."""
    (folder / QUEUED_NAME).unlink(missing_ok=True)


def waiting(folders: list[Path]) -> list[tuple[Path, Ticket]]:
    """The queued runs among ``folders`` with their tickets, first in line first."""
    found = [(folder, ticket) for folder in folders if (ticket := ticket_of(folder)) is not None]
    return sorted(found, key=lambda pair: (pair[1].queued, pair[0].name))
