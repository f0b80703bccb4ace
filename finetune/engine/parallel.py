"""Wrapping a model for training, in torchtitan's ``parallelize`` order.

activation checkpointing -> ``torch.compile`` per block -> the parallel wrapper: FSDP2's hooks
must see the compiled blocks, and checkpointing must sit inside compilation.

* LoRA: DDP (the adapters are small; every process keeps the whole frozen base).
* Full fine-tune: FSDP2 ``fully_shard`` on every block, then on the root, so one block's
  parameters are gathered at a time; float32 master shards, bf16 compute through
  ``MixedPrecisionPolicy``. :func:`shard_on_meta` does this on a meta-device model, so the
  whole model never exists on one rank (the rank then reads its own slices, see ``weights``).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterable

import torch
from torch import nn

from .runtime import Runtime

ACTIVATION_CHECKPOINTING = ("none", "selective", "full")


def _save_policy():
    """Selective checkpointing keeps the attention outputs (the O(S^2) work, costliest to redo)
    and recomputes the projections and element-wise work (norms, modulation, activations)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = set()
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: str) -> None:
    """Checkpoint each block's forward (``full``: keep only its input; ``selective``: also keep
    the attention outputs). The block's own ``forward`` is replaced on the instance, so
    parameter names (checkpoint keys, LoRA targets) do not change."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {ACTIVATION_CHECKPOINTING}, got {mode!r}")
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, _save_policy()) if mode == "selective" else None
    from krea2_diffusers.quantization.chunked_linear import expanded_weights_kept

    def keeping(inner):
        # quantized layers keep the recompute's expanded weights for this block's backward
        def run(*args, **kwargs):
            with expanded_weights_kept():
                return inner(*args, **kwargs)
        return run

    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(keeping(_inner), *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def compile_blocks(blocks: Iterable[nn.Module]) -> None:
    for block in blocks:
        block.compile()


def mixed_precision_policy(mixed_precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":
        # bf16 compute and all-gathers, fp32 gradient reduction and master weights.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def fully_shard_blocks(root: nn.Module, blocks: Iterable[nn.Module], mixed_precision: str) -> nn.Module:
    """FSDP2 on each block, then on the root (works on meta-device and real models alike)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(mixed_precision)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    return root


def prepare_blocks(blocks: list[nn.Module], activation_checkpointing: str, compile: bool) -> None:
    """The first two steps of the order: checkpointing, then per-block compilation."""
    apply_activation_checkpointing(blocks, activation_checkpointing)
    if compile:
        compile_blocks(blocks)


def wrap_model(model: nn.Module, blocks: list[nn.Module], runtime: Runtime, *, activation_checkpointing: str,
               compile: bool, mixed_precision: str, offloaded_blocks: int = 0,
               find_unused_parameters: bool = False) -> nn.Module:
    """Checkpointing -> compile -> DDP/FSDP2 for an already materialised model. Returns the module to call.

    ``offloaded_blocks``: the last N blocks keep their frozen weights on the CPU (block swap, see
    ``offload``); everything else goes to the device. ``find_unused_parameters`` (DDP): a backward
    may reach only part of the trained parameters (e.g. one of two adapters); the others keep no
    gradient on every process instead of DDP waiting for theirs.
    """
    prepare_blocks(blocks, activation_checkpointing, compile)
    offloader = None
    if offloaded_blocks:
        from .offload import BlockOffloader

        offloader = BlockOffloader(blocks[len(blocks) - offloaded_blocks:], runtime.device)
        offloader.place_rest_(model)
        model.block_offloader = offloader  # kept alive with the model (its hooks reference it)
    if runtime.strategy == "fsdp":
        if offloader is not None:
            raise ValueError("block offload and FSDP do not mix: FSDP already keeps 1/N of the weights per process")
        model.to(runtime.device)
        return fully_shard_blocks(model, blocks, mixed_precision)
    if runtime.strategy == "ddp":
        if offloader is not None:
            # DDP broadcasts every parameter at start-up; the offloaded frozen ones live on the CPU.
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, offloader.names(model))
        if find_unused_parameters:  # one model per process: the accelerator's DDP arguments are this model's
            from accelerate.utils import DistributedDataParallelKwargs

            runtime.accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        return runtime.accelerator.prepare_model(model, device_placement=offloader is None)
    return model if offloader is not None else model.to(runtime.device)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 wraps in place, so it is the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def no_sync(model: nn.Module, runtime: Runtime, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on micro-batches that do not end an optimizer
    step. Wrap the micro-batch's forward *and* backward: DDP prepares the reduction in the
    forward. Every process runs the same number of micro-batches (see ``loader.StepLayout``)."""
    if runtime.strategy == "fsdp":
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
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


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (LoRA adapters, DoRA magnitudes) by checkpoint name, as the
    model's own tensors (detached views: loading into them fills the model; FSDP2 shards stay
    DTensors). The one definition of a LoRA run's state for checkpoints, validation and exports.

    Never ``module.state_dict()``: a frozen quantized layer puts its quantization state there
    (fp8 ``weight_scale`` buffers, bitsandbytes ``weight.absmax`` / ``weight.quant_state.*``, and
    ``weight.SCB``, which an int8 layer has not even set before its first forward), none of which
    trains and all of which the run rebuilds from the model file.
    """
    return {name: param.detach() for name, param in unwrap(model).named_parameters() if param.requires_grad}


def full_state_dict(model: nn.Module, runtime: Runtime, trainable_only: bool) -> dict[str, torch.Tensor]:
    """CPU tensors of the trainable part of the model on the main process (small: LoRA adapters
    for validation), copies of the training ones; other processes get ``{}``. Full weights are
    never gathered: exports stream from the DCP checkpoint."""
    if not trainable_only:
        raise ValueError("full_state_dict gathers the trainable part only; full weights stream from the DCP checkpoint")
    # A DTensor (FSDP2) is gathered on every process (a collective), then kept on the main one.
    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone() for name, t in trainable_state(model).items()}
    return state if runtime.is_main else {}
