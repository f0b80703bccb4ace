"""Run one tiny training config several times, each time sending SIGTERM at another moment.

``python tests/stop_sweep.py CONFIG.yaml EVENT...``: the heavy imports happen once, then each
EVENT runs the config (into ``<output_dir>-<i>``, the feature cache shared through
``data.cache_dir``) in a forked child through ``krea2 train``'s entry point, and the parent sends
SIGTERM as soon as the event is seen:

- ``spawn``: at once (the child forks with SIGTERM blocked, as the Train tab starts ``krea2 train``;
  the signal waits until the trainer listens);
- ``run.json``: the run folder's ``run.json`` exists (set-up: caching, model load);
- ``step:K``: ``metrics.jsonl`` holds K rows;
- ``export``: an export (or its temporary file) exists in the run folder;
- ``exit``: after the child has exited (the signal is not sent).

Prints one JSON line per event: ``{"event", "sent", "code", "signal", "steps", "exports", "checkpoints"}``
(``sent``: whether SIGTERM was sent before the run ended; ``code`` the exit code, ``signal`` the
signal that ended it, if one did). Nothing computes before
the forks, so the children start with fresh thread pools.
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

import finetune.model  # noqa: F401  (imported once here, not in every child)
import finetune.trainer  # noqa: F401
import peft  # noqa: F401
from krea2_diffusers.cli import main

TIMEOUT_S = 300


def seen(event: str, out: Path) -> bool:
    if event == "spawn":
        return True
    if event == "run.json":
        return (out / "run.json").exists()
    if event.startswith("step:"):
        metrics = out / "metrics.jsonl"
        return metrics.exists() and len(metrics.read_text().splitlines()) >= int(event[5:])
    if event == "export":
        return any(out.glob("lora_*")) or any(out.glob(".lora_*.tmp"))
    return False


def run(config_path: Path, event: str, index: int) -> dict:
    config = yaml.safe_load(config_path.read_text())
    out = Path(f"{config['output_dir']}-{index}")
    if event == "spawn":  # as the Train tab starts krea2 train: SIGTERM held until the trainer listens
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = main(["train", str(config_path), f"output_dir={out}"])
        except BaseException:  # said on stderr (os._exit skips the interpreter's own report)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    deadline = time.monotonic() + TIMEOUT_S
    done, status, sent = 0, None, False
    while time.monotonic() < deadline:
        if seen(event, out):
            os.kill(pid, signal.SIGTERM)
            sent = True
            break
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.002)
    else:
        os.kill(pid, signal.SIGKILL)
    if not done:
        _, status = os.waitpid(pid, 0)
    metrics = out / "metrics.jsonl"
    return {"event": event, "sent": sent, "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "steps": len(metrics.read_text().splitlines()) if metrics.exists() else 0,
            "exports": sorted(p.name for p in out.glob("lora_*.safetensors")),
            "checkpoints": sorted(p.name for p in (out / "checkpoints").glob("step-*"))}


if __name__ == "__main__":
    path = Path(sys.argv[1])
    for i, name in enumerate(sys.argv[2:]):
        print(json.dumps(run(path, name, i)), flush=True)
