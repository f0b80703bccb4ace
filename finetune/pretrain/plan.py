"""``krea2 pretrain --dry-run``: check the config and every pack, print what the run would do and
each stage's memory plan per process (the engine's: parameters and optimizer state counted from
the meta-device model, activations measured by a meta forward at the stage's largest bucket)."""

from __future__ import annotations

import torch
from torch import nn

from ..data.buckets import make_buckets
from ..engine.plan import RUNTIME_OVERHEAD, MemoryPlan, activation_bytes, measure_activations
from .architecture import build_meta_transformer, check_fp8_available
from .batches import StageBatches, open_stage_pack
from .config import PretrainConfig, StageConfig
from .optimizers import split_parameters

PIXELS_PER_TOKEN = 16
BYTES_FP32 = 4
# Optimizer state per parameter: AdamW's two fp32 moments, Muon's one momentum buffer.
ADAMW_STATE, MUON_STATE = 8, 4


def stage_plan(config: PretrainConfig, stage: StageConfig, world_size: int, compute: torch.dtype) -> MemoryPlan:
    model = build_meta_transformer(config.model)
    split = split_parameters(model, config.optimizer)
    count = sum(p.numel() for p in model.parameters())
    muon = sum(p.numel() for _, p in split.muon)
    plan = MemoryPlan()
    plan.add(f"fp32 master weights (1/{world_size} shard)", BYTES_FP32 * count / world_size)
    plan.add("fp32 gradients (shard)", BYTES_FP32 * count / world_size)
    plan.add(f"optimizer state ({config.optimizer.name}, shard)", (ADAMW_STATE * (count - muon) + MUON_STATE * muon) / world_size)
    width, height = max(make_buckets(stage.resolution), key=lambda b: b[0] * b[1])
    tokens, text = (width // PIXELS_PER_TOKEN) * (height // PIXELS_PER_TOKEN), config.model.max_sequence_length
    dims = model.config
    with torch.device("meta"):
        inputs = dict(hidden_states=torch.empty(stage.batch_size, tokens, dims.in_channels, dtype=compute),
                      encoder_hidden_states=torch.empty(stage.batch_size, text, dims.num_text_layers, dims.text_hidden_dim, dtype=compute),
                      timestep=torch.empty(stage.batch_size), position_ids=torch.zeros(text + tokens, 3), return_dict=False)
    nn.Module.to(model, compute)  # plain cast of the meta tensors (diffusers' `to` warns about fp32 norms)
    measured = measure_activations(model, inputs, list(model.transformer_blocks))
    plan.add(f"activations ({width}x{height} px, batch {stage.batch_size}, checkpointing {stage.activation_checkpointing})",
             activation_bytes(measured, stage.activation_checkpointing))
    plan.add("CUDA context, workspaces, fragmentation", RUNTIME_OVERHEAD)
    plan.notes.append("frozen VAE, text encoder (unless the packs hold features) and REPA encoder come on top")
    return plan


def print_plan(config: PretrainConfig, world_size: int) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    check_fp8_available(config.stages, device)
    from krea2_diffusers.precision import training_precision

    compute = training_precision(config.training.mixed_precision, device, "training.mixed_precision").dtype
    model = build_meta_transformer(config.model)
    split = split_parameters(model, config.optimizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {world_size} process(es)")
    print(f"optimizer {config.optimizer.name}: {split.describe()}")
    available, name = None, "cpu (no GPU detected)"
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        available, name = props.total_memory, props.name
    start = 0
    for stage in config.stages:
        batches = StageBatches(stage, open_stage_pack(stage), world_size, config.training.seed)
        epochs = stage.steps / batches.batches_per_epoch
        repa = (f"repa on steps {start + 1}..{start + min(stage.steps, stage.repa.epochs * batches.batches_per_epoch)}"
                if stage.repa else "no repa")
        print(f"stage {stage.name}: steps {start + 1}..{start + stage.steps}, {stage.resolution}px, global batch "
              f"{batches.global_batch}, pack {stage.data} ({len(batches.reader)} rows, {batches.batches_per_epoch} "
              f"batches/epoch, {epochs:.2f} epochs), shift {stage.shift or 'resolution rule'}, activation checkpointing "
              f"{stage.activation_checkpointing}, {stage.precision}, {repa}")
        print(stage_plan(config, stage, world_size, compute).render(name, available))
        start += stage.steps
