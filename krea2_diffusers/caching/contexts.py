"""The cache contexts our pipeline opens around its transformer calls.

diffusers' stateful cache hooks (``transformer.enable_cache(...)``) keep one state per context
name and refuse to run outside one; a diffusers pipeline names its calls ``"cond"`` and
``"uncond"``. Ours runs CFG's two branches as one batch, so its calls come in three layouts, each
with its own state (a cached residual of a 2-row batch cannot stand in for a 1-row one):

* ``"cond_uncond"``: both branches in one call (``pipe.batch_cfg``, CFG on);
* ``"cond"`` / ``"uncond"``: one branch (CFG off, outside a ``guidance_interval``, or ``batch_cfg=False``);
* ``"references"``: cached style/edit references run once through the blocks before the steps.

Without a diffusers cache enabled the contexts are no-ops (nothing is looked up per step).
"""

from __future__ import annotations

import contextlib

BATCHED_CFG = "cond_uncond"
CONDITIONAL = "cond"
UNCONDITIONAL = "uncond"
REFERENCES = "references"


def cache_context(transformer, name: str):
    """``transformer.cache_context(name)`` while a diffusers cache is enabled on it, else a no-op context."""
    if getattr(transformer, "is_cache_enabled", False):
        return transformer.cache_context(name)
    return contextlib.nullcontext()
