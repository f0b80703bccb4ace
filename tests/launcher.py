"""Run a training entry point from a test: one plain process, or several under torchrun (gloo on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def torchrun(processes: int, entry: list[str], *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``entry`` (a script path or ``-m module``) with ``args``: one plain process, or
    ``processes`` under torchrun on a free port (``--standalone``). Fails the test with the
    output's tail when the run fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = (launcher if processes > 1 else [sys.executable]) + entry + list(args)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


def launch(config: dict, folder: Path, processes: int, entry: list[str], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Write ``config`` to ``folder/config.yaml`` and :func:`torchrun` ``entry`` on it with ``args``;
    ``PROBE_DIR`` is ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return torchrun(processes, entry, str(config_path), *args, timeout=timeout, env={"PROBE_DIR": str(folder)})
