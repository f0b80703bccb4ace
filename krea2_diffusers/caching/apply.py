"""The speed knobs applied to a pipeline, one implementation for the CLI, the ComfyUI nodes and the app.

* :func:`step_cache`: ``with step_cache(pipe, "fbcache"): pipe(...)``: a preset of
  :mod:`.presets` enabled for the calls inside, removed afterwards (diffusers' hooks through
  ``pipe.transformer.enable_cache`` / ``disable_cache``; cache-dit's DBCache through
  ``cache_dit.enable_cache`` / ``disable_cache``, which needs ``pip install krea2-diffusers[cache]``).
* :func:`compile_blocks`: ``transformer.compile_repeated_blocks(dynamic=True)``: regional
  ``torch.compile`` of the 28 identical blocks (one graph, compiled once, shared by every block),
  with dynamic sequence lengths so that a new prompt length does not recompile. A batch with a
  padding mask (CFG, or prompts of different lengths) and one without (one unpadded prompt) are two
  graphs: the first call of each layout compiles, no later step, prompt or size does.
"""

from __future__ import annotations

import contextlib

from .presets import cache_preset, check_method, dbcache_preset


@contextlib.contextmanager
def step_cache(pipe, method: str = "none", *, num_inference_steps: int | None = None, threshold: float | None = None,
               distilled: bool | None = None, mag_ratios=None):
    """Enable cache preset ``method`` (``caching.presets``) on ``pipe`` for the ``with`` block; yields the
    config (None for ``"none"``). ``num_inference_steps``: the steps the calls will run (default: the
    pipeline's preset), which TaylorSeer, MagCache and DBCache schedule by; ``distilled``: Turbo's
    preset instead of RAW's (default: ``pipe.is_distilled``). ``diffusers.Krea2Pipeline`` takes
    ``"dbcache"`` (cache-dit) with both given."""
    check_method(method)
    if method == "none":
        yield None
        return
    steps = num_inference_steps or pipe.preset.num_inference_steps
    distilled = bool(pipe.is_distilled if distilled is None else distilled)
    if method == "dbcache":
        try:
            import cache_dit
        except ImportError as err:
            raise ImportError("--cache dbcache needs cache-dit: pip install 'krea2-diffusers[cache]'") from err
        kwargs = dbcache_preset(steps, len(pipe.transformer.transformer_blocks), distilled=distilled, threshold=threshold)
        cache_dit.enable_cache(pipe, **kwargs)
        try:
            yield kwargs["cache_config"]
        finally:
            cache_dit.disable_cache(pipe)
        return
    config = cache_preset(method, steps, distilled=distilled, threshold=threshold, mag_ratios=mag_ratios)
    pipe.transformer.enable_cache(config)
    try:
        yield config
    finally:
        pipe.transformer.disable_cache()


def compile_blocks(transformer) -> None:
    """Regional compilation of the transformer's repeated blocks (see the module docstring)."""
    transformer.compile_repeated_blocks(dynamic=True)

