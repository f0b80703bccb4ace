"""The engine's per-process :class:`~finetune.engine.runtime.Runtime`, set up for pretraining:
every run trains all weights, so several processes always mean FSDP2 (bf16 compute where
``training.mixed_precision`` resolves to bf16)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..engine.checkpoint import single_process_intended
from ..engine.runtime import Runtime


@dataclass
class PretrainRuntime(Runtime):
    @property
    def encoder_dtype(self) -> torch.dtype:
        """Frozen text encoder / VAE / vision encoder: bf16 on CUDA; on the CPU the run's resolved
        ``training.mixed_precision`` (``auto``: bf16 where the CPU has bf16 units)."""
        return torch.bfloat16 if self.device.type == "cuda" or self.mixed_precision == "bf16" else torch.float32

    def mp_policy(self):
        from ..engine.parallel import mixed_precision_policy

        return mixed_precision_policy(self.mixed_precision)


def make_runtime(mixed_precision: str = "auto") -> PretrainRuntime:
    """``mixed_precision``: ``training.mixed_precision`` of the config (``auto | no | bf16``)."""
    from ..engine.runtime import make_accelerator

    accelerator, mixed_precision = make_accelerator(mixed_precision)
    world = accelerator.num_processes
    return PretrainRuntime(accelerator, accelerator.device, accelerator.process_index, world,
                           "fsdp" if world > 1 else "single", mixed_precision)


def model_only_load(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a DCP checkpoint (a new stage that resets the optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    options = StateDictOptions(full_state_dict=False)
    state = get_model_state_dict(model, options=options)
    with single_process_intended():
        dcp.load({"model": state}, checkpoint_id=str(path))
    set_model_state_dict(model, state, options=options)
