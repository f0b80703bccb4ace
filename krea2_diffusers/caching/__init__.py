"""Step caching and compiled blocks for the Krea 2 transformer, through the ecosystem's own tools.

* :mod:`.registrations`: our block's signature in diffusers' ``TransformerBlockRegistry`` (so
  ``transformer.enable_cache(FirstBlockCacheConfig | TaylorSeerCacheConfig | MagCacheConfig)`` works)
  and in cache-dit's ``BlockAdapterRegister`` (so ``cache_dit.enable_cache(pipe)`` knows our CFG
  layout), both made when :mod:`krea2_diffusers.models.transformer` is imported.
* :mod:`.contexts`: the cache contexts our pipeline opens around its transformer calls.
* :mod:`.presets`: ``cache_preset(name, num_inference_steps=N)`` and ``step_cache(pipe, ...)``, what
  ``krea2 generate --cache NAME``, the ComfyUI node and the app use; ``--compile`` is :func:`.presets.compile_blocks`.
* :mod:`.forwards`: counts the transformer work a generation really evaluated.

Import the modules themselves; this package re-exports nothing.
"""
