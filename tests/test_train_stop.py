"""A Stop is never a failure: SIGTERM at any moment of a tiny ``krea2 train`` run ends it "stopped"
(exit 130, a checkpoint if a step ran) or "done" (exit 0, every export written), never killed; the
post-training and pretraining loops share the mechanism (:mod:`finetune.stop`). And the Train tab's
run lifecycle (:mod:`train_tab.runs`): run ids validated, one run at a time per runs folder across
threads, apps and app restarts, and closing the app waits for a stopping run's checkpoint.

The lifecycle tests use a fake trainer (a few lines of Python that keep ``krea2 train``'s signal
contract) so they take seconds; one test starts the real ``krea2 train`` to check its first seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from train_tab.errors import TrainInputError
from train_tab.runs import Runs

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
EXPORTS = ["lora_comfyui.safetensors", "lora_diffusers.safetensors", "lora_kohya.safetensors"]


class OneProcess:
    """The trainer's runtime for one process (no collectives): what the stop and request tests put in."""

    is_main, world_size = True, 1

    @staticmethod
    def any(flag):
        return flag

    @staticmethod
    def means(values):
        return dict(values)


# ---------------------------------------------------------------- the trainer, stopped at each moment
def tiny_config(out: Path, cache: Path) -> dict:
    return {
        "output_dir": str(out),
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "data": {"synthetic": {"num_prompts": 2, "size": 64}, "resolution": 64, "caption_dropout": 0.0,
                 "cache_dir": str(cache), "num_workers": 0},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 1, "seed": 0},
        "lora": {"rank": 4, "alpha": 4},
        "checkpointing": {"every_n_steps": 0, "keep_last": 1},  # the final one, and the one a stop writes
        "export": {"formats": ["diffusers", "comfyui", "kohya"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def test_a_stop_at_any_moment_ends_stopped_or_done_never_killed(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", tmp_path / "cache")))
    events = ["spawn", "run.json", "step:1", "step:19", "export"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "stop_sweep.py"), str(config), *events], env=env,
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["event"] for r in rows] == events, done.stderr[-3000:]
    for row in rows:
        assert row["signal"] is None and row["code"] in (0, 130), (row, done.stderr[-3000:])
        if row["code"] == 0:  # done: every step and every export
            assert row["steps"] == STEPS and row["exports"] == EXPORTS, row
        else:  # stopped before the last step, with the checkpoint of its last step (if one ran)
            assert row["steps"] < STEPS and not row["exports"], row
            assert row["checkpoints"] == ([f"step-{row['steps']}"] if row["steps"] else []), row
    by_event = {r["event"]: r for r in rows}
    # Before the first step (held while the interpreter starts; during caching / model load): no step is trained.
    for event in ("spawn", "run.json"):
        assert (by_event[event]["code"], by_event[event]["steps"]) == (130, 0), by_event[event]
    assert by_event["step:1"]["code"] == 130 and by_event["step:1"]["sent"]
    # Sent once 19 rows are logged: during the last step (then the run is done) or, if it lands in
    # the microseconds between row 19 and its check, after step 19.
    last = by_event["step:19"]
    assert last["sent"] and (last["code"] == 0 or last["steps"] == STEPS - 1), last
    assert by_event["export"]["code"] == 0, by_event["export"]


def test_posttrain_and_pretrain_share_the_stop_and_end_before_a_step_when_stopped_while_setting_up(monkeypatch, tmp_path):
    """One mechanism: the trainers' ``with StopRequest()`` joins the command's (the flag is shared),
    and a stop that arrives while a trainer sets up (post-training's ``setup``, pretraining's
    ``prepare``) is its handler's, and ends the loop before its first step."""
    from finetune.config import build_config
    from finetune.posttrain.trainer import PosttrainTrainer
    from finetune.pretrain.trainer import BackgroundPMA, Pretrainer
    from finetune.stop import StopRequest

    with StopRequest() as outer:
        with StopRequest() as inner:
            assert inner is outer
        os.kill(os.getpid(), signal.SIGTERM)  # the flag, not the default action
        assert outer.requested

    def no_step(*args, **kwargs):
        raise AssertionError("a step ran after a stop that came while setting up")

    def stop_while_setting_up(self):
        os.kill(os.getpid(), signal.SIGTERM)

    section = type("Section", (), {})
    pretrain_config = type("Config", (), {"total_steps": 5})()
    pretrain_config.checkpointing, pretrain_config.logging = section(), section()
    pretrain_config.checkpointing.every_n_steps = 0
    pretrain_config.logging.tensorboard, pretrain_config.logging.progress_bar, pretrain_config.logging.log_every_n_steps = False, False, 1
    pretrain_config.logging.wandb, pretrain_config.to_dict = None, dict
    monkeypatch.setattr(PosttrainTrainer, "setup", stop_while_setting_up)
    monkeypatch.setattr(PosttrainTrainer, "train_step", no_step)
    monkeypatch.setattr(Pretrainer, "prepare", stop_while_setting_up)
    monkeypatch.setattr(Pretrainer, "setup_stage", no_step)
    # Not the trainers': a signal reaching this handler was not caught by the trainer (the old
    # pretrainer installed its handler after prepare; without this guard, pytest would be killed).
    missed = []

    def missed_by_the_trainer(signum, frame):
        missed.append(signum)

    previous = signal.signal(signal.SIGTERM, missed_by_the_trainer)
    try:
        for cls in (PosttrainTrainer, Pretrainer):
            trainer = cls.__new__(cls)  # no model: set-up is replaced by a stop arriving while it runs
            trainer.runtime, trainer.out, trainer.resume = OneProcess(), tmp_path / cls.__name__, False
            trainer.out.mkdir()
            if cls is Pretrainer:
                trainer.config, trainer.pma_writer = pretrain_config, BackgroundPMA()
            else:
                trainer.config = build_config(tiny_config(trainer.out, tmp_path / "cache"))
                trainer.early_inputs, trainer.start_step, trainer.pipe = iter(()), 0, None
                trainer.checkpointer = type("Checkpointer", (), {"wait": lambda self: None})()
            result = trainer.train()
            assert result.interrupted and result.final_step == 0 and not result.losses, cls.__name__
            assert not missed, f"{cls.__name__}: the stop reached the default handler"
            assert signal.getsignal(signal.SIGTERM) is missed_by_the_trainer  # restored on leaving
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_stop_during_the_last_step_still_exports_and_ends_done(monkeypatch, tmp_path):
    """The old loop treated a stop seen after the last step like any other: "interrupted", no
    export, exit 130, although every step had run. The sweep above can only hit that moment by
    chance; here the last step itself asks to stop."""
    from finetune.config import build_config
    from finetune.trainer import Trainer

    saved, exported = [], []

    def train_step(self, step, items):
        if step == STEPS - 1:  # 0-based: the last step
            os.kill(os.getpid(), signal.SIGTERM)
        return 1.0, 0.0

    trainer = Trainer.__new__(Trainer)
    trainer.config = build_config(tiny_config(tmp_path / "run", tmp_path / "cache"))
    trainer.runtime, trainer.out, trainer.resume, trainer.lora = OneProcess(), tmp_path / "run", False, True
    trainer.out.mkdir()
    trainer.early_inputs, trainer.start_step, trainer.pipe, trainer.extra_metrics = iter(()), 0, None, {}
    trainer.ema, trainer.optimizer = None, torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # no EMA, plain weights
    trainer.step_split = None  # set by __init__, which __new__ skips
    trainer.lr_scheduler = type("Schedule", (), {"get_last_lr": lambda self: [1e-3]})()
    trainer.checkpointer = type("Checkpointer", (), {"wait": lambda self: None, "folder": tmp_path / "checkpoints"})()
    monkeypatch.setattr(Trainer, "setup", lambda self: None)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(Trainer, "save", lambda self, step: saved.append(step))
    monkeypatch.setattr(Trainer, "export", lambda self, step: exported.append(step) or [tmp_path / "lora.safetensors"])
    monkeypatch.setattr("finetune.engine.checkpoint.latest_checkpoint", lambda folder: folder / f"step-{STEPS}")
    result = trainer.train()
    assert not result.interrupted and result.final_step == STEPS and len(result.losses) == STEPS
    assert saved == [STEPS] and exported == [STEPS]


# ---------------------------------------------------------------- the Train tab's runs
FAKE_TRAINER = textwrap.dedent('''
    """Stands in for krea2 train: records its pid, listens for SIGTERM the way finetune.stop does
    (handler, then unblock), and on SIGTERM takes CHECKPOINT_S to write its checkpoint, then exits 130."""
    import os, signal, sys, time
    from pathlib import Path

    folder = Path(sys.argv[1]).parent
    with open(folder / "pids.txt", "a") as handle:
        handle.write(f"{os.getpid()}\\n")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    deadline = time.monotonic() + 120  # never outlives a failed test by long
    while not stopping and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(float(os.environ.get("CHECKPOINT_S", "0")))
    (folder / "checkpoints" / "step-1").mkdir(parents=True)
    sys.exit(130)
''')


@pytest.fixture
def fake_runs(tmp_path):
    """A Runs factory (``make()`` stands for one app) whose runs are the fake trainer; every fake
    still going at the end is stopped."""
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    root = tmp_path / "runs"
    made = []

    def make() -> Runs:
        made.append(Runs(root, train_command=(sys.executable, str(script))))
        return made[-1]

    yield make
    for runs in made:  # none of their queued runs starts once the test is over
        for run_id in runs.waiting():
            runs.dequeue(run_id)
    for pids in root.glob("*/pids.txt"):
        for pid in pids.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def tiny_run_config(run: Path, manifest: Path) -> dict:
    return {"output_dir": str(run), "training": {"max_steps": STEPS}}


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def pids(root: Path) -> list[str]:
    return [pid for path in sorted(root.glob("*/pids.txt")) for pid in path.read_text().split()]


@pytest.mark.parametrize("method", ["state", "folder", "stop", "start", "config", "metrics", "status", "exports", "dequeue", "report"])
def test_a_run_id_that_is_not_one_folder_name_is_refused_without_naming_any_file(tmp_path, method):
    runs = Runs(tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "train.yaml").write_text("output_dir: x\n")  # a config one folder up: '..' must not reach it
    for bad in ("../../etc", "..", ".", "", "a/b", "/etc/passwd", "..\\x", "run\x00", "../runs"):
        with pytest.raises(TrainInputError) as err:
            getattr(runs, method)(bad)
        message = str(err.value)
        assert "etc" not in message and "passwd" not in message and str(tmp_path) not in message, (bad, message)


def test_two_apps_starting_at_once_leave_one_process_and_the_other_runs_queued(fake_runs, tmp_path):
    apps = [fake_runs(), fake_runs()]  # two apps on one runs folder, two threads each
    barrier = threading.Barrier(4)
    started, refused = [], []

    def start(runs: Runs) -> None:
        barrier.wait()
        try:
            started.append(runs.create_and_start(tiny_run_config, [], "acme"))
        except TrainInputError as err:
            refused.append(str(err))

    threads = [threading.Thread(target=start, args=(app,)) for app in apps for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(started) == 4 and not refused, (started, refused)
    root = tmp_path / "runs"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(started)
    wait_until(lambda: len(pids(root)) == 1)
    going = apps[0].running()
    # Both apps see one run training and the three others queued behind it, in one order.
    assert all(runs.running() == going for runs in apps)
    queue = apps[0].waiting()
    assert sorted([going, *queue]) == sorted(started) and apps[1].waiting() == queue
    assert [apps[1].queue_position(r) for r in queue] == [1, 2, 3] and apps[1].queue_position(going) is None
    # Both apps, and a third started after the first crashed, see it running and refuse to start it again.
    for runs in (*apps, fake_runs()):
        assert runs.state(going) == "running" and [runs.state(r) for r in queue] == ["queued"] * 3
        with pytest.raises(TrainInputError, match="still running"):
            runs.start(going, resume=True)
    assert len(pids(root)) == 1


def test_two_apps_resuming_one_run_at_once_start_one_process(fake_runs, tmp_path):
    """The defect: each app checked only its own processes, so both resumed the run."""
    first = fake_runs()
    run_id = first.create(tiny_run_config, [], "acme")
    apps = [first, fake_runs()]
    barrier = threading.Barrier(2)
    outcomes = []

    def resume(runs: Runs) -> None:
        barrier.wait()
        try:
            runs.start(run_id, resume=True)
            outcomes.append("started")
        except TrainInputError as err:
            outcomes.append(str(err))

    threads = [threading.Thread(target=resume, args=(app,)) for app in apps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("started") == 1, outcomes
    root = tmp_path / "runs"
    time.sleep(1.0)  # a second process, had one been started, would have written its pid by now
    assert len(pids(root)) == 1
    # The other app stops it through the run's lock (pid and start time); it saves its checkpoint.
    other = apps[outcomes.index("started") - 1]
    assert other.stop(run_id)
    wait_until(lambda: other.state(run_id) != "running")
    assert (root / run_id / "checkpoints" / "step-1").is_dir() and other.state(run_id) == "stopped"


def test_a_stale_lock_is_ignored(fake_runs, tmp_path):
    runs = fake_runs()
    run_id = runs.create(tiny_run_config, [], "acme")
    # The lock of a process that is gone: its pid is now someone else's (this test's), started at another time.
    (tmp_path / "runs" / run_id / "lock.json").write_text(json.dumps({"pid": os.getpid(), "started": 1.0}))
    assert runs.state(run_id) == "failed" and runs.running() is None
    runs.start(run_id)
    wait_until(lambda: len(pids(tmp_path / "runs")) == 1)
    assert runs.state(run_id) == "running"


def test_closing_the_app_waits_for_a_stopping_runs_checkpoint(fake_runs, tmp_path, monkeypatch):
    """The old close gave a stopping run 120 s, then SIGKILL, though a full-size step takes
    100-300 s. Here the clock is made to run out at once (the first timed wait reports a timeout):
    close must keep waiting, and the run writes its checkpoint and exits 130."""
    monkeypatch.setenv("CHECKPOINT_S", "1.5")
    runs = fake_runs()
    run_id = runs.create(tiny_run_config, [], "acme")
    runs.start(run_id)
    wait_until(lambda: len(pids(tmp_path / "runs")) == 1)
    real_wait, timeouts = subprocess.Popen.wait, []

    def wait(process, timeout=None):
        if timeout is not None and not timeouts:  # as if the whole timeout had gone by
            timeouts.append(timeout)
            raise subprocess.TimeoutExpired(process.args, timeout)
        return real_wait(process, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    kills = []
    monkeypatch.setattr(subprocess.Popen, "kill", lambda process: kills.append(process.pid))
    runs.close()
    assert timeouts and not kills
    assert (tmp_path / "runs" / run_id / "checkpoints" / "step-1").is_dir()
    wait_until(lambda: runs.state(run_id) != "running")
    assert runs.state(run_id) == "stopped"


def test_a_stop_right_after_a_resume_starts_is_a_stop_not_a_failure(tmp_path):
    """The real krea2 train, stopped while Python is still importing: the old runs.py waited for
    run.json before signalling, which a resumed run already has, so the signal killed it ("failed")."""
    runs = Runs(tmp_path / "runs")

    def config(run: Path, manifest: Path) -> dict:
        return tiny_config(run, tmp_path / "cache")

    run_id = runs.create(config, [], "acme")
    (tmp_path / "runs" / run_id / "run.json").write_text("{}")  # as left by its first start
    runs.start(run_id, resume=True, env={"OMP_NUM_THREADS": "1"})
    assert runs.stop(run_id)
    wait_until(lambda: runs.state(run_id) != "running", timeout=300)
    assert runs.state(run_id) == "stopped", runs.log_tail(run_id, 20)
