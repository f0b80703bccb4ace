"""The frozen reference every post-training method compares against: the base weights.

* LoRA: the trained model itself with its adapters switched off for the call; no second copy.
* Full: a frozen copy taken before training starts (DPO's reference, GRPO's KL anchor, the
  distillation teacher). On several processes each keeps its own unsharded copy.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..engine.parallel import unwrap


class Reference:
    def __init__(self, transformer: nn.Module, lora: bool, dtype: torch.dtype | None = None):
        """Call before the adapters are added / the model is prepared for full training.

        ``dtype``: storage of the full copy (default: the transformer's).
        """
        self.lora = lora
        self.copy = None
        if not lora:
            self.copy = copy.deepcopy(transformer).requires_grad_(False).eval()
            if dtype is not None:
                self.copy.to(dtype)

    @contextlib.contextmanager
    def _base(self, model: nn.Module):
        if self.copy is not None:
            yield self.copy
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
        with self._base(model) as base:
            return base(**inputs, return_dict=False)[0].float()
