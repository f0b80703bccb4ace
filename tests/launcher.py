"""Run a training entry point from a test: one plain process, or several under torchrun (gloo on CPU)
or ``accelerate launch``."""

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


def command(config: dict, folder: Path, processes: int, entry: list[str], *args: str,
            launcher: str = "torchrun") -> tuple[list[str], dict]:
    """Write ``config`` to ``folder/config.yaml``; the command line and environment that run
    ``entry`` (a script path or ``-m module``) on it with ``args``. ``launcher``: ``torchrun`` or
    ``accelerate`` (on CPU, ``--multi_gpu`` is what makes accelerate start several processes;
    the runtime then picks gloo)."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PROBE_DIR": str(folder)}
    if processes == 1:
        prefix = [sys.executable]
    elif launcher == "accelerate":
        prefix = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(_free_port())]
    else:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    return prefix + entry + [str(config_path), *args], env


def launch(config: dict, folder: Path, processes: int, entry: list[str], *args: str, timeout: int = 600,
           launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """Run ``entry`` on ``config`` (see :func:`command`); ``PROBE_DIR`` is ``folder``. Fails the
    test with the output's tail when the run fails."""
    argv, env = command(config, folder, processes, entry, *args, launcher=launcher)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done
