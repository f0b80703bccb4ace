"""An exponential moving average of the trainable parameters (``training.ema``).

After every ``every_n_steps``-th optimizer step, ``ema = decay * ema + (1 - decay) * weights``
(float32, what the parameters are), starting from the weights the run starts with. The average is
keyed by the parameters' checkpoint names (:func:`finetune.engine.parallel.trainable_state`) and
saved in each DCP checkpoint beside the model (``ema.<name>``), so a resumed run continues it
exactly and the export can write it instead of the trained weights.

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


class EMA:
    """The average of ``params`` ({checkpoint name: parameter}, updated in place by training).

    ``state``: {name: float32 tensor}, the average, for checkpoints (saved and loaded in place).
    """

    def __init__(self, params: dict[str, torch.Tensor], config: EMAConfig):
        self.params = params
        self.decay = config.decay
        self.every = config.every_n_steps
        device = torch.device("cpu") if config.on_cpu else None
        self.state = {name: _shadow(param, device) for name, param in params.items()}

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """After optimizer step ``step`` (1-based): fold the weights in when the step is due."""
        if step % self.every:
            return False
        for name, param in self.params.items():
            average = local(self.state[name])
            weights = local(param).detach().to(average.device, torch.float32)
            average.mul_(self.decay).add_(weights, alpha=1.0 - self.decay)
        return True

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
