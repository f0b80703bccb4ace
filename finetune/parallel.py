"""Processes, devices and model wrapping, on Accelerate and torch's FSDP2.

Accelerate owns the process group (``accelerate launch`` / ``torchrun`` / a single process; NCCL
on GPUs, gloo on CPU), the device and autocast. The model is wrapped in the order torchtitan uses:
gradient checkpointing, then ``torch.compile`` per block, then the parallel wrapper, because
FSDP2's hooks must see the compiled blocks and checkpointing must sit inside compilation.

* LoRA: DDP (the adapters are small; every process keeps the full frozen base).
* Full fine-tune: FSDP2 ``fully_shard`` on every transformer block, then on the root, so one
  block's parameters are gathered at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig


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

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (e.g. a stop request)."""
        if self.world_size == 1:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def autocast(self):
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


def wrap_model(transformer: nn.Module, config: TrainConfig, runtime: Runtime) -> nn.Module:
    """Gradient checkpointing -> compile -> DDP/FSDP2. Returns the module to call for training."""
    if config.training.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if config.training.compile:
        for block in transformer.transformer_blocks:
            block.compile()
    if runtime.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if config.training.mixed_precision == "bf16":
            # bf16 compute and all-gathers, fp32 gradient reduction and master weights.
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in transformer.transformer_blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(transformer, mp_policy=policy)
        return transformer
    if runtime.strategy == "ddp":
        return runtime.accelerator.prepare_model(transformer)
    return transformer.to(runtime.device)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformer under a DDP wrapper (FSDP2 wraps in place, so it is the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def no_sync(model: nn.Module, runtime: Runtime, sync: bool):
    """Skip the gradient all-reduce on accumulation micro-steps that do not end an optimizer step."""
    if sync or runtime.strategy != "ddp":
        return contextlib.nullcontext()
    return model.no_sync()


@contextlib.contextmanager
def gathered(model: nn.Module, runtime: Runtime):
    """Make an FSDP2 root's own parameters whole for code that calls methods other than ``forward``
    (the pipeline runs ``prepare_conditioning`` directly). Every process must enter together."""
    if runtime.strategy != "fsdp":
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def full_state_dict(model: nn.Module, runtime: Runtime, trainable_only: bool) -> dict[str, torch.Tensor]:
    """CPU float tensors of the whole (or only the trainable part of the) model, on the main
    process; FSDP shards are gathered (every process must call this)."""
    model = unwrap(model)
    if runtime.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=options)
    names = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else None
    return {
        k: v.detach().cpu().clone() for k, v in model.state_dict().items() if names is None or k in names
    }


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], runtime: Runtime) -> None:
    model = unwrap(model)
    if runtime.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing = set(state) - set(model.state_dict())
    if missing:
        raise KeyError(f"checkpoint holds weights the model does not have, e.g. {sorted(missing)[:3]}")
    with torch.no_grad():
        own = model.state_dict()
        for key, value in state.items():
            own[key].copy_(value)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> dict:
    """Optimizer state keyed by parameter name (portable across world sizes); FSDP shards gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(unwrap(model), optimizer, options=options)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, runtime: Runtime) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(unwrap(model), optimizer, state, options=StateDictOptions(full_state_dict=True))
