"""The runs folder: one folder per run, each with ``train.yaml`` (repeatable from the command line:
``krea2 train RUN/train.yaml --resume``), ``dataset.jsonl`` (the images and their captions),
``train.log`` (the subprocess's output) and what ``krea2 train`` writes there itself
(``metrics.jsonl``, ``samples/``, ``checkpoints/``, the exported ``lora_*.safetensors``).

Training runs as ``krea2 train`` in a subprocess, one at a time. Stop sends SIGTERM (the trainer
saves a checkpoint and exits with 130); a stop asked for before the trainer has set its handler up
(the first seconds, while Python imports) waits until the run folder's ``run.json`` appears.
Status is read back from those files, so runs of an earlier session are listed too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from krea2_diffusers.files import atomic_write

from .images import TrainInputError

CONFIG_NAME = "train.yaml"
MANIFEST_NAME = "dataset.jsonl"
LOG_NAME = "train.log"
EXIT_NAME = "exit.json"
STOPPED_CODE = 130  # krea2 train: stopped by a signal, checkpoint written
STATES = ("running", "stopped", "done", "failed")


def run_id_for(trigger_word: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", trigger_word or "").strip("-")[:32] or "lora"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"


class Runs:
    """The runs under ``root``, and the one ``krea2 train`` process this app may have going."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self._processes: dict[str, subprocess.Popen] = {}
        self._lock = threading.RLock()  # start() reads the state while holding it

    # ---------------------------------------------------------------- the folder
    def folder(self, run_id: str) -> Path:
        folder = (self.root / str(run_id or "")).resolve()
        if not run_id or folder.parent != self.root or not (folder / CONFIG_NAME).is_file():
            raise TrainInputError(f"No run {run_id!r} in {self.root}.")
        return folder

    def list(self) -> list[tuple[str, str]]:
        """(run id, state), newest first."""
        if not self.root.is_dir():
            return []
        ids = sorted((p.name for p in self.root.iterdir() if (p / CONFIG_NAME).is_file()), reverse=True)
        return [(run_id, self.state(run_id)) for run_id in ids]

    def create(self, raw_config_for, rows: list[list[str]], trigger_word: str, copy: bool = False) -> str:
        """A new run folder with its manifest and config; ``raw_config_for(run_dir, manifest)`` is
        the config mapping. Captions get the trigger word in front (unless they hold it already).
        ``copy``: the images are copied into ``images/`` (uploads: Gradio's temporary files go away)."""
        self.root.mkdir(parents=True, exist_ok=True)
        run_id = run_id_for(trigger_word)
        while (self.root / run_id).exists():
            run_id += "-1"
        folder = self.root / run_id
        folder.mkdir()
        manifest = folder / MANIFEST_NAME
        if copy:
            (folder / "images").mkdir()
            rows = [[str(shutil.copy2(path, folder / "images" / f"{i:04d}-{Path(path).name}")), caption]
                    for i, (path, caption) in enumerate(rows)]
        with atomic_write(manifest, "w") as handle:
            for path, caption in rows:
                if trigger_word and trigger_word not in caption:
                    caption = f"{trigger_word}, {caption}"
                handle.write(json.dumps({"path": str(Path(path).resolve()), "caption": caption}) + "\n")
        with atomic_write(folder / CONFIG_NAME, "w") as handle:
            yaml.safe_dump(raw_config_for(folder, manifest), handle, sort_keys=False)
        return run_id

    # ---------------------------------------------------------------- the process
    def running(self) -> str | None:
        with self._lock:
            return next((r for r, p in self._processes.items() if p.poll() is None), None)

    def start(self, run_id: str, resume: bool = False, env: dict | None = None) -> None:
        """``krea2 train`` (``--resume``) on the run's config; ``env``: extra environment variables."""
        folder = self.folder(run_id)
        with self._lock:
            busy = next((r for r, p in self._processes.items() if p.poll() is None), None)
            if busy is not None:
                raise TrainInputError(f"Run {busy} is still running: stop it before starting or resuming another.")
            if resume and self.state(run_id) == "done":
                raise TrainInputError(f"Run {run_id} has finished; there is nothing to resume.")
            (folder / EXIT_NAME).unlink(missing_ok=True)
            command = [sys.executable, "-m", "krea2_diffusers.cli", "train", str(folder / CONFIG_NAME)]
            with open(folder / LOG_NAME, "a") as log:
                log.write(f"$ krea2 train {folder / CONFIG_NAME}{' --resume' if resume else ''}\n")
                log.flush()
                process = subprocess.Popen(command + (["--resume"] if resume else []), cwd=folder, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, **(env or {})})
            self._processes[run_id] = process
        threading.Thread(target=self._record_exit, args=(folder, process), daemon=True).start()

    @staticmethod
    def _record_exit(folder: Path, process: subprocess.Popen) -> None:
        code = process.wait()
        with atomic_write(folder / EXIT_NAME, "w") as handle:
            handle.write(json.dumps({"returncode": code}))

    def stop(self, run_id: str) -> bool:
        """SIGTERM to the run's process (now, or once its trainer is listening); False if it is not running."""
        folder = self.folder(run_id)
        with self._lock:
            process = self._processes.get(run_id)
        if process is None or process.poll() is not None:
            return False
        threading.Thread(target=self._terminate_when_ready, args=(folder, process), daemon=True).start()
        return True

    @staticmethod
    def _terminate_when_ready(folder: Path, process: subprocess.Popen) -> None:
        while process.poll() is None and not (folder / "run.json").exists():
            time.sleep(0.05)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Stop every run this app started (each saves a checkpoint) and wait for them."""
        with self._lock:
            processes = [p for p in self._processes.values() if p.poll() is None]
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()

    # ---------------------------------------------------------------- reading a run back
    def state(self, run_id: str) -> str:
        folder = self.root / run_id
        with self._lock:
            process = self._processes.get(run_id)
        if process is not None and process.poll() is None:
            return "running"
        exit_file = folder / EXIT_NAME
        if exit_file.is_file():
            code = json.loads(exit_file.read_text())["returncode"]
            return "done" if code == 0 else "stopped" if code == STOPPED_CODE else "failed"
        if process is not None:  # exited a moment ago; its exit record is being written
            code = process.returncode
            return "done" if code == 0 else "stopped" if code == STOPPED_CODE else "failed"
        if any(folder.glob("lora_*.safetensors")):
            return "done"
        return "stopped" if (folder / "checkpoints").is_dir() else "failed"

    def config(self, run_id: str) -> dict:
        return yaml.safe_load((self.folder(run_id) / CONFIG_NAME).read_text())

    def metrics(self, run_id: str) -> list[dict]:
        """``metrics.jsonl``'s rows (what the trainer logs; a line being written is skipped)."""
        path = self.folder(run_id) / "metrics.jsonl"
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def samples(self, run_id: str) -> list[Path]:
        """The newest validation images (``samples/step-N/*.png``)."""
        steps = sorted((self.folder(run_id) / "samples").glob("step-*"))
        return sorted(steps[-1].glob("*.png")) if steps else []

    def exports(self, run_id: str) -> list[Path]:
        return sorted(self.folder(run_id).glob("lora_*.safetensors"))

    def log_tail(self, run_id: str, lines: int = 5) -> str:
        path = self.folder(run_id) / LOG_NAME
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def status(self, run_id: str) -> dict:
        """``{"state", "step", "total", "loss", "samples", "exports"}`` (the ``/train_status`` answer)."""
        rows = self.metrics(run_id)
        return {"state": self.state(run_id), "step": rows[-1]["step"] if rows else 0,
                "total": int(self.config(run_id)["training"]["max_steps"]),
                "loss": rows[-1]["loss"] if rows else None, "samples": [str(p) for p in self.samples(run_id)],
                "exports": [str(p) for p in self.exports(run_id)]}
