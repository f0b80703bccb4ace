"""The runs folder: one folder per run, each with ``train.yaml`` (repeatable from the command line:
``krea2 train RUN/train.yaml --resume``), ``dataset.jsonl`` (the images and their captions),
``train.log`` (the subprocess's output), ``lock.json`` (the process training it: pid and start
time) and what ``krea2 train`` writes there itself (``metrics.jsonl``, ``samples/``,
``checkpoints/``, the exported ``lora_*.safetensors``).

Training runs as ``krea2 train`` in a subprocess (its own session: it outlives an app crash), one
at a time per runs folder, whichever app started it: a start checks, creates and launches holding
the folder's ``.runs.lock`` (a file lock, so a second app on the same folder waits its turn), and a
run whose ``lock.json`` names a live process (same pid, same start time) is running, for this app
or one started later (a trainer's exit is recorded, and its lock removed, under that file lock and
only while the lock is still its own: a start that came in between keeps its lock). Stop sends
SIGTERM: ``krea2 train`` starts with SIGTERM blocked and unblocks it once its handler listens
(:mod:`finetune.stop`), so a stop in its first seconds is held, never fatal; it saves a checkpoint
and exits with 130 (before its first step: no checkpoint; after its last step: it finishes its
export and exits with 0). Status is read back from those files, so runs of an earlier session are
listed too.

A start while a run trains is queued (:mod:`train_tab.queue`: ``queued.json`` in its folder): this
app starts its queued runs in order, from a thread of its own, each once nothing trains in the root
(a run queued by another live app, queued earlier, goes first). Stopping a queued run takes it out
of the queue. "Sample now" and "Save now" ask the running trainer through ``RUN/requests/``
(:mod:`finetune.run_requests`); its checkpoint report (``report.json``) comes with its status.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import yaml

from finetune.data.captions import with_prefix
from finetune.report.writer import JSON_NAME as REPORT_NAME
from finetune.run_requests import ask as ask_run
from finetune.run_requests import clear as clear_requests
from finetune.stop import STOPPED_CODE  # krea2 train: stopped by a signal (a checkpoint if a step ran)
from krea2_diffusers.files import atomic_write
from krea2_diffusers.processes import process_start_time

from .errors import TrainInputError
from .queue import QUEUED_NAME, enqueue, leave, ticket_of, waiting

CONFIG_NAME = "train.yaml"
MANIFEST_NAME = "dataset.jsonl"
REGULARIZATION_NAME = "regularization.jsonl"  # the regularisation images and their captions, when given
LOG_NAME = "train.log"
EXIT_NAME = "exit.json"
LOCK_NAME = "lock.json"  # {"pid", "started"}: the process training the run
ROOT_LOCK_NAME = ".runs.lock"  # flock'ed while a start checks, creates and launches
STATES = ("queued", "running", "stopped", "done", "failed")
# A run id: one folder name, as run_id_for makes them (no separator, no dot: never outside the root).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
CLOSE_REPORT_EVERY_S = 30  # close(): how often it says it is still waiting for a checkpoint
QUEUE_POLL_S = 0.5  # how often the queue looks for the end of the run before
NOT_STARTED_CODE = -1  # exit.json of a queued run that could not start (its state: failed)
TRAIN_COMMAND = (sys.executable, "-m", "krea2_diffusers.cli", "train")

logger = logging.getLogger(__name__)


def run_id_for(trigger_word: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", trigger_word or "").strip("-")[:32] or "lora"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"


class Runs:
    """The runs under ``root``, and the ``krea2 train`` processes this app started.

    ``train_command``: the command a run's config path and ``--resume`` are appended to (default
    ``python -m krea2_diffusers.cli train``)."""

    def __init__(self, root: str | Path, train_command: tuple[str, ...] = TRAIN_COMMAND):
        self.root = Path(root).expanduser().resolve()
        self.train_command = tuple(train_command)
        self._processes: dict[str, subprocess.Popen] = {}
        self._stopping: set[str] = set()
        self._lock = threading.RLock()  # this app's threads; the root's file lock is for other apps
        self._queued_env: dict[str, dict | None] = {}  # the extra environment of each run this app queued
        self._queue_thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the folder
    def path(self, run_id: str) -> Path:
        """Where run ``run_id`` lives (or would): refused unless the id is one folder name of
        letters, digits, '-' and '_' (the message repeats nothing of a refused id)."""
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise TrainInputError("Not a run id: a run id is one folder name of letters, digits, '-' and '_' "
                                  "(pick one from the list of runs).")
        return self.root / run_id

    def folder(self, run_id: str) -> Path:
        folder = self.path(run_id)
        if not (folder / CONFIG_NAME).is_file():
            raise TrainInputError(f"No run {run_id!r} in {self.root}.")
        return folder

    def ids(self) -> list[str]:
        """The runs' ids, newest first."""
        if not self.root.is_dir():
            return []
        return sorted((p.name for p in self.root.iterdir() if RUN_ID.fullmatch(p.name) and (p / CONFIG_NAME).is_file()),
                      reverse=True)

    def list(self) -> list[tuple[str, str]]:
        """(run id, state), newest first."""
        return [(run_id, self.state(run_id)) for run_id in self.ids()]

    def create(self, raw_config_for, rows: list[list[str]], trigger_word: str, copy: bool = False,
               regularization: list[list[str]] | None = None, references: list[list[str]] | None = None,
               queued: bool = False) -> str:
        """A new run folder with its manifest and config; ``raw_config_for(run_dir, manifest)`` is
        the config mapping. Captions get the trigger word in front (unless they hold it already).
        ``copy``: the images are copied into ``images/`` (uploads: Gradio's temporary files go away).
        ``regularization``: rows of regularisation images, written (captions as they are) to
        ``regularization.jsonl``. ``references``: per row its reference images (a pairs run), written
        into the manifest's ``references`` field. ``queued``: the run is queued for this app, before
        its config is written (the runs list never shows it in another state first)."""
        self.root.mkdir(parents=True, exist_ok=True)
        run_id = run_id_for(trigger_word)
        while True:
            try:
                (self.root / run_id).mkdir()  # atomic: two creates in the same second get two folders
                break
            except FileExistsError:
                run_id += "-1"
        folder = self.root / run_id
        manifest = folder / MANIFEST_NAME
        if copy:
            (folder / "images").mkdir()
            rows = [[str(shutil.copy2(path, folder / "images" / f"{i:04d}-{Path(path).name}")), caption]
                    for i, (path, caption) in enumerate(rows)]
        with atomic_write(manifest, "w") as handle:
            for number, (path, caption) in enumerate(rows):
                row = {"path": str(Path(path).resolve()), "caption": with_prefix(caption, trigger_word)}
                if references:
                    row["references"] = [str(Path(r).resolve()) for r in references[number]]
                handle.write(json.dumps(row) + "\n")
        if regularization:
            with atomic_write(folder / REGULARIZATION_NAME, "w") as handle:
                for path, caption in regularization:
                    handle.write(json.dumps({"path": str(Path(path).resolve()), "caption": caption}) + "\n")
        if queued:
            enqueue(folder)
        with atomic_write(folder / CONFIG_NAME, "w") as handle:
            yaml.safe_dump(raw_config_for(folder, manifest), handle, sort_keys=False)
        return run_id

    # ---------------------------------------------------------------- the process
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One start at a time: this app's threads (the RLock) and other apps on this root (the file lock,
        released when the file closes or its process dies)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.root / ROOT_LOCK_NAME, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    @staticmethod
    def _lock_of(folder: Path) -> tuple[int, float] | None:
        """``(pid, start time)`` that ``lock.json`` names, or None (no lock, or an unreadable one)."""
        try:
            lock = json.loads((folder / LOCK_NAME).read_text())
            return int(lock["pid"]), float(lock["started"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _holder(self, folder: Path) -> int | None:
        """The pid ``lock.json`` names when that process still runs (same start time), else None (stale)."""
        lock = self._lock_of(folder)
        return lock[0] if lock is not None and process_start_time(lock[0]) == lock[1] else None

    def _own(self, run_id: str) -> subprocess.Popen | None:
        with self._lock:
            return self._processes.get(run_id)

    def running(self) -> str | None:
        """The run being trained in this root (by this app or another), if any."""
        with self._lock:
            own = next((r for r, p in self._processes.items() if p.poll() is None), None)
        if own is not None:
            return own
        return next((r for r in self.ids() if self._holder(self.root / r) is not None), None)

    def start(self, run_id: str, resume: bool = False, env: dict | None = None) -> None:
        """``krea2 train`` (``--resume``) on the run's config; ``env``: extra environment variables."""
        with self._exclusive():
            self._launch(run_id, resume, env)

    def create_and_start(self, raw_config_for, rows: list[list[str]], trigger_word: str, copy: bool = False,
                         env: dict | None = None, regularization: list[list[str]] | None = None,
                         references: list[list[str]] | None = None) -> str:
        """:meth:`create` then :meth:`start`, as one step; while a run trains (or others wait), the new
        run is queued instead: it starts after them."""
        with self._exclusive():
            busy = self.running() is not None or bool(self.waiting())
            run_id = self.create(raw_config_for, rows, trigger_word, copy, regularization, references, queued=busy)
            if busy:
                self._queued_env[run_id] = env
                self._serve_queue()
            else:
                self._launch(run_id, False, env)
        return run_id

    # ---------------------------------------------------------------- the queue
    def waiting(self) -> list[str]:
        """The queued runs of the root (this app's and other live apps'), first in line first."""
        return [folder.name for folder, _ in waiting([self.root / run_id for run_id in self.ids()])]

    def queue_position(self, run_id: str) -> int | None:
        """1 for the next run to start, 2 after it ...; None when ``run_id`` is not queued."""
        queue = self.waiting()
        return queue.index(run_id) + 1 if run_id in queue else None

    def dequeue(self, run_id: str) -> bool:
        """Take a queued run out of the queue (it ends "stopped", never started: Resume starts it);
        False when it is not queued."""
        folder = self.folder(run_id)
        with self._exclusive():
            if ticket_of(folder) is None:
                return False
            self._queued_env.pop(run_id, None)
            with atomic_write(folder / EXIT_NAME, "w") as handle:
                handle.write(json.dumps({"returncode": STOPPED_CODE}))
            leave(folder)
        return True

    def _serve_queue(self) -> None:
        """The thread that starts this app's queued runs (one at a time, while it has any)."""
        with self._lock:
            if self._queue_thread is None or not self._queue_thread.is_alive():
                self._queue_thread = threading.Thread(target=self._queue_turns, name="train-queue", daemon=True)
                self._queue_thread.start()

    def _queue_turns(self) -> None:
        """Until this app has no run queued: once nothing trains in the root, the first run in line
        starts when it is this app's (another app's first one is that app's to start)."""
        while True:
            time.sleep(QUEUE_POLL_S)
            with self._exclusive():
                queue = waiting([self.root / run_id for run_id in self.ids()])
                if not any(ticket.mine for _, ticket in queue):
                    self._queue_thread = None
                    return
                folder, ticket = queue[0]
                if not ticket.mine or self.running() is not None:
                    continue
                try:
                    self._launch(folder.name, False, self._queued_env.pop(folder.name, None))
                except Exception as err:  # it cannot start (its folder changed, ...): it fails, the others go on
                    logger.exception("queued run %s could not start", folder.name)
                    with open(folder / LOG_NAME, "a") as log:
                        log.write(f"not started from the queue: {err}\n")
                    with atomic_write(folder / EXIT_NAME, "w") as handle:
                        handle.write(json.dumps({"returncode": NOT_STARTED_CODE}))
                    leave(folder)

    def _refuse_if_busy(self) -> None:
        busy = self.running()
        if busy is not None:
            raise TrainInputError(f"Run {busy} is still running: stop it before starting or resuming another.")

    def _launch(self, run_id: str, resume: bool, env: dict | None) -> None:
        """Under :meth:`_exclusive`: check, launch, write the run's lock."""
        folder = self.folder(run_id)
        self._refuse_if_busy()
        if resume and self.state(run_id) == "done":
            raise TrainInputError(f"Run {run_id} has finished; there is nothing to resume.")
        (folder / EXIT_NAME).unlink(missing_ok=True)
        clear_requests(folder)  # "Sample now" / "Save now" asked of an earlier start of it
        # Stale (a live one was refused above): any lock.json found later that is not this process's
        # is then a newer start's, which its exit handling leaves alone (_record_exit).
        (folder / LOCK_NAME).unlink(missing_ok=True)
        command = [*self.train_command, str(folder / CONFIG_NAME)] + (["--resume"] if resume else [])
        with open(folder / LOG_NAME, "a") as log:
            log.write(f"$ krea2 train {folder / CONFIG_NAME}{' --resume' if resume else ''}\n")
            log.flush()
            # The child inherits this thread's signal mask: SIGTERM stays blocked (held, not lost)
            # until krea2 train's handler listens, so a Stop at once never kills it mid-import.
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                process = subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env={**os.environ, **(env or {})})
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        started = process_start_time(process.pid)
        if started is not None:  # None: it has already exited (its exit is recorded below)
            with atomic_write(folder / LOCK_NAME, "w") as handle:
                handle.write(json.dumps({"pid": process.pid, "started": started}))
        self._processes[run_id] = process
        self._stopping.discard(run_id)
        leave(folder)  # a queued run leaves the queue only now: it is seen queued, then running, nothing between
        threading.Thread(target=self._record_exit, args=(folder, process, started), daemon=True).start()

    def _record_exit(self, folder: Path, process: subprocess.Popen, started: float | None) -> None:
        """Once ``process`` (launched at ``started``) exits: its exit record, and its lock removed,
        both only while ``lock.json`` is still its own (or there is none). Once it is reaped its lock
        is stale, so another app may start the run again before this thread runs: that start's lock
        and cleared exit record are left alone. Compare-and-unlink without a window: every lock.json
        is written under the root's file lock (:meth:`_launch`), which this holds too."""
        code = process.wait()
        with self._exclusive():
            lock = self._lock_of(folder)
            if lock is not None and lock != (process.pid, started):
                return
            with atomic_write(folder / EXIT_NAME, "w") as handle:
                handle.write(json.dumps({"returncode": code}))
            (folder / LOCK_NAME).unlink(missing_ok=True)

    def stop(self, run_id: str) -> bool:
        """SIGTERM to the run's process (once); False if it is not running. A run past its last
        step is finishing its export: it is left to it (a signal would change nothing)."""
        folder = self.folder(run_id)
        with self._lock:
            process = self._own(run_id)
            if process is not None:
                if process.poll() is not None:
                    return False
                if run_id not in self._stopping and not self._past_last_step(run_id):
                    self._stopping.add(run_id)
                    process.send_signal(signal.SIGTERM)
                return True
        pid = self._holder(folder)  # started by another app, or by this one before a restart
        if pid is None:
            return False
        if not self._past_last_step(run_id):
            os.kill(pid, signal.SIGTERM)
        return True

    def ask(self, run_id: str, kind: str) -> None:
        """"Sample now" (``kind`` "sample") or "Save now" ("save"): the running trainer samples the
        validation prompts, or saves a checkpoint, after its current step and goes on
        (:mod:`finetune.run_requests`); refused unless the run is running and before its last step."""
        state = self.state(run_id)
        if state != "running":
            raise TrainInputError(f"Run {run_id} is {state}: samples and checkpoints on demand are for a running run.")
        if self._past_last_step(run_id):
            raise TrainInputError(f"Run {run_id} has run its last step: its final checkpoint and samples are being written.")
        ask_run(self.folder(run_id), kind)

    def _past_last_step(self, run_id: str) -> bool:
        rows = self.metrics(run_id)
        return bool(rows) and rows[-1].get("step", 0) >= int(self.config(run_id)["training"]["max_steps"])

    def close(self) -> None:
        """Stop every run this app started and wait for each to exit. A stopping trainer writes its
        checkpoint first (a full-size step takes minutes): it is waited for, never killed. This app's
        queued runs leave the queue first (none starts while it closes; Resume starts them later)."""
        for folder, ticket in waiting([self.root / run_id for run_id in self.ids()]):
            if ticket.mine:
                self.dequeue(folder.name)
        with self._lock:
            going = {r: p for r, p in self._processes.items() if p.poll() is None}
        for run_id in going:
            self.stop(run_id)
        for run_id, process in going.items():
            waited = 0
            while True:
                try:
                    process.wait(timeout=CLOSE_REPORT_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    waited += CLOSE_REPORT_EVERY_S
                    logger.warning("waiting for run %s to save its checkpoint and exit (%d s so far)", run_id, waited)

    # ---------------------------------------------------------------- reading a run back
    def state(self, run_id: str) -> str:
        folder = self.folder(run_id)
        process = self._own(run_id)
        if process is not None and process.poll() is None:
            return "running"
        if self._holder(folder) is not None:  # started by another app (also after this app's own trainer of it exited)
            return "running"
        if ticket_of(folder) is not None:
            return "queued"
        exit_file = folder / EXIT_NAME
        if exit_file.is_file():
            code = json.loads(exit_file.read_text())["returncode"]
            return "done" if code == 0 else "stopped" if code == STOPPED_CODE else "failed"
        if process is not None:  # exited a moment ago; its exit record is being written
            code = process.returncode
            return "done" if code == 0 else "stopped" if code == STOPPED_CODE else "failed"
        if any(folder.glob("lora_*.safetensors")):
            return "done"
        # A stale queue mark: its app exited before its turn (a stop, not a failure)
        return "stopped" if (folder / "checkpoints").is_dir() or (folder / QUEUED_NAME).is_file() else "failed"

    def config(self, run_id: str) -> dict:
        return yaml.safe_load((self.folder(run_id) / CONFIG_NAME).read_text())

    def metrics(self, run_id: str) -> list[dict]:
        """``metrics.jsonl``'s rows (what the trainer logs; a line being written is skipped)."""
        path = self.folder(run_id) / "metrics.jsonl"
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def samples(self, run_id: str) -> list[Path]:
        """The newest validation images (``samples/step-N/*.png``)."""
        steps = sorted((self.folder(run_id) / "samples").glob("step-*"))
        return sorted(steps[-1].glob("*.png")) if steps else []

    def exports(self, run_id: str) -> list[Path]:
        return sorted(self.folder(run_id).glob("lora_*.safetensors"))

    def log_tail(self, run_id: str, lines: int = 5) -> str:
        path = self.folder(run_id) / LOG_NAME
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def report(self, run_id: str) -> dict | None:
        """The run's checkpoint report (``report.json``, :mod:`finetune.report`), None before its first validation."""
        path = self.folder(run_id) / REPORT_NAME
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # none yet (written whole: never half a file)
            return None

    def status(self, run_id: str) -> dict:
        """``{"state", "step", "total", "loss", "samples", "exports", "queue_position", "report"}``
        (the ``/train_status`` answer)."""
        rows = self.metrics(run_id)
        return {"state": self.state(run_id), "step": rows[-1]["step"] if rows else 0,
                "total": int(self.config(run_id)["training"]["max_steps"]),
                "loss": rows[-1]["loss"] if rows else None, "samples": [str(p) for p in self.samples(run_id)],
                "exports": [str(p) for p in self.exports(run_id)], "queue_position": self.queue_position(run_id),
                "report": self.report(run_id)}
