"""The frozen reference every post-training method compares against: the base weights.

* LoRA: the trained model itself with its adapters switched off for the call; no second copy.
* Full: a frozen transformer built like the trained one (:func:`finetune.model.build_sharded_transformer`
  with ``trainable=False``): on several processes an FSDP2-sharded module holding 1/N of the base
  weights per rank, in ``model.dtype``, with no gradients and no optimizer state; each block is
  gathered for its forward only and the root is resharded after every call. It is DPO's
  reference, GRPO's KL anchor and the distillation teacher.

Every call runs under the run's precision policy (:meth:`finetune.engine.runtime.Runtime.autocast`),
the one the trained model's forwards use: a comparison between the two measures the weights, not
bf16 against float32 (with LoRA B = 0 the reference and the model give the same bits).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from ..engine.parallel import unwrap


class Reference:
    def __init__(self, precision: Callable[[], ContextManager], frozen: nn.Module | None = None):
        """``precision``: the run's forward precision context (``runtime.autocast``); ``frozen``: the
        full run's frozen base transformer, ``None`` for LoRA (adapters off)."""
        self.precision = precision
        self.frozen = frozen

    @contextlib.contextmanager
    def _base(self, model: nn.Module):
        if self.frozen is not None:
            try:
                yield self.frozen
            finally:
                if hasattr(self.frozen, "reshard"):  # FSDP2 keeps a root gathered after its forward
                    self.frozen.reshard()
            return
        inner = unwrap(model)
        inner.disable_adapters()
        try:
            yield inner
        finally:
            inner.enable_adapters()

    @torch.no_grad()
    def __call__(self, model: nn.Module, **inputs) -> torch.Tensor:
        """The base weights' velocity (B, N, C) for the transformer's keyword ``inputs``
        (``model`` is the trained module: with LoRA, the reference lives inside it)."""
        with self._base(model) as base, self.precision():
            return base(**inputs, return_dict=False)[0].float()
