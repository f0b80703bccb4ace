"""How much transformer work a generation really evaluated, whatever skipped the rest.

Step caches skip work at different grains: First-Block Cache, MagCache and cache-dit skip whole
blocks, TaylorSeer predicts attention outputs (or the whole output), ``guidance_interval`` drops
the unconditional rows. :class:`ForwardCounter` counts what ran underneath all of them: every
block's attention (its query projection) and feed-forward call, weighted by the rows of the batch.
``forwards`` is that work in full transformer forwards of one row: a 28-step generation with
batched CFG and nothing skipped counts 56 per image, 28 without CFG.
"""

from __future__ import annotations


class ForwardCounter:
    """``with ForwardCounter(transformer) as counter: pipe(...)``; then ``counter.forwards``.

    Hooks are PyTorch forward hooks on each block's ``attn.to_q`` and ``ff`` (attach after loading
    LoRAs, which replace the projections); leaving the ``with`` removes them.
    """

    def __init__(self, transformer) -> None:
        self.blocks = list(transformer.transformer_blocks)
        self.rows = 0  # rows of a batch that went through one attention or one feed-forward
        self.handles: list = []

    def count(self, module, args, output) -> None:
        self.rows += output.shape[0]

    def __enter__(self) -> "ForwardCounter":
        for block in self.blocks:
            self.handles += [block.attn.to_q.register_forward_hook(self.count), block.ff.register_forward_hook(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def reset(self) -> None:
        self.rows = 0

    @property
    def forwards(self) -> float:
        """Full transformer forwards of one batch row evaluated since the start (or ``reset``)."""
        return self.rows / (2 * len(self.blocks))
