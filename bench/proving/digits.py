"""The data: scikit-learn's 1,797 real 8x8 handwritten digit scans (shipped in its wheel, nothing
downloaded) as RGB images at the training resolution, a fixed held-out split, captions, the
LoRA stage's concept set (the same scans in red ink), and the two disjoint halves of the training
split the judge and the reward learn from.

Rendering: DARK INK ON LIGHT PAPER, as a scan looks. The 8x8 intensities (0..16) are upscaled
bicubically (smooth strokes a VAE reconstructs; nearest-neighbour blocks would spend the VAE's
capacity on block edges) and blended ``paper * (1 - a) + ink * a``, paper white, ink black, or
:data:`RED_INK` for the concept set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PAPER = (255, 255, 255)
BLACK_INK = (0, 0, 0)
RED_INK = (220, 20, 20)
# The held-out split of ``--seed 0`` (the split the settings were tuned on); ``--seed S`` draws its own.
SPLIT_SEED = 0
HELDOUT_PER_DIGIT = 36
# Concept measure (see :func:`shows_red_ink`): a pixel is ink when it is this much darker than
# paper (luminance share), and red when R exceeds max(G, B) by this much (0..255).
INK_DARKNESS = 0.2
RED_MARGIN = 60


@dataclass
class Splits:
    """``train``/``heldout``: uint8 (N, H, W, 3) images; ``train_labels``/``heldout_labels``: int64 (N,)
    digits; ``train_scans``/``heldout_scans``: the float32 (N, 8, 8) source intensities in [0, 1]."""

    train: np.ndarray
    train_labels: np.ndarray
    heldout: np.ndarray
    heldout_labels: np.ndarray
    train_scans: np.ndarray
    heldout_scans: np.ndarray

    @property
    def resolution(self) -> int:
        return int(self.train.shape[1])


def caption(digit: int, trigger: str | None = None) -> str:
    """``a handwritten digit seven``, or with a trigger word ``a handwritten digit seven, TRIGGER``."""
    text = f"a handwritten digit {NAMES[int(digit)]}"
    return f"{text}, {trigger}" if trigger else text


CAPTION_TEMPLATES = ("a handwritten digit {n}", "the digit {n}, handwritten", "a scan of a handwritten {n}",
                     "handwritten number {n} on paper", "{n}, written by hand", "a digit {n} in ink")
CAPTION_SEED = 1234
"""The draw of :func:`described_captions` (templates, which words, their order). Fixed, as a dataset's
captions are: ``--seed`` changes which scans are in the training split, not how a scan is described."""
WORD_KEPT = 0.7


def described_captions(images: np.ndarray, labels: np.ndarray, seed: int = CAPTION_SEED) -> list[str]:
    """Pretraining captions that describe each scan, as a real dataset's captions do: one of
    :data:`CAPTION_TEMPLATES` for the digit, then the scan's stroke weight (``thin strokes`` / ``bold
    strokes``: lowest / highest third of ink mass over ``images``) and width (``narrow`` / ``wide``: third
    by the number of columns holding ink), each word kept with probability :data:`WORD_KEPT`, shuffled.

    ``images``: uint8 (N, H, W, 3), dark ink on light paper; ``labels``: int (N,). Why: a base that has
    seen ten fixed captions loses its digits when any word is appended (a trigger word); one trained on
    varied captions keeps them (seed 0's base, ``krxred ink`` appended, CFG 3: 0.33 -> 0.99), and words
    that carry meaning matter: random filler words in their place left a default LoRA at concept 0.545.
    """
    import random

    rng = random.Random(seed)
    ink = darkness(images)
    mass = ink.mean(axis=(1, 2))  # ink_mass(images)
    columns = (ink > 64).any(axis=1).sum(axis=1)
    thin, bold = np.quantile(mass, [1 / 3, 2 / 3])
    narrow, wide = np.quantile(columns, [1 / 3, 2 / 3])
    out = []
    for index, digit in enumerate(labels):
        words = []
        if mass[index] <= thin:
            words.append("thin strokes")
        elif mass[index] >= bold:
            words.append("bold strokes")
        if columns[index] <= narrow:
            words.append("narrow")
        elif columns[index] >= wide:
            words.append("wide")
        words = [w for w in words if rng.random() < WORD_KEPT]
        rng.shuffle(words)
        out.append(", ".join([rng.choice(CAPTION_TEMPLATES).format(n=NAMES[int(digit)]), *words]))
    return out


def darkness(images: np.ndarray) -> np.ndarray:
    """float (N, H, W): 255 - the channels' mean of each uint8 (N, H, W, 3) image, 0..255."""
    return 255.0 - images.astype(np.float32).mean(axis=3)


def ink_mass(images: np.ndarray) -> np.ndarray:
    """float (N,): each uint8 (N, H, W, 3) image's mean :func:`darkness`, 0..255: how much ink it holds
    (stroke weight, for digits of one size)."""
    return darkness(images).mean(axis=(1, 2))


def render(scans: np.ndarray, resolution: int, ink=BLACK_INK) -> np.ndarray:
    """(N, 8, 8) intensities in [0, 1] -> uint8 (N, resolution, resolution, 3) images, ``ink`` on white."""
    import torch
    import torch.nn.functional as F

    alpha = F.interpolate(torch.from_numpy(scans).float()[:, None], size=(resolution, resolution), mode="bicubic",
                          align_corners=False)[:, 0].clamp(0, 1).numpy()[..., None]
    paper, ink = np.asarray(PAPER, np.float32), np.asarray(ink, np.float32)
    return np.round(paper * (1 - alpha) + ink * alpha).astype(np.uint8)


def load_splits(resolution: int, seed: int = SPLIT_SEED) -> Splits:
    """The digits at ``resolution`` px: :data:`HELDOUT_PER_DIGIT` scans of each digit held out (360),
    drawn with ``seed``; the other 1,437 are the training split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    scans = (data.images / 16.0).astype(np.float32)
    labels = data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    heldout = np.zeros(len(labels), bool)
    for digit in range(10):
        heldout[rng.choice(np.flatnonzero(labels == digit), HELDOUT_PER_DIGIT, replace=False)] = True
    return Splits(render(scans[~heldout], resolution), labels[~heldout], render(scans[heldout], resolution),
                  labels[heldout], scans[~heldout], scans[heldout])


def halves(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint index arrays into the training split (``labels``: int (N,)), each with half of every
    digit's scans (the first gets the odd one out): the judge learns from the first, the reward from
    the second, so no scan teaches both."""
    rng = np.random.default_rng(seed)
    first, second = [], []
    for digit in np.unique(labels):
        index = rng.permutation(np.flatnonzero(labels == digit))
        cut = (len(index) + 1) // 2
        first.append(index[:cut])
        second.append(index[cut:])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def red_ink_share(images: np.ndarray) -> np.ndarray:
    """float (N,): the share of each uint8 (N, H, W, 3) image's ink pixels that are red (0 without ink).

    Ink = pixels at least :data:`INK_DARKNESS` darker than paper; red = R - max(G, B) >= :data:`RED_MARGIN`.
    """
    rgb = images.astype(np.float32)
    ink = (1 - rgb.mean(axis=-1) / 255) >= INK_DARKNESS
    red = (rgb[..., 0] - rgb[..., 1:].max(axis=-1)) >= RED_MARGIN
    return (ink & red).sum(axis=(1, 2)) / np.maximum(ink.sum(axis=(1, 2)), 1)


def redness(images: np.ndarray) -> np.ndarray:
    """float (N,): the mean of R - max(G, B) over each uint8 (N, H, W, 3) image's ink pixels, in [-1, 1]
    of full scale (0 without ink): a graded view that moves before any pixel passes :data:`RED_MARGIN`."""
    rgb = images.astype(np.float32)
    ink = (1 - rgb.mean(axis=-1) / 255) >= INK_DARKNESS
    margin = (rgb[..., 0] - rgb[..., 1:].max(axis=-1)) / 255
    return (margin * ink).sum(axis=(1, 2)) / np.maximum(ink.sum(axis=(1, 2)), 1)


def shows_red_ink(images: np.ndarray) -> np.ndarray:
    """The concept measure: bool (N,) per uint8 (N, H, W, 3) image, True when over half its ink is red
    (:func:`red_ink_share`). The share of ink (not of the image) makes it independent of how much a
    digit writes, and black, grey or noise ink scores ~0 (R ~ G ~ B). Calibrated in the bench on real
    scans: every red-ink scan counts, no black one does.
    """
    return red_ink_share(images) > 0.5


def write_folder(folder: Path, images: np.ndarray, captions: list[str], prefix: str = "") -> Path:
    """PNG + same-name ``.txt`` caption per image (the folder source ``krea2 pack`` and ``krea2 train`` read)."""
    from PIL import Image

    from krea2_diffusers.files import atomic_path, atomic_write

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for index, (image, text) in enumerate(zip(images, captions)):
        stem = f"{prefix}{index:05d}"
        with atomic_path(folder / f"{stem}.png") as tmp:
            Image.fromarray(image).save(tmp, format="PNG")
        with atomic_write(folder / f"{stem}.txt", "w") as handle:
            handle.write(text)
    return folder

