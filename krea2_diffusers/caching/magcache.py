"""MagCache's magnitude ratios for a Krea 2 checkpoint, measured with diffusers' own calibration mode.

``MagCacheConfig(calibrate=True)`` runs every block and, at the last step, reports the mean ratio
of each step's residual norm to the previous step's (it prints them and logs them at INFO on
``diffusers.hooks.mag_cache``). :func:`calibrate_magcache` runs one generation so and returns that
list, to pass as ``cache_preset("magcache", ..., mag_ratios=...)`` or ``MagCacheConfig(mag_ratios=...)``.
"""

from __future__ import annotations

import ast
import logging

RESULTS_PREFIX = "MagCache Calibration Results: "


class RatiosCatcher(logging.Handler):
    """Keeps the ratio lists diffusers' MagCache logs at the end of a calibrated generation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ratios: list[list[float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(RESULTS_PREFIX):
            self.ratios.append([float(x) for x in ast.literal_eval(message[len(RESULTS_PREFIX):])])


def calibrate_magcache(pipe, num_inference_steps: int, **call_kwargs) -> list[float]:
    """The magnitude ratios of ``pipe``'s transformer over one ``num_inference_steps``-step generation
    (``call_kwargs``: the rest of the pipeline call, e.g. prompt, size, guidance, generator).
    With CFG batched, one list covers both branches (they run as one call per step)."""
    from diffusers.hooks import MagCacheConfig

    logger = logging.getLogger("diffusers.hooks.mag_cache")
    catcher, level, propagate = RatiosCatcher(), logger.level, logger.propagate
    logger.addHandler(catcher)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # its INFO lines reach only the catcher (diffusers prints the ratios itself)
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=num_inference_steps))
    try:
        pipe(num_inference_steps=num_inference_steps, **call_kwargs)
    finally:
        pipe.transformer.disable_cache()
        logger.removeHandler(catcher)
        logger.setLevel(level)
        logger.propagate = propagate
    if not catcher.ratios:
        raise RuntimeError("MagCache reported no ratios: the generation ran fewer transformer calls than num_inference_steps")
    return catcher.ratios[0]
