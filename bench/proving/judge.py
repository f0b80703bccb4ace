"""The proving ground's EVALUATION classifier (the judge), and the one small-classifier trainer.

The judge is independent of the post-training reward (:mod:`proving.rewards`, issue 39): it learns
from the other half of the training split (:func:`proving.digits.halves`; no scan teaches both,
and neither ever sees the held-out split, on which both report their accuracy), and it is another
kind of model. It READS digits with :mod:`proving.reader` (logistic regression on gradient-
orientation features, where the reward is a CNN), and it MEASURES realism with a CNN of its own
(:class:`JudgeNet`, a ReLU CNN on 16x16 grayscale, trained on the judge's half): its 64-d
penultimate activations are the feature space of the Frechet distance (to the real held-out
digits) and of the per-digit diversity, so a method that collapses each digit to one image, or
draws digits unlike the real ones, shows even when it is "accurate".

Images everywhere are uint8 (N, H, W, 3) arrays (``proving.digits.Splits``) or float tensors
(N, 3, H, W) in [0, 1]; the networks take grayscale area-resized to their own input size, so any
training resolution works and ink polarity is whatever the data uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

JUDGE_SIZE = 16
FEATURES = 64


def to_tensor(images) -> torch.Tensor:
    """uint8 (N, H, W, 3) array, or float (N, 3, H, W) in [0, 1] -> float (N, 3, H, W) in [0, 1]."""
    if isinstance(images, torch.Tensor):
        return images.float()
    array = np.asarray(images)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"images must be (N, H, W, 3) uint8, got shape {array.shape}")
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() / 255.0


def grayscale(images: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> (N, 1, size, size): channel mean, area-resized (differentiable)."""
    gray = images.mean(1, keepdim=True)
    if gray.shape[-1] != size or gray.shape[-2] != size:
        gray = F.interpolate(gray, size=(size, size), mode="area")
    return gray


class JudgeNet(nn.Module):
    """(N, 1, 16, 16) -> logits (N, 10); ``features`` gives the (N, 64) penultimate activations."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, FEATURES), nn.ReLU(),
        )
        self.head = nn.Linear(FEATURES, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Training-time jitter on (N, 1, S, S) in [0, 1]: a shift of up to S/16 pixels, contrast and
    brightness changes and pixel noise, so the classifiers judge generated digits (slightly off
    centre, soft, noisy) by their shape rather than by the scans' exact pixels."""
    n, _, size, _ = x.shape
    pad = max(1, size // 16)
    padded = F.pad(x, (pad, pad, pad, pad), mode="replicate")
    dx, dy = torch.randint(0, 2 * pad + 1, (2, n), generator=generator).tolist()
    shifted = torch.stack([padded[i, :, dy[i]:dy[i] + size, dx[i]:dx[i] + size] for i in range(n)])
    scale = 1 + 0.3 * (torch.rand(n, 1, 1, 1, generator=generator) - 0.5)
    offset = 0.1 * (torch.rand(n, 1, 1, 1, generator=generator) - 0.5)
    noise = 0.05 * torch.randn(shifted.shape, generator=generator)
    mean = shifted.mean((1, 2, 3), keepdim=True)
    return ((shifted - mean) * scale + mean + offset + noise).clamp(0, 1)


def fit_classifier(net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, seed: int,
                   epochs: int, learning_rate: float = 3e-3, batch_size: int = 64, extra_augment=None) -> nn.Module:
    """Train ``net`` on ``inputs`` (N, 1, S, S) with int ``labels`` (N,): Adam, cross-entropy,
    :func:`augment` (then ``extra_augment(x, generator)`` if given) on every batch, cosine-decayed
    learning rate. Returns it in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=learning_rate)
    batches = epochs * -(-len(inputs) // batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, batches)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(inputs), batch_size):
            index = order[start:start + batch_size]
            x = augment(inputs[index], generator)
            if extra_augment is not None:
                x = extra_augment(x, generator)
            loss = F.cross_entropy(net(x), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return net.eval()


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to feature sets a (N, D) and b (M, D):
    |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2), in float64 through symmetric
    eigendecompositions (exact for PSD matrices, no complex sqrtm round-off)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Frechet distance needs at least 2 samples per set, got {len(a)} and {len(b)}")
    mu = a.mean(0) - b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    values, vectors = np.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(values.clip(0))) @ vectors.T
    cross = np.linalg.eigvalsh(root_a @ cov_b @ root_a).clip(0)
    # Identical sets give 0 up to round-off of order 1e-4 (trace ~ 1e2 in float64 eigh): never below 0.
    return max(0.0, float(mu @ mu + np.trace(cov_a) + np.trace(cov_b) - 2 * np.sqrt(cross).sum()))


def diversity(features: np.ndarray, labels: np.ndarray) -> float:
    """Mean pairwise Euclidean distance between features (N, D) of samples of the same label,
    averaged over labels with at least 2 samples (0 for a set collapsed to one point per label)."""
    features, labels = np.asarray(features, np.float64), np.asarray(labels)
    means = []
    for label in np.unique(labels):
        group = features[labels == label]
        if len(group) < 2:
            continue
        distances = np.sqrt(((group[:, None] - group[None]) ** 2).sum(-1))
        means.append(distances.sum() / (len(group) * (len(group) - 1)))
    if not means:
        raise ValueError("diversity needs at least 2 samples of one label")
    return float(np.mean(means))


@dataclass
class Judge:
    """The judge: ``reader`` reads the digit (accuracy), ``net`` gives the features of FD and diversity,
    compared with the real held-out digits' ``heldout_features``. ``heldout_accuracy`` is the reader's on
    the held-out scans, ``features_heldout_accuracy`` the feature CNN's own."""

    net: JudgeNet
    reader: object
    heldout_accuracy: float
    heldout_features: np.ndarray
    heldout_diversity: float
    features_heldout_accuracy: float = 0.0

    @torch.no_grad()
    def features(self, images) -> np.ndarray:
        """images (N, H, W, 3) uint8 or (N, 3, H, W) in [0, 1] -> the feature CNN's (N, 64)."""
        x = grayscale(to_tensor(images), JUDGE_SIZE)
        return torch.cat([self.net.features(chunk) for chunk in x.split(256)]).numpy()

    def predict(self, images) -> np.ndarray:
        """int64 (N,): the digit the reader reads in each image."""
        return self.reader.predict(images)

    def accuracy(self, images, labels) -> float:
        return float((self.predict(images) == np.asarray(labels)).mean())

    def evaluate(self, images, labels) -> dict[str, float]:
        """{"accuracy": share read as ``labels`` (N,), "fd": Frechet distance to the real held-out
        digits in the feature CNN's space, "diversity": :func:`diversity` there}."""
        features, labels = self.features(images), np.asarray(labels)
        return {"accuracy": self.accuracy(images, labels),
                "fd": frechet_distance(features, self.heldout_features),
                "diversity": diversity(features, labels)}

    def save(self, path) -> None:
        """The feature CNN at ``path`` and the reader beside it (``<stem>_reader.safetensors``),
        safetensors (never pickled), atomically; :func:`load_judge_net` / ``reader.load_reader`` read them."""
        from safetensors.torch import save_file

        from krea2_diffusers.files import atomic_path

        path = Path(path)
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in self.net.state_dict().items()}, str(tmp),
                      metadata={"heldout_accuracy": repr(self.features_heldout_accuracy)})
        self.reader.save(reader_path(path))


