"""The step-cache presets behind ``krea2 generate --cache NAME``, the ComfyUI ``Krea 2 Cache`` node and the app.

``cache_preset(name, num_inference_steps=N)`` returns diffusers' config for ``fbcache``,
``taylorseer`` or ``magcache`` (pass it to ``pipe.transformer.enable_cache``);
``dbcache_preset(...)`` returns the keyword arguments of ``cache_dit.enable_cache(pipe, ...)``.
Each has a RAW setting (28-52 steps with CFG) and a Turbo one (``distilled=True``, ~8 steps).

The values below started from each method's published defaults and were then measured on a
trained Krea 2, the proving ground's digits model (``krea2-digits``; ``bench/bench_cache.py --quick
--per-digit 5``, 28 steps CFG 3 / 8 steps guidance 0, its judge; figures in the README): RAW
``taylorseer`` 3 evaluates 24 of 56 forwards, 2.2x faster, accuracy 1.00 as uncached, FD 143.8 against
147.0 (with the red-ink LoRA: 24 / 56, 1.9x, concept 0.84 against 0.82) and is the one to use;
``fbcache`` 0.08 and ``dbcache`` 0.08 skip little on this model (47.7 and 51 of 56 forwards), and
``magcache`` 0.06 on FLUX.1's ratios skips 28 of 56 (1.8x) with FD 152.1. Turbo (8 steps, guidance 0,
the same bench): ``taylorseer`` 3 evaluates 5 of 8 forwards, 1.43x, accuracy 0.90 against 0.86 uncached,
FD 31.9 against 35.8 (with the LoRA: 5 of 8, concept 0.96 as uncached); ``magcache`` 0.06 5 of 8, 1.25x,
accuracy 0.90, FD 34.5 (LoRA: concept 0.98); ``fbcache`` 0.08 and ``dbcache`` 0.08 skip no step at 8 steps
on this model (a lower threshold skips even less), so on Turbo use ``taylorseer``. Each Turbo value is the
one measured; none was tuned further.
``threshold`` replaces the preset's main knob:

========== ===================================== ================ =================
name       knob (``threshold`` / ``--cache-threshold``) RAW          Turbo
========== ===================================== ================ =================
fbcache    first block's relative residual change 0.08            0.08
taylorseer cache_interval (steps per full forward) 3               3
magcache   accumulated magnitude-ratio error      0.06             0.06
dbcache    cache-dit residual_diff_threshold      0.08             0.08
========== ===================================== ================ =================

A threshold of 0 (TaylorSeer: interval 1) never skips: the output equals the uncached one
(MagCache: except at steps whose ratio is exactly 1; its ``calibrate=True`` never skips).

* ``taylorseer`` predicts the transformer's OUTPUT (``final_layer``) from its last full forwards
  and skips every block in between (diffusers' "lite" layout, aimed at our final layer): nearly a
  full forward saved per predicted step and a few small tensors of memory. diffusers' default
  (predict each attention, run the rest) keeps ~28 x 2 full-size activations per CFG batch.
* ``magcache`` needs the model's magnitude ratios: until Krea 2's are calibrated (see
  :func:`krea2_diffusers.caching.magcache.calibrate_magcache`) FLUX.1's published ratios stand in
  (another flow-matching DiT on a similar shifted schedule); pass ``mag_ratios=`` for your model's.
"""

from __future__ import annotations

from ..presets import CACHE_METHODS

DIFFUSERS_METHODS = ("fbcache", "taylorseer", "magcache")

# (RAW, Turbo) main knob per method: the values measured on krea2-digits (the table above).
THRESHOLDS = {"fbcache": (0.08, 0.08), "taylorseer": (3, 3), "magcache": (0.06, 0.06), "dbcache": (0.08, 0.08)}

# TaylorSeer on the transformer's output: the blocks skip (zeros of the recorded shape, unused), the final layer is predicted.
TAYLORSEER_OUTPUT = dict(cache_identifiers=[r"^final_layer$"], skip_predict_identifiers=[r"^transformer_blocks\.\d+$"])


def default_threshold(name: str, distilled: bool = False) -> float:
    """The preset's main knob for RAW or Turbo (the table in the module docstring)."""
    check_method(name)
    if name == "none":
        raise ValueError('cache "none" has no threshold')
    return THRESHOLDS[name][int(bool(distilled))]


def check_method(name: str) -> None:
    if name not in CACHE_METHODS:
        raise ValueError(f"cache must be one of {CACHE_METHODS}, got {name!r}")


def cache_preset(name: str, num_inference_steps: int, *, distilled: bool = False, threshold: float | None = None,
                 mag_ratios=None):
    """diffusers' cache config of preset ``name`` (``fbcache``, ``taylorseer``, ``magcache``) for a
    ``num_inference_steps``-step generation; RAW's values, or Turbo's with ``distilled``.
    ``threshold``: the method's knob instead of the preset's (TaylorSeer: the cache interval)."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if name not in DIFFUSERS_METHODS:
        hint = " (cache-dit's: dbcache_preset)" if name == "dbcache" else ""
        raise ValueError(f"cache_preset takes one of {DIFFUSERS_METHODS}, got {name!r}{hint}")
    steps = check_steps(num_inference_steps)
    value = default_threshold(name, distilled) if threshold is None else threshold
    if name == "fbcache":
        return FirstBlockCacheConfig(threshold=check_threshold(value))
    if name == "taylorseer":
        interval = int(value)
        if interval != value or interval < 1:
            raise ValueError(f"taylorseer's threshold is its cache interval, a whole number >= 1; got {value!r}")
        warmup = 2 if distilled else max(2, round(0.1 * steps))
        return TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup, disable_cache_after_step=steps - 1,
                                     max_order=1, taylor_factors_dtype=torch.float32, **TAYLORSEER_OUTPUT)
    if mag_ratios is None:
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        mag_ratios = FLUX_MAG_RATIOS  # provisional: see the module docstring
    return MagCacheConfig(threshold=check_threshold(value), max_skip_steps=2 if distilled else 3,
                          retention_ratio=0.25 if distilled else 0.2, num_inference_steps=steps, mag_ratios=mag_ratios)


def dbcache_preset(num_inference_steps: int, num_layers: int, *, distilled: bool = False, threshold: float | None = None) -> dict:
    """``cache_dit.enable_cache(pipe, **dbcache_preset(...))``: cache-dit's DBCache with its TaylorSeer
    calibrator (order 1). ``Fn`` = a quarter of the blocks (at most cache-dit's default 8) are always computed."""
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    steps = check_steps(num_inference_steps)
    value = default_threshold("dbcache", distilled) if threshold is None else threshold
    config = DBCacheConfig(Fn_compute_blocks=max(1, min(8, num_layers // 4)), Bn_compute_blocks=0,
                           residual_diff_threshold=check_threshold(value), max_warmup_steps=max(1, min(8, steps // 4)),
                           num_inference_steps=steps)
    return dict(cache_config=config, calibrator_config=TaylorSeerCalibratorConfig(taylorseer_order=1))


def check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"num_inference_steps must be a positive integer, got {steps!r}")
    return steps


def check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"cache threshold must be a number >= 0, got {value!r}")
    return float(value)
