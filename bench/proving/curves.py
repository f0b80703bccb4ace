"""Post-training curves (issue 39): every checkpoint a DPO / GRPO / DRaFT run kept, exported with
``krea2 export``, loaded onto the base and sampled at guidance 0 from the SELECTION seeds
(:attr:`proving.seeds.Seeds.select`, never the report's), then read by the judge (accuracy, FD,
diversity) and scored by the reward: FD against steps beside reward and accuracy, so the onset of
reward hacking shows, and the points :func:`proving.frontier.choose_checkpoint` chooses from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from .pretraining import checkpoint_steps

LORA_FILE = "lora_diffusers.safetensors"


def export_lora(run_dir: Path, step: int, out_dir: Path, log: Path | None = None, weights: str | None = None) -> Path:
    """``krea2 export`` of checkpoint ``step`` (diffusers LoRA) into ``out_dir`` (reused when there); the file.
    ``weights``: ``raw`` or ``ema`` (``krea2 export --weights``); None: what the run exports."""
    from .pretraining import krea2

    out_dir = Path(out_dir)
    if not (out_dir / LORA_FILE).is_file():
        shutil.rmtree(out_dir, ignore_errors=True)
        krea2("export", str(Path(run_dir) / "checkpoints" / f"step-{step}"), str(out_dir), "--format", "diffusers",
              *(["--weights", weights] if weights else []), log=log)
    return out_dir / LORA_FILE


def reward_mean(reward_path: Path, images: np.ndarray, labels: np.ndarray) -> float:
    """The reward plug-in's mean score (probability of the prompted digit) of uint8 (N, H, W, 3) images."""
    import torch

    from .digits import caption
    from .judge import to_tensor
    from .rewards import DigitReward

    with torch.no_grad():
        scores = DigitReward(str(reward_path))(to_tensor(images), [caption(d) for d in labels], [{} for _ in labels])
    return float(scores.mean())


def evaluate_run(pipe, run_dir: Path, work_dir: Path, judge, reward_path: Path, *, per_digit: int, steps: int, seed: int,
                 resolution: int, every: int, base_point: dict | None = None, log: Path | None = None) -> list[dict]:
    """[{"step", "reward", "accuracy", "fd", "diversity"}] for each scheduled checkpoint (every ``every``
    steps, :func:`proving.pretraining.checkpoint_steps`) of ``run_dir`` (and
    ``base_point`` as step 0 when given): its LoRA loaded onto ``pipe`` (the base pipeline, unloaded
    again after), ``per_digit`` samples per digit, ``steps`` Euler steps, guidance 0, sampling base ``seed``."""
    from .sampling import generate

    curve = [dict(base_point, step=0)] if base_point is not None else []
    for step in checkpoint_steps(run_dir, every):
        lora = export_lora(run_dir, step, Path(work_dir) / f"step-{step}", log=log)
        pipe.load_lora_weights(str(lora))
        try:
            images, labels = generate(None, range(10), per_digit, 0.0, steps, seed=seed, resolution=resolution, pipe=pipe)
        finally:
            pipe.unload_lora_weights()
        curve.append({"step": step, "reward": reward_mean(reward_path, images, labels), **judge.evaluate(images, labels)})
        print(f"[proving ground] {Path(run_dir).name} step-{step}: accuracy {curve[-1]['accuracy']:.3f}, "
              f"FD {curve[-1]['fd']:.2f}, reward {curve[-1]['reward']:.3f}", flush=True)
    return curve


def publish(lora_file: Path, model_dir: Path) -> Path:
    """Copy the chosen checkpoint's LoRA to ``model_dir/lora_diffusers.safetensors`` (replacing it)."""
    model_dir = Path(model_dir)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    return Path(shutil.copy2(lora_file, model_dir / LORA_FILE))
