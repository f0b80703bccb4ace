"""The proving ground's stage pool (bench/proving/parallel.py): tasks run in spawned workers give the
same values and rows as in-process, each result reaches the caller as it finishes, and a task's error
stops the run with that error. (The quick run's test runs the real stages through it.)"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from proving.parallel import Task, run_tasks  # noqa: E402
from proving.stages import Stages  # noqa: E402


def sample(stages, *, name: str, value: int):
    """A stand-in stage: one row, and which process ran it."""
    stages.rows[name] = {"accuracy": value / 10, "seen_rows": sorted(stages.rows)}  # before its own
    return {"value": value, "pid": os.getpid()}


def fail(stages, *, message: str):
    raise RuntimeError(message)


def stages(tmp_path):
    return Stages(tmp_path, judge=None, per_digit=1, resolution=8, device="cpu", eval_seed=0, rows={"base": {"accuracy": 1.0}})


@pytest.mark.parametrize("workers", [1, 2])
def test_tasks_give_their_values_and_rows_whatever_the_workers(tmp_path, workers):
    run = stages(tmp_path)
    tasks = [Task(f"s{i}", sample, {"name": f"s{i}", "value": i}) for i in range(3)]
    finished = []
    done = run_tasks(tasks, run, workers, lambda name, d: finished.append(name))
    assert sorted(finished) == ["s0", "s1", "s2"] and set(done) == set(finished)
    assert [done[f"s{i}"].value["value"] for i in range(3)] == [0, 1, 2]
    # Each task starts from no rows (a worker never sees another's), and its rows join the run's.
    assert run.rows == {"base": {"accuracy": 1.0}, **{f"s{i}": {"accuracy": i / 10, "seen_rows": []} for i in range(3)}}
    pids = {d.value["pid"] for d in done.values()}
    assert (pids == {os.getpid()}) if workers == 1 else (os.getpid() not in pids)


def test_a_failing_task_stops_the_run_with_its_error(tmp_path):
    tasks = [Task("ok", sample, {"name": "ok", "value": 1}), Task("bad", fail, {"message": "stage bad broke"})]
    with pytest.raises(RuntimeError, match="stage bad broke"):
        run_tasks(tasks, stages(tmp_path), 2, lambda name, d: None)
