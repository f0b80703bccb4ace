"""Progress bar, ``metrics.jsonl`` and TensorBoard, all on the main process only."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


class MetricsLogger:
    """One row per optimizer step: ``{"step", "loss", "lr", "grad_norm", "time"}``.

    On resume the file is cut back to the checkpoint's step, so it always reads as one run.
    """

    def __init__(self, out_dir: Path, enabled: bool, start_step: int, max_steps: int, tensorboard: bool, progress_bar: bool, every: int = 1):
        self.enabled = enabled
        self.every = max(1, every)
        self.path = out_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
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

    def log(self, step: int, loss: float, lr: float, grad_norm: float, extra: dict[str, float] | None = None) -> None:
        """``extra``: further scalars of this step (e.g. post-training's ``reward_mean``,
        ``heldout/margin``), written into the same row and under ``train/`` in TensorBoard."""
        if not self.enabled:
            return
        now = time.perf_counter()
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": now - self._last, **(extra or {})}
        self._last = now
        if step % self.every == 0:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()  # readable while training runs (and after a kill -9)
            if self.writer is not None:
                for name in ("loss", "lr", "grad_norm", *(extra or {})):
                    self.writer.add_scalar(f"train/{name}", row[name], step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            self.bar.update(1)

    def add_images(self, tag: str, images, step: int) -> None:
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


def read_metrics(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
