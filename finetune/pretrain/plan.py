"""``krea2 pretrain --dry-run``: check the config and every pack, print what the run would do."""

from __future__ import annotations

import torch

from krea2_diffusers import Krea2Transformer2DModel

from .architecture import check_fp8_available, transformer_config
from .batches import StageBatches, open_stage_pack
from .config import PretrainConfig
from .optimizers import split_parameters

BYTES_FP32 = 4
GIB = 1024**3


def print_plan(config: PretrainConfig, world_size: int) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_fp8_available(config.stages, device)
    with torch.device("meta"):  # shapes only: the full-size model costs nothing here
        transformer = Krea2Transformer2DModel(**transformer_config(config.model))
    split = split_parameters(transformer, config.optimizer)
    count = sum(p.numel() for p in transformer.parameters())
    muon = sum(p.numel() for _, p in split.muon)
    # fp32 master + gradient, AdamW 2 moments / Muon 1 momentum buffer, sharded over the processes.
    state_bytes = (count * 2 + (count - muon) * 2 + muon) * BYTES_FP32 / world_size
    print(f"model: {count:,} parameters; {world_size} process(es); weights+grads+optimizer state "
          f"{state_bytes / GIB:.2f} GiB per process (activations come on top)")
    print(f"optimizer {config.optimizer.name}: {split.describe()}")
    start = 0
    for stage in config.stages:
        batches = StageBatches(stage, open_stage_pack(stage), world_size)
        epochs = stage.steps / batches.batches_per_epoch
        repa = (f"repa on steps {start + 1}..{start + min(stage.steps, stage.repa.epochs * batches.batches_per_epoch)}"
                if stage.repa else "no repa")
        print(f"stage {stage.name}: steps {start + 1}..{start + stage.steps}, {stage.resolution}px, global batch "
              f"{batches.global_batch}, pack {stage.data} ({len(batches.reader)} rows, {batches.batches_per_epoch} "
              f"batches/epoch, {epochs:.2f} epochs), shift {stage.shift or 'resolution rule'}, activation checkpointing "
              f"{stage.activation_checkpointing}, {stage.precision}, {repa}")
        start += stage.steps
