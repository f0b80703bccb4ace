"""A real ComfyUI server (0.29.0, CPU) for tests, driven over HTTP as a user's browser does.

``.ci/run`` builds the harness (``../shared/comfyui/setup.sh DIR .``) in the background and exports
``KREA2_COMFYUI_DIR=DIR`` (holding ``DIR/comfyui`` and ``DIR/venv``) and ``KREA2_COMFYUI_READY=FILE``,
written "ok" (or "failed" and the build log's tail) when the build ends; the ``comfyui`` fixture waits
for it, then
(``conftest``) starts one server per test session on a free loopback port with a temporary base
directory (custom_nodes linking this checkout's pack, models, input, output), so the harness
itself is never modified; it is stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

COMFYUI_DIR_ENV = "KREA2_COMFYUI_DIR"
HARNESS = os.environ.get(COMFYUI_DIR_ENV)
NO_HARNESS = (f"${COMFYUI_DIR_ENV} is unset: no real ComfyUI harness (.ci/run builds one with "
              "../shared/comfyui/setup.sh and sets it)")
REPO = Path(__file__).resolve().parents[1]
READY_ENV = "KREA2_COMFYUI_READY"
START_TIMEOUT_S, RUN_TIMEOUT_S, BUILD_TIMEOUT_S = 180, 300, 900


def wait_for_harness() -> None:
    """Block until ``.ci/run``'s background build of the harness ends (no-op when it was built beforehand
    or by hand, i.e. ``$KREA2_COMFYUI_READY`` is unset); fail with the build's log tail if it failed."""
    ready = os.environ.get(READY_ENV)
    if not ready:
        return
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ComfyUI harness build ({HARNESS}) did not end within {BUILD_TIMEOUT_S} s")
        time.sleep(2)
    status = Path(ready).read_text()
    if status.strip() != "ok":
        raise RuntimeError(status)
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras", "diffusers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: Path):
        harness = Path(HARNESS)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(base / "server.log", "w")
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's library, whatever the venv has
        self.process = subprocess.Popen(
            [str(harness / "venv" / "bin" / "python"), str(harness / "comfyui" / "main.py"), "--cpu", "--listen", "127.0.0.1",
             "--port", str(self.port), "--disable-auto-launch", "--disable-api-nodes", "--base-directory", str(base),
             "--database-url", "sqlite:///:memory:"],
            cwd=harness / "comfyui", stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.base = base
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.tail()}")
            try:
                self.object_info = self.get("/object_info")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        raise TimeoutError(f"ComfyUI did not answer within {START_TIMEOUT_S} s:\n{self.tail()}")

    def output(self) -> str:
        """Everything the server has logged so far."""
        self.log.flush()
        return (self.base / "server.log").read_text()

    def tail(self) -> str:
        return self.output()[-4000:]

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def run(self, graph: dict) -> dict:
        """Queue ``graph`` (API format), wait for it, and return its history entry; fail with ComfyUI's error."""
        request = urllib.request.Request(self.url + "/prompt", data=json.dumps({"prompt": graph}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                prompt_id = json.loads(response.read())["prompt_id"]
        except urllib.error.HTTPError as err:
            raise AssertionError(f"ComfyUI refused the graph: {err.read().decode()[:2000]}") from None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                assert status["status_str"] == "success", f"{json.dumps(status['messages'])[:3000]}\n{self.tail()}"
                return entry
            time.sleep(0.5)
        raise TimeoutError(f"graph did not finish in {RUN_TIMEOUT_S} s:\n{self.tail()}")

    def images(self, entry: dict, node_id: str) -> list[np.ndarray]:
        """The PNGs SaveImage node ``node_id`` wrote, as (H, W, 3) int arrays."""
        files = entry["outputs"][node_id]["images"]
        return [np.asarray(Image.open(self.base / "output" / f["subfolder"] / f["filename"]).convert("RGB")).astype(int)
                for f in files]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def start_server(base: Path) -> Server:
    """Model folders and this checkout's node pack (linked, as users link it) under ``base``, then a server on it."""
    wait_for_harness()
    for kind in MODEL_FOLDERS:
        (base / "models" / kind).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes").mkdir(exist_ok=True)
    (base / "custom_nodes" / "krea2").symlink_to(REPO / "comfy_nodes")
    return Server(base)
