"""Start several training runs from one interpreter and ``kill -9`` each mid-run.

``python tests/sigkill_runs.py [--posttrain] STEP CONFIG.yaml...``: the heavy imports happen once,
then each config runs in a forked child (``python -m finetune CONFIG``'s entry point, or
``python -m finetune.posttrain CONFIG``'s with ``--posttrain``), all of them at once, and each child
is sent SIGKILL as soon as its ``metrics.jsonl`` holds STEP rows. Nothing computes before the forks,
so the children start with fresh thread pools. Prints one JSON line per run, in the configs' order:
``{"config", "signal", "rows"}`` (``signal`` 9 when it was killed; ``rows`` the metrics rows it had
written).
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


def start(config_path: str, main) -> int:
    """Fork a child that runs ``main([config_path])`` and exits with its code."""
    pid = os.fork()
    if pid == 0:  # the child: a training run, as `python -m finetune CONFIG` runs it
        code = 1
        try:
            code = main([config_path])
        except BaseException:  # said on stderr (os._exit skips the interpreter's own report)
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def rows(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def kill_each_at(step: int, config_paths: list[str], main) -> list[dict]:
    metrics = {path: Path(yaml.safe_load(Path(path).read_text())["output_dir"]) / "metrics.jsonl" for path in config_paths}
    pids = {path: start(path, main) for path in config_paths}
    statuses = {}
    running = dict(pids)
    deadline = time.monotonic() + TIMEOUT_S
    while running and time.monotonic() < deadline:
        for path, pid in list(running.items()):
            if rows(metrics[path]) >= step:
                os.kill(pid, signal.SIGKILL)
                del running[path]
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:  # it ended by itself (an error, or it finished before the kill)
                statuses[path] = status
                del running[path]
        time.sleep(0.005)
    for pid in running.values():
        os.kill(pid, signal.SIGKILL)
    reports = []
    for path, pid in pids.items():
        status = statuses[path] if path in statuses else os.waitpid(pid, 0)[1]
        reports.append({"config": path, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                        "rows": rows(metrics[path])})
    return reports


if __name__ == "__main__":
    args = sys.argv[1:]
    main = train_main
    if args[0] == "--posttrain":
        import finetune.posttrain.run  # noqa: F401
        from finetune.posttrain.cli import main

        args = args[1:]
    for report in kill_each_at(int(args[0]), args[1:], main):
        print(json.dumps(report), flush=True)