def reader_path(path) -> Path:
    """Where :meth:`Judge.save` puts the reader of the judge saved at ``path``."""
    path = Path(path)
    return path.with_name(f"{path.stem}_reader.safetensors")


def load_judge_net(path) -> JudgeNet:
    """The judge's feature network from :meth:`Judge.save`'s file."""
    from safetensors.torch import load_file

    net = JudgeNet()
    net.load_state_dict(load_file(str(path)))
    return net.eval()


def train_judge(splits, seed: int = 1, epochs: int = 40, scans=None) -> Judge:
    """Train the judge on the training split's images ``scans`` (indices; None: all of them): the reader
    and the feature CNN; measure both on the held-out split, whose CNN features become the FD reference."""
    from .reader import fit_reader

    index = np.arange(len(splits.train_labels)) if scans is None else np.asarray(scans)
    images, labels = splits.train[index], np.asarray(splits.train_labels)[index]
    torch.manual_seed(seed)
    net = JudgeNet()
    fit_classifier(net, grayscale(to_tensor(images), JUDGE_SIZE), torch.as_tensor(labels, dtype=torch.long), seed, epochs)
    judge = Judge(net, fit_reader(images, labels, seed), 0.0, np.zeros((0, FEATURES)), 0.0)
    heldout_labels = np.asarray(splits.heldout_labels)
    features = judge.features(splits.heldout)
    with torch.no_grad():
        cnn = net.head(torch.from_numpy(features)).argmax(1).numpy()
    judge.heldout_accuracy = judge.accuracy(splits.heldout, heldout_labels)
    judge.features_heldout_accuracy = float((cnn == heldout_labels).mean())
    judge.heldout_features = features
    judge.heldout_diversity = diversity(features, heldout_labels)
    return judge


def run_judge(splits, seeds, epochs: int) -> Judge:
    """The judge of the proving-ground run with :class:`proving.seeds.Seeds` ``seeds``, trained again as
    the run trained it (its half of the training scans, its seed; deterministic): what the run's own
    measures use, for the scripts that judge a finished run."""
    from .digits import halves

    return train_judge(splits, seed=seeds.judge, epochs=epochs, scans=halves(splits.train_labels, seeds.halves)[0])
