"""An exponential moving average of the trainable parameters (``training.ema``).

After every ``every_n_steps``-th optimizer step, ``ema = d * ema + (1 - d) * weights`` (float32,
what the parameters are), starting from the weights the run starts with. ``d`` is ``decay``, or with
the warm-up (``warmup``, on by default) ``min(decay, (1 + n) / (1 + n + k))`` at the update that
follows ``n`` earlier ones: ``k = 9`` is diffusers' ``EMAModel`` schedule ``(1 + n) / (10 + n)``, a
horizon of N steps sets ``k`` so that ``d`` reaches ``decay`` there (see :class:`.config.EMAConfig`).
Without it a LoRA's average remembers its zero-initialised B matrices (they keep the weight
``decay**updates`` in it, 0.61 after 500 updates at 0.999) and a B that grew steadily is exported at
about 0.21 of its trained value. ``n`` is the optimizer step over ``every_n_steps``, minus one, so
a resumed run continues the schedule from its step alone (a checkpoint holds the average and the
step, nothing more, as before the warm-up existed). The average is keyed by the parameters' checkpoint names
(:func:`finetune.engine.parallel.trainable_state`) and saved in each DCP checkpoint beside the model
(``ema.<name>``), so a resumed run continues it exactly and the export can write it instead of the
trained weights.

Sharded runs: under FSDP2 a parameter is a DTensor holding this rank's rows; its average is a
DTensor of the same placement whose local tensor is updated from the local shard alone (no
collective, no gathering), and DCP saves and reshards it like the parameter itself. With
``on_cpu`` the local tensors live in host memory (each update copies the shard out).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .config import EMAConfig


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shadow(param: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A float32 copy of ``param`` (of its local shard, wrapped as the same DTensor) on ``device``
    (None: where the parameter is)."""
    copy = local(param).detach().to(device=device, dtype=torch.float32, copy=True)
    if not hasattr(param, "to_local"):
        return copy
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(copy, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def warmup_constant(config: EMAConfig) -> float | None:
    """``k`` of the warm-up ``d = min(decay, (1 + n) / (1 + n + k))`` (None: no warm-up): 9 for
    ``warmup: true``; for a horizon of N steps the ``k`` that makes ``d`` reach ``decay`` at the
    update of step N (``n = N / every_n_steps - 1``)."""
    if config.warmup is False:
        return None
    if config.warmup is True:
        return 9.0
    return config.warmup / config.every_n_steps * (1 - config.decay) / config.decay


class EMA:
    """The average of ``params`` ({checkpoint name: parameter}, updated in place by training).

    ``state``: {name: float32 tensor}, the average, for checkpoints (saved and loaded in place).
    """

    def __init__(self, params: dict[str, torch.Tensor], config: EMAConfig):
        self.params = params
        self.decay = config.decay
        self.every = config.every_n_steps
        self.warmup = warmup_constant(config)
        device = torch.device("cpu") if config.on_cpu else None
        self.state = {name: _shadow(param, device) for name, param in params.items()}

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step ``step`` (a multiple of ``every_n_steps``)."""
        if self.warmup is None:
            return self.decay
        earlier = step // self.every - 1  # updates before this one, also across a resume
        return min(self.decay, (1 + earlier) / (1 + earlier + self.warmup))

    @torch.no_grad()
    def update(self, step: int) -> float | None:
        """After optimizer step ``step`` (1-based): fold the weights in when the step is due; returns
        the decay it used (for ``metrics.jsonl``'s ``ema_decay``), None when the step was not due."""
        if step % self.every:
            return None
        decay = self.decay_at(step)
        for name, param in self.params.items():
            average = local(self.state[name])
            weights = local(param).detach().to(average.device, torch.float32)
            average.mul_(decay).add_(weights, alpha=1.0 - decay)
        return decay

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, the parameters hold the average (for validation); afterwards, bit for bit, the
        trained weights again. The trained weights wait on the average's device."""
        stash = {}
        with torch.no_grad():
            for name, param in self.params.items():
                weights = local(param)
                stash[name] = weights.detach().to(local(self.state[name]).device, copy=True)
                weights.copy_(local(self.state[name]))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    local(param).copy_(stash[name])
