"""The ``data`` section of a training run (:class:`finetune.config.DataConfig`): where the samples
come from (a folder, a manifest, several datasets or a synthetic set), how they are bucketed and
cached, and their paired or style references. Checked with the rest of the run's config by
:meth:`finetune.config.TrainConfig.validate`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config_paths import PATH


@dataclass
class SyntheticDataConfig:
    """A self-made dataset: ``num_prompts`` captions, each with its own distinct image."""

    num_prompts: int = 4
    images_per_prompt: int = 1
    size: int = 64


@dataclass
class StyleReferencesConfig:
    """Style-reference training: each sample is trained with other images of its style group
    (never itself) as references, through the pipeline's ``style_mode="reference"`` path."""

    enabled: bool = False
    max_references: int = 2
    """Each forward draws 1 to this many references per sample (one count for the whole forward)."""
    attention: Literal["joint", "cached"] = "joint"
    """``reference_attention`` of the transformer, as at inference."""
    strength_range: list[float] = field(default_factory=lambda: [0.3, 1.0])
    """Strengths drawn uniformly from [low, high], applied as the pipeline's log(s) attention bias."""
    resolution: int | None = 512
    """The pipeline's ``style_resolution``: all references share min(target area, resolution^2)."""


@dataclass
class DatasetConfig:
    """One entry of ``data.datasets``: its own repeats, buckets and caption rules
    (:mod:`finetune.data.datasets`, :mod:`finetune.data.captions`)."""

    path: str = field(default="", metadata=PATH)
    """Folder of images with same-name ``.txt`` captions, or a ``.jsonl`` / ``.parquet`` manifest."""
    weight: float = 1.0
    """Its share of the samples drawn: ``weight / (sum of the weights)``, whatever the datasets'
    sizes (by default every dataset is drawn equally often: 20 subject and 200 regularisation
    images train half and half, as DreamBooth pairs one class image with each instance image).
    An epoch draws every sample (image x ``repeats``) of every dataset at least once: the dataset
    with the most samples per unit of weight is drawn once per sample, the others proportionally
    more often (:func:`finetune.data.datasets.draws_per_epoch`)."""
    repeats: int = 1
    """Copies of each image in the dataset's samples, each with its own tag orders (``shuffle_tags``).
    The share is the ``weight``'s: repeats spread it over more copies (and lengthen the epoch when
    this is the dataset drawn once per sample); they no longer raise the dataset's share."""
    resolution: int | None = None
    """Its own buckets of about ``resolution**2`` pixels (default: ``data.resolution``)."""
    caption_prefix: str = ""
    """Put in front of every caption (a trigger word), joined with ", " and never shuffled."""
    shuffle_tags: bool = False
    """Shuffle the comma-separated tags of each caption, a new order per epoch (seeded). Refused with
    paired samples' ``data.references.vision_tokens`` (their instruction is encoded once)."""
    keep_tags: int = 0
    """With ``shuffle_tags``: the first ``keep_tags`` tags stay in place."""
    caption_dropout: float | None = None
    """Probability of training a sample of this dataset with the empty prompt (default: ``data.caption_dropout``)."""
    is_regularization: bool = False
    """Prior-preservation images: their loss is weighted by ``training.prior_loss_weight``."""


@dataclass
class ReferencesConfig:
    """Paired (edit / reference) training: each target image comes with 1 to ``max_references``
    reference images (``targets/NAME.png`` + ``references/NAME[_k].png``, or a manifest's
    ``references`` field; see :mod:`finetune.data.pairs`). The loss is on the target's tokens only."""

    max_references: int = 3
    """A sample with more references is refused before training."""
    max_pixels: int = 1048576
    """Each reference's latents keep its own aspect at min(its area, this) pixels (multiples of 16)."""
    vision_tokens: bool = True
    """The references enter the Qwen3-VL prompt as vision tokens (before the instruction)."""
    latents: bool = True
    """Their clean VAE latents follow the target's tokens at RoPE (k, i, j), modulated as timestep 0."""


@dataclass
class DataConfig:
    path: str | None = field(default=None, metadata=PATH)
    """Folder of images with same-name ``.txt`` captions, or a ``.jsonl`` / ``.parquet`` manifest."""
    datasets: list[DatasetConfig] = field(default_factory=list)
    """Several datasets in one run, instead of ``path`` (exactly one of the two)."""
    masks: bool | str = field(default=False, metadata=PATH)
    """Loss masks (:mod:`finetune.data.masks`): ``true``: ``NAME.mask.png`` beside each image; a folder:
    ``FOLDER/NAME.png``. White trains, black is ignored, grey weighs in between (alpha, when the mask
    has one, instead of the grey level); a sample without a mask trains everywhere."""
    synthetic: SyntheticDataConfig | None = None
    """Generate a synthetic dataset into ``path`` (or ``<output_dir>/synthetic_data``) instead."""
    resolution: int = 1024
    """Buckets hold about ``resolution**2`` pixels."""
    bucket_step: int = 16
    min_aspect_ratio: float = 0.5
    max_aspect_ratio: float = 2.0
    caption_dropout: float = 0.05
    """Probability of training a sample with the empty prompt (needed for CFG at inference)."""
    repeats: int = 1
    cache_dir: str | None = field(default=None, metadata=PATH)
    """Latent / text cache; defaults to ``<output_dir>/cache``. Reused across runs by content hash."""
    shuffle: bool = True
    num_workers: int = 2
    """DataLoader worker processes reading the cache ahead of training (0: in the training process)."""
    prefetch_factor: int = 2
    style_references: StyleReferencesConfig = field(default_factory=StyleReferencesConfig)
    references: ReferencesConfig | None = None
    """Set for paired samples (edit / reference LoRAs): a target and its reference images."""
