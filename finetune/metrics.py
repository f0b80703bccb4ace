"""Progress bar, ``metrics.jsonl``, TensorBoard and Weights & Biases, all on the main process only."""

from __future__ import annotations

import json
import netrc
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlparse

from tqdm.auto import tqdm

from .config import ConfigError, WandbConfig


def check_wandb(config: WandbConfig | None) -> None:
    """Before anything loads: ``logging.wandb`` needs the package, and ``online`` an API key (so
    that nothing is sent, or prompted for, without one)."""
    if config is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("logging.wandb needs wandb: pip install 'krea2-diffusers[wandb]' (or pip install wandb)") from None
    if config.mode == "online" and not os.environ.get("WANDB_API_KEY") and not _netrc_key():
        raise ConfigError("logging.wandb.mode online needs a W&B API key (WANDB_API_KEY, or `wandb login`); "
                          "logging.wandb.mode: offline writes the run locally (`wandb sync` sends it later)")


def _netrc_key() -> bool:
    """Whether ``wandb login`` stored a key for the W&B host (it writes ~/.netrc, or $NETRC)."""
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class MetricsLogger:
    """One row per optimizer step: ``{"step", "loss", "lr", "grad_norm", "time"}``.

    On resume the file is cut back to the checkpoint's step, so it always reads as one run.
    ``wandb``: the same rows' numbers (under the same names) and the validation images go to a W&B
    run in ``<out_dir>/wandb`` (``$WANDB_DIR/wandb`` when that is set, as W&B itself would); a resumed
    run continues it (its id is kept with the run, in ``<out_dir>/wandb/run-id``).
    """

    def __init__(self, out_dir: Path, enabled: bool, start_step: int, max_steps: int, tensorboard: bool, progress_bar: bool,
                 every: int = 1, wandb: WandbConfig | None = None, run_config: dict | None = None):
        self.enabled = enabled
        self.every = max(1, every)
        self.path = out_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
        self.wandb = None
        self._last = time.perf_counter()
        if not enabled:
            return
        rows = []
        if self.path.exists():
            rows = [r for r in self.path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= start_step]
        self.path.write_text("".join(r + "\n" for r in rows))
        self.file = self.path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)
        if progress_bar:
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if wandb is not None:
            self.wandb = _start_wandb(out_dir, wandb, run_config)
            self._last = time.perf_counter()  # the first step's time is the step's, not W&B's start-up

    def log(self, step: int, loss: float, lr: float, grad_norm: float, extra: dict | None = None) -> None:
        """``extra``: more fields of the row (numbers also go to TensorBoard), e.g. a pretraining
        stage's name and REPA term."""
        if not self.enabled:
            return
        now = time.perf_counter()
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": now - self._last, **(extra or {})}
        self._last = now
        if step % self.every == 0:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()  # readable while training runs (and after a kill -9)
            if self.writer is not None:
                self.writer.add_scalar("train/loss", loss, step)
                self.writer.add_scalar("train/lr", lr, step)
                self.writer.add_scalar("train/grad_norm", grad_norm, step)
                for key, value in (extra or {}).items():
                    if isinstance(value, (int, float)):
                        self.writer.add_scalar(f"train/{key}", value, step)
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}, step=step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            self.bar.update(1)

    def add_images(self, tag: str, images, step: int) -> None:
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: [wandb.Image(image) for image in images]}, step=step)
        if self.writer is None:
            return
        import numpy as np

        for i, image in enumerate(images):
            self.writer.add_image(f"{tag}/{i}", np.asarray(image), step, dataformats="HWC")

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(out_dir: Path, config: WandbConfig, run_config: dict | None):
    """The W&B run of ``out_dir`` (created, or continued by a resumed run)."""
    import wandb

    folder = out_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run-id"
    if not id_file.exists():
        id_file.write_text(secrets.token_hex(4))  # W&B run ids: lowercase letters and digits
    # No console capture, code or git snapshot: the run's own files (config, metrics) say what ran.
    settings = wandb.Settings(console="off", silent=True, save_code=False, disable_git=True, x_disable_stats=True)
    files = os.environ.get("WANDB_DIR") or str(out_dir)  # W&B's own default, else beside the run
    return wandb.init(project=config.project, name=config.run_name or out_dir.name, mode=config.mode, dir=files,
                      id=id_file.read_text().strip(), resume="allow", config=run_config, settings=settings)


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
