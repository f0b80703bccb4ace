"""The model-backed jobs' models (captions, embeddings): random weights refused unless allowed, and
a model that cannot load turned into one clear line before any row is claimed."""

from __future__ import annotations

import logging
import sys

from .config import CurationConfig
from .server import WarehouseError

logger = logging.getLogger(__name__)


class ModelUnavailable(WarehouseError):
    """A job's model cannot be used (random weights not allowed, absent offline): the worker stops
    with this message instead of charging every row an attempt."""


def check_model(job: str, config: CurationConfig, allow_random_weights: bool) -> None:
    """Refuse a model-backed job's ``tiny-random`` unless allowed; announce it as the pipeline does
    when it is."""
    from krea2_diffusers.models.tiny import TINY_LABEL, is_tiny

    model = {"caption": config.caption.model, "embed": config.embed.model}.get(job)
    if not is_tiny(model):
        return
    if not allow_random_weights:
        raise ModelUnavailable(f"{job}.model is {TINY_LABEL}; pass --allow-random-weights to run {job} with it "
                               f"anyway, or name a real model in --config ({job}: {{model: ...}})")
    logger.warning("Loaded %s", TINY_LABEL)
    print(f"krea2 curate {job}: model: {TINY_LABEL}", file=sys.stderr)


def load_model(job: str, model: str, loader):
    """``loader(model)``, with a failure (absent offline, unknown id) turned into one clear line."""
    try:
        return loader(model)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelUnavailable(f"{job}.model {model!r} cannot be loaded ({reason}); download it first (e.g. "
                               f"`hf download {model}`), name a local folder, or use tiny-random with "
                               "--allow-random-weights for a dry run") from None
