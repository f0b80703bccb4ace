"""Start several training runs from one interpreter and ``kill -9`` each mid-run.

``python tests/sigkill_runs.py [--posttrain] [--resume] STEP CONFIG.yaml...``: the heavy imports happen
once, then each config runs in a forked child (``python -m finetune CONFIG``'s entry point, or
``python -m finetune.posttrain CONFIG``'s with ``--posttrain``), all of them at once, and each child
is sent SIGKILL as soon as its ``metrics.jsonl`` holds STEP rows (``CONFIG.yaml@SIGNAL:STEP``: that
run gets SIGNAL, e.g. ``SIGTERM``, at its own STEP). Nothing computes before the forks, so the
children start with fresh thread pools. Prints one JSON line per run, in the configs' order:
``{"config", "signal", "code", "rows"}`` (``signal`` 9 when it was killed, ``code`` its exit code
when it exited; ``rows`` the metrics rows it had written). With ``--resume``, once every run has
ended each config is resumed (``CONFIG --resume``) in a forked child, all at once, and the line
also holds ``metrics`` (the rows as they stood before the resume), ``checkpoints`` (the checkpoint
steps then) and ``resumed`` (the resumed run's exit code).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import yaml

import bitsandbytes  # noqa: F401  (imported once here, not in every child)
import finetune.model  # noqa: F401
import finetune.validation  # noqa: F401
import peft  # noqa: F401
from finetune.cli import main as train_main

TIMEOUT_S = 600


def start(argv: list[str], main) -> int:
    """Fork a child that runs ``main(argv)`` and exits with its code."""
    pid = os.fork()
    if pid == 0:  # the child: a training run, as `python -m finetune CONFIG` runs it
        code = 1
        try:
            code = main(argv)
        except BaseException:  # said on stderr (os._exit skips the interpreter's own report)
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def rows(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def parse(spec: str, step: int) -> tuple[str, signal.Signals, int]:
    """``CONFIG`` or ``CONFIG@SIGNAL:STEP`` -> (config path, signal, step)."""
    path, _, at = spec.partition("@")
    if not at:
        return path, signal.SIGKILL, step
    name, _, own = at.partition(":")
    return path, signal.Signals[name], int(own)


def output_dir(config_path: str) -> Path:
    return Path(yaml.safe_load(Path(config_path).read_text())["output_dir"])


def kill_each_at(step: int, specs: list[str], main) -> list[dict]:
    runs = [parse(spec, step) for spec in specs]
    metrics = {path: output_dir(path) / "metrics.jsonl" for path, _, _ in runs}
    pids = {path: start([path], main) for path, _, _ in runs}
    statuses = {}
    running = {path: (pids[path], sig, at) for path, sig, at in runs}
    deadline = time.monotonic() + TIMEOUT_S
    while running and time.monotonic() < deadline:
        for path, (pid, sig, at) in list(running.items()):
            if rows(metrics[path]) >= at:
                os.kill(pid, sig)
                del running[path]
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:  # it ended by itself (an error, or it finished before the signal)
                statuses[path] = status
                del running[path]
        time.sleep(0.005)
    for pid, _, _ in running.values():
        os.kill(pid, signal.SIGKILL)
    reports = []
    for path, pid in pids.items():
        status = statuses[path] if path in statuses else os.waitpid(pid, 0)[1]
        reports.append({"config": path, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, "rows": rows(metrics[path])})
    return reports


def resume_each(reports: list[dict], main) -> None:
    """Resume every run at once (each in a forked child); note what it resumed from and its exit code."""
    for report in reports:
        out = output_dir(report["config"])
        report["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        report["checkpoints"] = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    pids = [start([report["config"], "--resume"], main) for report in reports]
    deadline = time.monotonic() + TIMEOUT_S
    for report, pid in zip(reports, pids):
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not done[0]:  # not within the time limit: no orphan left running
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
        status = done[1]
        report["resumed"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


if __name__ == "__main__":
    args = sys.argv[1:]
    main = train_main
    if args[0] == "--posttrain":
        import finetune.posttrain.run  # noqa: F401
        from finetune.posttrain.cli import main

        args = args[1:]
    resume = args[0] == "--resume"
    if resume:
        args = args[1:]
    reports = kill_each_at(int(args[0]), args[1:], main)
    if resume:
        resume_each(reports, main)
    for report in reports:
        print(json.dumps(report), flush=True)
