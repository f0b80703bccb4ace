"""Run a training entry point from a test: one plain process, or several under torchrun (gloo on CPU,
``--standalone``: a free rendezvous port) or ``accelerate launch`` (a free port)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _prefix(processes: int, launcher: str) -> list[str]:
    if processes == 1:
        return [sys.executable]
    if launcher == "accelerate":  # on CPU, --multi_gpu is what makes accelerate start several processes (gloo)
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]


def _environment(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(extra or {})}


def _run(argv: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


def torchrun(processes: int, entry: list[str], *args: str, timeout: int = 600, env: dict | None = None,
             launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run ``entry`` (a script path or ``-m module``) with ``args``: one plain process, or
    ``processes`` under ``launcher``. Fails the test with the output's tail when the run fails."""
    return _run(_prefix(processes, launcher) + entry + list(args), _environment(env), timeout)


def command(config: dict, folder: Path, processes: int, entry: list[str], *args: str,
            launcher: str = "torchrun") -> tuple[list[str], dict]:
    """Write ``config`` to ``folder/config.yaml``; the command line and environment that run
    ``entry`` on it with ``args`` (``PROBE_DIR`` is ``folder``). ``launcher``: ``torchrun`` or
    ``accelerate``."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return _prefix(processes, launcher) + entry + [str(config_path), *args], _environment({"PROBE_DIR": str(folder)})


def launch(config: dict, folder: Path, processes: int, entry: list[str], *args: str, timeout: int = 600,
           launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run ``entry`` on ``config`` (see :func:`command`). Fails the test with the output's tail
    when the run fails."""
    argv, env = command(config, folder, processes, entry, *args, launcher=launcher)
    return _run(argv, env, timeout)
