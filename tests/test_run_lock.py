"""A run's lock (train_tab.runs: ``RUN/lock.json``, the pid and start time of the process training
it) raced for real: one app's trainer finishes while another app, in another process, starts the
same run again. The defect: the first app's exit handler unlinked ``lock.json`` without looking,
so when the second start landed between the first trainer's reaping and that unlink, the new run
lost its lock, and a third app started a second trainer on the same folder.

Each app is a spawned process holding its own :class:`~train_tab.runs.Runs` (the real start and
exit handling); the trainers are ``sh`` one-liners, so an iteration takes milliseconds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

from krea2_diffusers.processes import process_start_time
from train_tab.errors import TrainInputError
from train_tab.runs import EXIT_NAME, LOCK_NAME, Runs

ITERATIONS = 200
FINISHING = ("sh", "-c", "exit 130", "trainer")  # a stopped trainer: exits at once (130: resumable)
# Trains until the test kills it (SIGKILL: the start blocks SIGTERM in it), its pid in RUN/pids (cwd: the run folder).
RUNNING = ("sh", "-c", "echo $$ >> pids; exec sleep 60", "trainer")


def app(root: str, command: tuple[str, ...], conn) -> None:
    """One app on ``root``, serving orders from the test: ``start`` (resume once), ``start when
    free`` (resume as soon as no run is going), ``settle`` (wait until every exit it watches is
    recorded), ``quit``. Replies ``ok`` or the error."""
    runs = Runs(root, train_command=command)
    while True:
        order, run_id = conn.recv()
        if order == "quit":
            return
        try:
            if order == "start":
                runs.start(run_id, resume=True)
            elif order == "start when free":
                deadline = time.monotonic() + 30
                while True:
                    try:
                        runs.start(run_id, resume=True)
                        break
                    except TrainInputError as err:
                        if "still running" not in str(err) or time.monotonic() > deadline:
                            raise
            elif order == "settle":
                for thread in threading.enumerate():  # the exit watchers (this process has no other thread)
                    if thread is not threading.current_thread():
                        thread.join(30)
            conn.send("ok")
        except Exception as err:  # reported to the test, which fails on it
            conn.send(f"{type(err).__name__}: {err}")


def end_trainers(folder: Path) -> None:
    """SIGKILL the trainers of ``folder``: the one its lock names, and any that wrote its pid."""
    pids = (folder / "pids").read_text().split() if (folder / "pids").is_file() else []
    if (folder / LOCK_NAME).is_file():
        lock = json.loads((folder / LOCK_NAME).read_text())
        if process_start_time(lock["pid"]) == lock["started"]:
            pids.append(lock["pid"])
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def ask(conn, order: str, run_id: str) -> None:
    conn.send((order, run_id))


def answer(conn) -> None:
    assert conn.poll(60), "an app did not answer"
    reply = conn.recv()
    assert reply == "ok", reply


def test_a_finishing_trainer_never_removes_the_lock_of_the_run_started_after_it(tmp_path):
    root = tmp_path / "runs"
    run_id = Runs(root).create(lambda run, manifest: {"output_dir": str(run), "training": {"max_steps": 1}}, [], "acme")
    folder = root / run_id
    context = multiprocessing.get_context("spawn")
    pipes, apps = {}, []
    for name, command in (("finishing", FINISHING), ("starting", RUNNING)):
        ours, theirs = context.Pipe()
        process = context.Process(target=app, args=(str(root), command, theirs), daemon=True)
        process.start()
        pipes[name] = ours
        apps.append(process)
    third = Runs(root, train_command=RUNNING)  # a third app, started later: it must see the run and refuse
    lost, doubled, stale_exit = [], [], []
    try:
        for iteration in range(ITERATIONS):
            ask(pipes["finishing"], "start", run_id)
            answer(pipes["finishing"])  # launched; its trainer is exiting now
            ask(pipes["starting"], "start when free", run_id)  # races the finishing app's exit handling
            answer(pipes["starting"])
            ask(pipes["finishing"], "settle", run_id)
            answer(pipes["finishing"])  # its exit handling is over: whatever it would remove, it has
            lock = json.loads((folder / LOCK_NAME).read_text()) if (folder / LOCK_NAME).is_file() else None
            alive = lock is not None and process_start_time(lock["pid"]) == lock["started"]
            if not alive or third.state(run_id) != "running":
                lost.append(iteration)
            if (folder / EXIT_NAME).is_file():  # the finished trainer's record, over the running one's
                stale_exit.append(iteration)
            try:
                third.start(run_id, resume=True)
                doubled.append(iteration)
            except TrainInputError as err:
                assert "still running" in str(err), err
            end_trainers(folder)
            ask(pipes["starting"], "settle", run_id)
            answer(pipes["starting"])
            deadline = time.monotonic() + 30
            while third.running() is not None:  # a doubled trainer (the third app's) ends too
                assert time.monotonic() < deadline, "a trainer did not end"
                time.sleep(0.005)
                end_trainers(folder)  # one whose shell had not written its pid yet
            (folder / "pids").unlink(missing_ok=True)
            # The run's own trainer removed its lock and recorded its exit.
            assert not (folder / LOCK_NAME).exists() or doubled, iteration
            assert json.loads((folder / EXIT_NAME).read_text()) == {"returncode": -signal.SIGKILL}, iteration
    finally:
        end_trainers(folder)
        for conn in pipes.values():
            try:
                conn.send(("quit", run_id))
            except OSError:  # that app has died already (the test fails on its silence)
                pass
        for process in apps:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert not lost and not doubled and not stale_exit, (
        f"of {ITERATIONS} races: lock lost in {len(lost)} (first {lost[:5]}), a second trainer started in "
        f"{len(doubled)} (first {doubled[:5]}), the finished trainer's exit recorded over the running one in "
        f"{len(stale_exit)} (first {stale_exit[:5]})")
