"""Our transformer block, declared to diffusers' cache hooks and to cache-dit, once.

Both libraries find a model's repeated blocks by their container (``transformer_blocks``, a
``ModuleList``) and then need the block's calling convention: which argument is the hidden state,
what the block returns, and (cache-dit) whether CFG's branches come as separate transformer calls.

:class:`~krea2_diffusers.models.transformer.Krea2Block` is single-stream: text, image and
reference tokens travel as ONE sequence, ``forward(hidden_states, time_modulation, rope,
attention_bias, ...)`` returns only the new hidden states, and there is no
``encoder_hidden_states``. For diffusers that is ``return_hidden_states_index=0`` and
``return_encoder_hidden_states_index=None`` (what it records for its own single-stream blocks, e.g.
Z-Image's); for cache-dit it is ``ForwardPattern.Pattern_3`` (hidden states in, hidden states out).

CFG: our pipeline runs both branches as ONE batched call (``pipe.batch_cfg``, the default), so
cache-dit must not take every second call for the "CFG branch" (its adapter for
``diffusers.Krea2Pipeline`` declares diffusers' separate calls; both classes are called
``Krea2Pipeline``, and cache-dit picks adapters by class name). :func:`krea2_block_adapter`
therefore answers for the name ``Krea2``: our pipelines get ``has_separate_cfg = not
pipe.batch_cfg``, diffusers' own get cache-dit's adapter unchanged.

diffusers defines its block registry in ``diffusers.hooks._helpers`` (a private module by name: its
own blocks are registered there); the registry and its metadata class are imported here from
``diffusers.hooks.sea_cache``, the public hook module that reads them.
"""

from __future__ import annotations

import functools
import importlib.util

# Why each diffusers cache config our transformer refuses does not apply to it.
UNSUPPORTED_CONFIGS = {
    "FasterCacheConfig": (
        "FasterCache does not apply to Krea 2's transformer: its attention hooks attach only to diffusers' attention "
        "classes (ours is the project's own grouped-query attention, so they would silently do nothing); its "
        "unconditional-branch skip splits the batch as [uncond, cond] and slices only named tensors "
        "(hidden_states, timestep, ...), while our pipeline batches [cond, uncond] with the text in a prepared "
        "`conditioning`; and its frequency split runs a 2-D FFT over image-shaped outputs (BCHW / BCFHW), while ours "
        "are packed tokens (B, N, 64). Use FirstBlockCacheConfig, TaylorSeerCacheConfig or MagCacheConfig, or "
        "guidance_interval to skip the unconditional branch."),
    "PyramidAttentionBroadcastConfig": (
        "Pyramid Attention Broadcast hooks only diffusers' attention classes; Krea 2's transformer uses its own "
        "attention, so it would silently do nothing. Use FirstBlockCacheConfig, TaylorSeerCacheConfig or MagCacheConfig."),
}


def check_cache_config(config) -> None:
    """Refuse, with the reason, a diffusers cache config that cannot work on our transformer."""
    reason = UNSUPPORTED_CONFIGS.get(type(config).__name__)
    if reason is not None:
        raise ValueError(reason)


def register_block(block_cls: type, model_cls: type) -> None:
    """Declare ``block_cls`` (our Krea2Block) to diffusers' block registry, and the blocks of ``model_cls``
    (our Krea2Transformer2DModel) to cache-dit when it is installed."""
    from diffusers.hooks.sea_cache import TransformerBlockMetadata, TransformerBlockRegistry

    TransformerBlockRegistry.register(
        model_class=block_cls,
        metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
    )
    if importlib.util.find_spec("cache_dit") is not None:
        from cache_dit import BlockAdapterRegister
        from cache_dit.caching import block_adapters  # noqa: F401  (cache-dit's own adapters first: ours replaces "Krea2")

        BlockAdapterRegister.register("Krea2")(functools.partial(krea2_block_adapter, model_cls=model_cls))


def krea2_block_adapter(pipe, model_cls: type, **kwargs):
    """cache-dit's ``BlockAdapter`` for any pipeline (or bare transformer) whose class name starts with ``Krea2``.

    Ours (a ``model_cls``, :class:`~krea2_diffusers.models.transformer.Krea2Transformer2DModel`, inside): the
    blocks, Pattern_3, and the CFG layout the pipeline really uses (``has_separate_cfg=False`` while
    ``pipe.batch_cfg``; a bare transformer, unknown to cache-dit, counts as batched). diffusers': cache-dit's
    own adapter, unchanged (the peer we compare with).
    """
    from cache_dit import BlockAdapter, ForwardPattern
    from cache_dit.caching.block_adapters import krea2_adapter

    if not isinstance(getattr(pipe, "transformer", None), model_cls):
        return krea2_adapter(pipe, **kwargs)
    return BlockAdapter(pipe=pipe, transformer=pipe.transformer, blocks=pipe.transformer.transformer_blocks,
                        forward_pattern=ForwardPattern.Pattern_3, check_forward_pattern=True,
                        has_separate_cfg=not getattr(pipe, "batch_cfg", True), **kwargs)
