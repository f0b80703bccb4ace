"""The Train tab's queue (:mod:`train_tab.queue`, :class:`train_tab.runs.Runs`): a start while a run
trains is queued, visible on disk, started in order when the run before it ends; stopping a queued
run takes it out; a stale mark (its app gone) is no queue; closing the app empties its queue.
"Sample now" / "Save now" are for running runs only. The trainers are test_train_stop's fake (a few
lines of Python keeping ``krea2 train``'s signal contract), so this takes seconds."""

from __future__ import annotations

import json

import pytest

from test_train_stop import fake_runs, pids, tiny_run_config, wait_until  # noqa: F401 (fake_runs: a fixture)
from train_tab.errors import TrainInputError
from train_tab.queue import QUEUED_NAME


def test_queued_runs_start_in_order_and_a_stopped_one_leaves_the_queue(fake_runs, tmp_path):
    runs = fake_runs()
    root = tmp_path / "runs"
    first = runs.create_and_start(tiny_run_config, [], "first")
    second = runs.create_and_start(tiny_run_config, [], "second")
    third = runs.create_and_start(tiny_run_config, [], "third")
    wait_until(lambda: len(pids(root)) == 1)
    assert [runs.state(r) for r in (first, second, third)] == ["running", "queued", "queued"]
    assert [runs.queue_position(r) for r in (first, second, third)] == [None, 1, 2]
    assert (root / second / QUEUED_NAME).is_file() and dict(runs.list())[second] == "queued"
    status = runs.status(third)
    assert (status["state"], status["queue_position"], status["report"], status["step"]) == ("queued", 2, None, 0)

    with pytest.raises(TrainInputError, match=f"Run {second} is queued: samples and checkpoints on demand"):
        runs.ask(second, "save")
    runs.ask(first, "save")
    assert (root / first / "requests" / "save").is_file()

    assert runs.dequeue(second) and not runs.dequeue(second)  # stopped while queued: out of the queue
    assert runs.state(second) == "stopped" and runs.queue_position(third) == 1
    assert runs.stop(first)
    wait_until(lambda: runs.state(third) == "running")
    assert runs.state(first) == "stopped" and runs.state(second) == "stopped"
    assert not (root / third / QUEUED_NAME).exists() and runs.waiting() == []
    wait_until(lambda: len(pids(root)) == 2)
    assert not (root / second / "pids.txt").exists()  # the dequeued one never ran
    with pytest.raises(TrainInputError, match=f"Run {first} is stopped"):
        runs.ask(first, "sample")


def test_a_mark_whose_app_exited_is_no_queue_and_closing_empties_the_queue(fake_runs, tmp_path):
    runs = fake_runs()
    root = tmp_path / "runs"
    going = runs.create_and_start(tiny_run_config, [], "going")
    waiting = runs.create_and_start(tiny_run_config, [], "waiting")
    orphan = runs.create(tiny_run_config, [], "orphan")
    # queued by an app that has exited: its pid is this test's, its start time another process's
    (root / orphan / QUEUED_NAME).write_text(json.dumps({"pid": 1 << 22, "started": 1.0, "queued": 0.0}))
    assert runs.waiting() == [waiting] and runs.state(orphan) == "stopped"  # Resume starts it
    runs.close()  # the queue first (nothing starts while closing), then the running run
    assert runs.state(going) == "stopped" and runs.state(waiting) == "stopped" and runs.waiting() == []
    assert not (root / waiting / "pids.txt").exists()
