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
    mixed_precision: str = "no"
    """The resolved ``training.mixed_precision`` (``auto`` chosen by the device): ``"bf16"`` or ``"no"``."""

    def _collective_device(self):
        """Where a collective's tensor must live: the GPU under NCCL, the CPU under gloo."""
        return self.device if dist.get_backend() == "nccl" else "cpu"

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
        tensor = torch.tensor([value], dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return float(tensor.item())

    def means(self, values: dict[str, float]) -> dict[str, float]:
        """Average each float over processes in one all-reduce (per-process means of equally many
        samples -> the global batch's means, for logging)."""
        if self.world_size == 1 or not values:
            return dict(values)
        tensor = torch.tensor(list(values.values()), dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return dict(zip(values, (tensor / self.world_size).tolist()))

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's ``values`` (n, ...), the same shape everywhere, concatenated in rank order
        (world_size * n, ...) on the CPU, detached: the global batch's samples, e.g. for statistics
        a mean of per-process values cannot give (a standard deviation)."""
        values = values.detach()
        if self.world_size == 1:
            return values.cpu()
        values = values.to(self._collective_device())
        parts = [torch.empty_like(values) for _ in range(self.world_size)]
        dist.all_gather(parts, values)
        return torch.cat(parts).cpu()

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (e.g. a stop request)."""
        if self.world_size == 1:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def autocast(self):
        """The precision policy of every forward of a training step: the trained model's, its
        frozen reference / teacher's, rollouts' and any auxiliary model's (``training.mixed_precision``
        resolved to ``bf16``: bf16 autocast, on CUDA or the CPU, over float32 trainable weights and
        optimizer state; ``no``: a no-op). Comparing two forwards made under different
        policies measures the policy, not the weights: enter this around each of them (the
        post-training ``Reference`` does so itself)."""
        return self.accelerator.autocast()


def resolve_precision(mixed_precision: str, where: str = "training.mixed_precision"):
    """The :class:`~krea2_diffusers.precision.ComputeDtype` a config's ``auto | no | bf16`` means on
    this process's device (CUDA when available, else the CPU, as the Accelerator below picks)."""
    from krea2_diffusers.precision import training_precision

    return training_precision(mixed_precision, "cuda" if torch.cuda.is_available() else "cpu", where)


def make_accelerator(mixed_precision: str, where: str = "training.mixed_precision"):
    """(Accelerator, resolved ``"bf16" | "no"``). The main process prints the choice and why.
    Accelerate's ``mixed_precision="bf16"`` with ``cpu=True`` is CPU bf16 autocast."""
    from accelerate import Accelerator

    chosen = resolve_precision(mixed_precision, where)
    accelerator = Accelerator(mixed_precision=chosen.mixed_precision, cpu=not torch.cuda.is_available())
    if accelerator.is_main_process:
        print(chosen.describe(), flush=True)
    return accelerator, chosen.mixed_precision


def setup_runtime(config: TrainConfig) -> Runtime:
    accelerator, mixed_precision = make_accelerator(config.training.mixed_precision)
    world = accelerator.num_processes
    strategy = config.parallel.strategy
    if strategy == "auto":
        strategy = "fsdp" if config.training.method == "full" else "ddp"
    if world == 1:
        strategy = "single"
    return Runtime(accelerator, accelerator.device, accelerator.process_index, world, strategy, mixed_precision)
