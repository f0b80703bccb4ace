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


PARENT = '''
import sys, time
sys.path[:0] = [{bench!r}, {here!r}]
from proving.parallel import Task, run_tasks
from proving.stages import Stages
import sleeper
stages = Stages({here!r}, judge=None, per_digit=1, resolution=8, device="cpu", eval_seed=0)
run_tasks([Task("a", sleeper.sleep, {{"folder": {here!r}}}), Task("b", sleeper.sleep, {{"folder": {here!r}}})], stages, 2,
          lambda name, done: None)
'''
SLEEPER = '''
import os, time
from pathlib import Path

def sleep(stages, *, folder):
    Path(folder, f"worker-{os.getpid()}").touch()
    time.sleep(120)
'''


def test_killing_the_run_ends_its_workers(tmp_path):
    """A run stopped by killing its main process alone (not its process group) leaves no worker
    running: each would otherwise go on, and write beside the run that --resume starts."""
    import signal
    import subprocess
    import time

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(bench=bench, here=str(tmp_path))])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("worker-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
    assert len(workers) == 2, "the workers never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it is gone too
            return stat.read().split(") ", 1)[1][0] != "Z"

    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived the run"
