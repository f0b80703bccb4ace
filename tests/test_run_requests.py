"""Asking a running training for samples or a checkpoint at its next step (:mod:`finetune.run_requests`):
the files, taken at once and exactly once while an asker races the taker, and the training loop
acting on them after the step that follows, without stopping (a trainer whose steps, checkpoints
and samples are stand-ins: the loop's decisions only)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from finetune.run_requests import KINDS, REQUESTS, ask, between_steps, clear, take

STEPS = 6


def test_requests_are_files_taken_all_at_once(tmp_path):
    assert take(tmp_path) == set()  # nothing asked: nothing there, nothing made
    assert not (tmp_path / REQUESTS).exists()
    assert ask(tmp_path, "save") == tmp_path / REQUESTS / "save"
    ask(tmp_path, "save")  # twice before a step: once
    ask(tmp_path, "sample")
    (tmp_path / REQUESTS / "typo").touch()  # from a terminal: ignored with a warning
    assert take(tmp_path) == {"sample", "save"}
    assert take(tmp_path) == set() and sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="one of 'sample', 'save', got 'stop'"):
        ask(tmp_path, "stop")
    ask(tmp_path, "sample")
    clear(tmp_path)  # a new start drops what an earlier one was asked
    assert take(tmp_path) == set()


def test_a_request_asked_while_the_trainer_takes_is_seen_once_never_lost(tmp_path):
    """The asker writes a request, waits until it has been taken, and asks again; the taker takes
    in a loop as fast as it can. A lost request would never be counted (the asker times out), one
    seen twice would be counted twice."""
    asks, counted, stop = 100, [], threading.Event()

    def taker():
        while not stop.is_set():
            counted.extend(take(tmp_path))

    thread = threading.Thread(target=taker)
    thread.start()
    try:
        for i in range(asks):
            ask(tmp_path, KINDS[i % 2])
            deadline = time.monotonic() + 10
            while len(counted) < i + 1:
                assert time.monotonic() < deadline, f"request {i} was lost"
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    assert counted == [KINDS[i % 2] for i in range(asks)]


def test_one_collective_carries_the_stop_and_the_requests(tmp_path):
    calls = []

    class Runtime:  # the main process of two: the other one saw the stop signal
        is_main = True

        @staticmethod
        def means(values):
            calls.append(dict(values))
            return {k: (v + (1.0 if k == "stop" else 0.0)) / 2 for k, v in values.items()}

    ask(tmp_path, "sample")
    asked = between_steps(Runtime(), False, tmp_path, 3)
    assert (asked.stop, asked.sample, asked.save) == (True, True, False) and len(calls) == 1
    Runtime.is_main = False  # another process: it does not read the folder, the main one's answer comes with the collective
    ask(tmp_path, "save")
    assert not between_steps(Runtime(), False, tmp_path, 4).save and (tmp_path / REQUESTS / "save").exists()


def test_sample_now_and_save_now_act_at_the_next_step_and_the_run_goes_on(monkeypatch, tmp_path):
    from finetune.config import build_config
    from finetune.trainer import Trainer
    from test_train_stop import OneProcess, tiny_config

    saved, sampled = [], []

    def train_step(self, step, items):
        if step == 1:  # 0-based: during step 2, "Sample now" and "Save now" are clicked
            ask(self.out, "sample")
            ask(self.out, "save")
        return 1.0, 0.0

    raw = tiny_config(tmp_path / "run", tmp_path / "cache")
    raw["validation"] = {"prompts": ["a photo"], "every_n_steps": 0, "metrics": False}
    raw["checkpointing"] = {"every_n_steps": 4, "keep_last": 3}
    trainer = Trainer.__new__(Trainer)
    trainer.config = build_config({**raw, "training": {**raw["training"], "max_steps": STEPS}})
    trainer.runtime, trainer.out, trainer.resume, trainer.lora = OneProcess(), tmp_path / "run", False, True
    trainer.out.mkdir()
    trainer.early_inputs, trainer.start_step, trainer.pipe, trainer.extra_metrics = iter(()), 0, None, {}
    trainer.ema, trainer.optimizer, trainer.step_split = None, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), None
    trainer.lr_scheduler = type("Schedule", (), {"get_last_lr": lambda self: [1e-3]})()
    trainer.checkpointer = type("Checkpointer", (), {"wait": lambda self: None, "folder": tmp_path / "checkpoints"})()
    monkeypatch.setattr(Trainer, "setup", lambda self: None)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(Trainer, "save", lambda self, step: saved.append(step))
    monkeypatch.setattr(Trainer, "run_validation", lambda self, validator, step, metrics: sampled.append(step))
    monkeypatch.setattr(Trainer, "export", lambda self, step: [])
    monkeypatch.setattr("finetune.engine.checkpoint.latest_checkpoint", lambda folder: folder / f"step-{STEPS}")
    result = trainer.train()
    assert not result.interrupted and result.final_step == STEPS and len(result.losses) == STEPS
    assert saved == [2, 4, STEPS]  # asked during step 2: after it; then the schedule's and the last
    assert sampled == [2, STEPS]  # after step 2, and the final sample set
    assert not (trainer.out / REQUESTS).exists()
