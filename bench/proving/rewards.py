"""The proving ground's REWARD: a small torch digit classifier trained in the bench on the reward's half
of the training split, and the plug-in ``krea2 posttrain`` calls (``{function:
"proving.rewards:DigitReward", options: {path: ...}}``, with ``bench/`` on ``PYTHONPATH``).

The reward is independent of the judge (:mod:`proving.judge`, issue 39): it learns from the other
half of the training split (:func:`proving.digits.halves`) and it is another kind of model (a SiLU
CNN on 8x8 grayscale, the scans' own resolution; the judge reads digits with a linear model on
gradient features). SiLU keeps its gradient smooth, which DRaFT back-propagates into the images;
the 8x8 area average in front of it leaves DRaFT no fine pixel pattern to fool it with (measured: a
32x32 reward was hacked, its log-probability rising while the judge's accuracy on the same samples
fell to 0). Its training adds grey paper and grey smudges (:func:`smudge`) to half the batches,
labelled as the clean digit: the full run of issue 39's review showed DRaFT's digits on grey, noisy
backgrounds and GRPO's with grey smudges, which a reward that never saw grey reads as digit
evidence. The same plug-in serves GRPO (a list of PIL images in, a list of floats out) and DRaFT (a
float tensor (B, 3, H, W) in [0, 1] in, a tensor (B,) out that carries the gradient).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .digits import NAMES
from .judge import fit_classifier, grayscale, to_tensor

REWARD_SIZE = 8
KINDS = ("prob", "log_prob")


class RewardNet(nn.Module):
    """(N, 1, 8, 8) -> logits (N, 10)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.SiLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.SiLU(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.SiLU(), nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@dataclass
class RewardModel:
    path: Path
    heldout_accuracy: float


# smudge(): the share of training images it changes, the darkest grey paper, smudges per image and
# their peak darkness and width (in 8x8 pixels).
SMUDGE_SHARE, GREY_PAPER, SMUDGES, SMUDGE_DARKNESS, SMUDGE_SIGMA = 0.5, 0.25, 2, 0.35, (0.5, 1.5)


def smudge(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Training-time grey on (N, 1, S, S) in [0, 1] (paper 1): for :data:`SMUDGE_SHARE` of the images,
    darker paper (up to :data:`GREY_PAPER`) and :data:`SMUDGES` Gaussian smudges (darkness up to
    :data:`SMUDGE_DARKNESS`, sigma in :data:`SMUDGE_SIGMA` px) anywhere, the label unchanged."""
    n, _, size, _ = x.shape
    chosen = (torch.rand(n, 1, 1, 1, generator=generator) < SMUDGE_SHARE).float()
    grey = GREY_PAPER * torch.rand(n, 1, 1, 1, generator=generator)
    rows, cols = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    blobs = torch.zeros(n, 1, size, size)
    low, high = SMUDGE_SIGMA
    for _ in range(SMUDGES):
        cy, cx = torch.rand(2, n, 1, 1, generator=generator) * size
        sigma = low + (high - low) * torch.rand(n, 1, 1, generator=generator)
        darkness = SMUDGE_DARKNESS * torch.rand(n, 1, 1, generator=generator)
        blobs[:, 0] += darkness * torch.exp(-((rows - cy) ** 2 + (cols - cx) ** 2) / (2 * sigma**2))
    return (x - chosen * (grey + blobs)).clamp(0, 1)


def train_reward(splits, path, seed: int = 2, epochs: int = 20, scans=None) -> RewardModel:
    """Train the reward classifier on the training split's images ``scans`` (indices; None: all) with
    :func:`smudge` on top of the shared augmentation; save it (safetensors, atomically) at ``path``;
    its accuracy on the held-out split is measured, never trained on."""
    from safetensors.torch import save_file

    from krea2_diffusers.files import atomic_path

    index = np.arange(len(splits.train_labels)) if scans is None else np.asarray(scans)
    torch.manual_seed(seed)
    net = RewardNet()
    inputs = grayscale(to_tensor(splits.train[index]), REWARD_SIZE)
    labels = torch.as_tensor(np.asarray(splits.train_labels)[index], dtype=torch.long)
    fit_classifier(net, inputs, labels, seed, epochs, extra_augment=smudge)
    with torch.no_grad():
        predicted = net(grayscale(to_tensor(splits.heldout), REWARD_SIZE)).argmax(1).numpy()
    accuracy = float((predicted == np.asarray(splits.heldout_labels)).mean())
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp),
                  metadata={"heldout_accuracy": repr(accuracy)})
    return RewardModel(path, accuracy)


def load_reward_net(path) -> RewardNet:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reward classifier {str(path)!r} not found (written by proving.rewards.train_reward)")
    net = RewardNet()
    net.load_state_dict(load_file(str(path)))
    return net.eval().requires_grad_(False)


def digit_of(prompt: str) -> int:
    """The prompted digit: the first digit name among the prompt's words ("a handwritten digit seven" -> 7)."""
    for word in prompt.replace(",", " ").split():
        if word in NAMES:
            return NAMES.index(word)
    raise ValueError(f"prompt {prompt!r} names no digit (one of {', '.join(NAMES)})")


class DigitReward:
    """The plug-in: per image, the reward classifier's probability (``kind: prob``, in [0, 1]) or
    log-probability (``log_prob``) of the digit its prompt names.

    ``path``: :func:`train_reward`'s file. With ``log`` (a .jsonl path) and ``judge`` (the judge's
    reader, :func:`proving.judge.reader_path`) every call also appends ``{"step", "eval", "n", "reward_mean", "accuracy"}``: the
    judge's accuracy on the very images the reward scored, with no gradient, which feeds the
    report's reward/accuracy-against-steps plot without another sampling pass. Training calls carry
    their step in ``metadata``; evaluation calls (``metadata["eval"]``) get the last step seen.
    """

    def __init__(self, path: str, kind: str = "prob", judge: str | None = None, log: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"DigitReward kind {kind!r} must be one of {KINDS}")
        self.net, self.kind = load_reward_net(path), kind
        if judge:
            from .reader import load_reader

            self.judge = load_reader(judge)
        else:
            self.judge = None
        self.log = Path(log) if log else None
        self.step = 0

    def __call__(self, images, prompts: list[str], metadata: list[dict]):
        pil = not isinstance(images, torch.Tensor)
        x = to_tensor(np.stack([np.asarray(image.convert("RGB")) for image in images])) if pil else images
        targets = torch.tensor([digit_of(p) for p in prompts], device=x.device)
        net = self.net.to(x.device)
        log_probs = F.log_softmax(net(grayscale(x.float(), REWARD_SIZE)), dim=1)
        picked = log_probs.gather(1, targets[:, None])[:, 0]
        values = picked if self.kind == "log_prob" else picked.exp()
        if self.log is not None:
            self.record(x, targets, values, metadata)
        return [float(v) for v in values.detach()] if pil else values

    @torch.no_grad()
    def record(self, x: torch.Tensor, targets: torch.Tensor, values: torch.Tensor, metadata: list[dict]) -> None:
        evaluation = any(m.get("eval") for m in metadata)
        if not evaluation:
            self.step = max(int(m.get("step", self.step)) for m in metadata)
        row = {"step": self.step, "eval": evaluation, "n": len(targets), "reward_mean": float(values.mean())}
        if self.judge is not None:
            predicted = self.judge.predict(x.detach().float().cpu())
            row["accuracy"] = float((predicted == targets.cpu().numpy()).mean())
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a", encoding="utf-8") as handle:  # an append-only log, like metrics.jsonl
            handle.write(json.dumps(row) + "\n")
