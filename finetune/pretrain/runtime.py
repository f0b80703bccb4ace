"""The engine's per-process :class:`~finetune.engine.runtime.Runtime`, set up for pretraining:
every run trains all weights, so several processes always mean FSDP2 with bf16 compute on CUDA."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..engine.runtime import Runtime


@dataclass
class PretrainRuntime(Runtime):
    mixed_precision: str = "no"

    @property
    def encoder_dtype(self) -> torch.dtype:
        """Frozen text encoder / VAE / vision encoder: bf16 on CUDA, float32 on CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def mp_policy(self):
        from ..engine.parallel import mixed_precision_policy

        return mixed_precision_policy(self.mixed_precision)


def make_runtime() -> PretrainRuntime:
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    mixed_precision = "bf16" if cuda else "no"
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not cuda)
    world = accelerator.num_processes
    return PretrainRuntime(accelerator, accelerator.device, accelerator.process_index, world,
                           "fsdp" if world > 1 else "single", mixed_precision)


def model_only_load(path: Path, model: nn.Module) -> None:
    """Load only the model weights of a DCP checkpoint (a new stage that resets the optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    options = StateDictOptions(full_state_dict=False)
    state = get_model_state_dict(model, options=options)
    dcp.load({"model": state}, checkpoint_id=str(path))
    set_model_state_dict(model, state, options=options)
