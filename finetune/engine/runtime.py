"""Processes and devices: one :class:`Runtime` per process, whatever started it.

Accelerate owns the process group (``accelerate launch`` / ``torchrun`` / a single process; NCCL
on GPUs, gloo on CPU), the device and autocast: both launchers end in the same
``Accelerator()``, so there is one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from ..config import TrainConfig


@dataclass
class Runtime:
    accelerator: object
    device: torch.device
    rank: int
    world_size: int
    strategy: str  # "single", "ddp" or "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over processes (for logging and the NaN check)."""
        if self.world_size == 1:
            return value.detach()
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def sum(self, value: float) -> float:
        """Sum a Python float over processes (e.g. per-sample losses of one optimizer step)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return float(tensor.item())

    def means(self, values: dict[str, float]) -> dict[str, float]:
        """Average each float over processes in one all-reduce (per-process means of equally many
        samples -> the global batch's means, for logging)."""
        if self.world_size == 1 or not values:
            return dict(values)
        tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return dict(zip(values, (tensor / self.world_size).tolist()))

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (e.g. a stop request)."""
        if self.world_size == 1:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def autocast(self):
        """The precision policy of every forward of a training step: the trained model's, its
        frozen reference / teacher's, rollouts' and any auxiliary model's (``training.mixed_precision:
        bf16``: bf16 autocast; ``no``: a no-op). Comparing two forwards made under different
        policies measures the policy, not the weights: enter this around each of them (the
        post-training ``Reference`` does so itself)."""
        return self.accelerator.autocast()


def setup_runtime(config: TrainConfig) -> Runtime:
    from accelerate import Accelerator

    accelerator = Accelerator(
        mixed_precision=config.training.mixed_precision,
        cpu=not torch.cuda.is_available(),
    )
    world = accelerator.num_processes
    strategy = config.parallel.strategy
    if strategy == "auto":
        strategy = "fsdp" if config.training.method == "full" else "ddp"
    if world == 1:
        strategy = "single"
    return Runtime(accelerator, accelerator.device, accelerator.process_index, world, strategy)
