"""Start several training runs from one interpreter and ``kill -9`` each mid-run.

``python tests/sigkill_runs.py STEP CONFIG.yaml...``: the heavy imports happen once, then each
config runs in a forked child (``python -m finetune CONFIG``'s entry point) that is sent SIGKILL as
soon as its ``metrics.jsonl`` holds STEP rows. Nothing computes before the forks, so the children
start with fresh thread pools. Prints one JSON line per run: ``{"config", "signal", "rows"}``
(``signal`` 9 when it was killed; ``rows`` the metrics rows it had written).
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
from finetune.cli import main

TIMEOUT_S = 300


def kill_at(step: int, config_path: str) -> dict:
    metrics = Path(yaml.safe_load(Path(config_path).read_text())["output_dir"]) / "metrics.jsonl"
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
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            os.kill(pid, signal.SIGKILL)
            break
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return {"config": config_path, "signal": None, "rows": 0}
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    return {"config": config_path, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, "rows": rows}


if __name__ == "__main__":
    step = int(sys.argv[1])
    for path in sys.argv[2:]:
        print(json.dumps(kill_at(step, path)), flush=True)
