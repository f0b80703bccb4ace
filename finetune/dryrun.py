"""``krea2 train CONFIG --dry-run`` (and ``krea2 posttrain``): set the run up on the meta device
and print the memory plan of one process (see :mod:`finetune.engine.plan`) and each dataset's share
of the samples drawn (:func:`finetune.data.samples.planned_mix_text`). Reads no weights, trains
nothing, and writes nothing in the output directory but ``dry-run.log``.

A run may hold several transformers (:class:`ModelCopies`): post-training's frozen reference /
teacher, distillation's second trained model (the fake score) or second LoRA adapter."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.files import atomic_write

from .config import ConfigError, TrainConfig
from .data.buckets import make_buckets
from krea2_diffusers.pipelines.host_memory import HostPlan

from .engine.plan import (RUNTIME_OVERHEAD, MemoryPlan, activation_bytes, measure_activations, quantized_linear_bytes,
                          tensor_bytes)
from .methods import ADAPTER_NAME, add_lora, quantize_base
from .optimization.optim import state_bytes

LOG_NAME = "dry-run.log"
ADAPTER_KINDS = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa"}
PATCH = 16  # pixels per image token: VAE 8 x patch 2


@dataclass(frozen=True)
class ModelCopies:
    """The transformers one process holds, and the largest forward whose activations it keeps."""

    trained: int = 1
    """Full: transformers trained (fp32 master, gradients and optimizer state each, sharded)."""
    frozen: int = 0
    """Full: frozen copies (reference / teacher) in ``model.dtype``, sharded like the trained ones."""
    frozen_name: str = "reference"
    adapters: int = 1
    """LoRA: adapter sets on the one frozen base (which is also the reference: adapters off)."""
    forward_batch: int | None = None
    """Samples whose activations are kept at once (default ``training.batch_size``)."""
    image_size: tuple[int, int] | None = None
    """(width, height) of those samples (default: the largest bucket of ``data.resolution``)."""
    what: str = ""
    """What the copies are, for the plan's first line."""


def _meta_inputs(config: TrainConfig, transformer_config: dict, dtype: torch.dtype,
                 copies: ModelCopies) -> tuple[dict, tuple[int, int]]:
    data = config.data
    # The largest buckets of any dataset (data.datasets: each its own resolution).
    resolution = max((d.resolution or data.resolution) for d in data.datasets) if data.datasets else data.resolution
    width, height = copies.image_size or max(
        make_buckets(resolution, data.bucket_step, data.min_aspect_ratio, data.max_aspect_ratio), key=lambda b: b[0] * b[1])
    batch, text = copies.forward_batch or config.training.batch_size, config.model.max_sequence_length
    tokens = (width // PATCH) * (height // PATCH)
    # Paired samples: the most reference tokens a forward can hold (every reference at max_pixels),
    # and their vision tokens in the text (Qwen3-VL: one per merged 32x32 patch).
    pairs = data.references
    reference_tokens = pairs.max_references * (pairs.max_pixels // PATCH**2) if pairs is not None and pairs.latents else 0
    if pairs is not None and pairs.vision_tokens:
        from krea2_diffusers.conditioning.reference_images import VISION_MAX_PIXELS

        text += pairs.max_references * VISION_MAX_PIXELS // 32**2
    with torch.device("meta"):
        inputs = dict(
            hidden_states=torch.empty(batch, tokens, transformer_config.get("in_channels", 64), dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text, transformer_config.get("num_text_layers", 12),
                                              transformer_config.get("text_hidden_dim", 2560), dtype=dtype),
            timestep=torch.empty(batch),
            position_ids=torch.zeros(text + tokens + reference_tokens, 3),
            return_dict=False,
        )
        if reference_tokens:
            inputs.update(reference_hidden_states=torch.empty(batch, reference_tokens, transformer_config.get("in_channels", 64),
                                                              dtype=dtype),
                          reference_attention="cached" if config.training.reference_kv_cache else "joint")
    return inputs, (width, height)


def _frozen_bytes(model: nn.Module, quantize: str) -> int:
    """Resident bytes of the frozen tensors; bitsandbytes layers by their packed size."""
    from krea2_diffusers.quantization.bnb import TRANSFORMER_KEEP, keep_filter

    total = tensor_bytes(t for t in model.buffers())
    skip = keep_filter(TRANSFORMER_KEEP)
    counted: set[int] = set()
    if quantize in ("int8", "nf4"):
        for name, module in model.named_modules():
            if type(module) is nn.Linear and not skip(name) and not module.weight.requires_grad:
                total += quantized_linear_bytes(module, quantize)
                counted.update(id(p) for p in module.parameters())
    return total + tensor_bytes(p for p in model.parameters() if not p.requires_grad and id(p) not in counted)


def build_plan(config: TrainConfig, world_size: int, copies: ModelCopies = ModelCopies(),
               on_gpu: bool | None = None) -> tuple[MemoryPlan, str]:
    """The plan for one process of a ``world_size``-process run, and a one-line description of the
    setup. ``on_gpu`` (default: whether this machine has CUDA) decides what ``mixed_precision: auto``
    computes in."""
    from krea2_diffusers.precision import training_precision

    from .model import DTYPES, transformer_weights

    transformer_config, source = transformer_weights(config.model)
    source.close()
    training = config.training
    lora = training.method == "lora"
    stored = DTYPES[config.model.dtype]
    device = "cuda" if (torch.cuda.is_available() if on_gpu is None else on_gpu) else "cpu"
    mixed = training_precision(training.mixed_precision, device, "training.mixed_precision").dtype
    compute = torch.bfloat16 if (mixed == torch.bfloat16 or stored != torch.float32) else torch.float32
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**transformer_config)
    plan = MemoryPlan()
    blocks = list(model.transformer_blocks)
    if lora:
        model.to(stored)
        if config.model.quantize == "fp8":
            quantize_base(model, "fp8", compute)
        with torch.device("meta"):
            names = (ADAPTER_NAME, *(f"adapter{i}" for i in range(1, copies.adapters)))
            for param in add_lora(model, config.lora, adapter_names=names):
                param.requires_grad_(True)
        offloaded = blocks[len(blocks) - training.offload_blocks:] if training.offload_blocks else []
        frozen = _frozen_bytes(model, config.model.quantize)
        if offloaded:
            per_block = max(_frozen_bytes(b, config.model.quantize) for b in offloaded)
            frozen -= sum(_frozen_bytes(b, config.model.quantize) for b in offloaded)
            frozen += 2 * per_block  # one block computing, the next one arriving
            plan.notes.append(f"{len(offloaded)} blocks' frozen weights live in pinned CPU memory "
                              f"({len(offloaded) * per_block / 2**30:.2f} GiB of host RAM)")
        trainable = tensor_bytes(p for p in model.parameters() if p.requires_grad)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        base = f"{config.model.quantize} " if config.model.quantize != "none" else f"{config.model.dtype} "
        plan.add(f"frozen base ({base.strip()}, full-precision layers kept)", frozen)
        sets = f", {copies.adapters} adapters" if copies.adapters > 1 else ""
        kind = ADAPTER_KINDS[config.lora.type]
        plan.add(f"{kind} r{config.lora.rank} weights (fp32, {count / 1e6:.1f}M{sets})", trainable)
        plan.add(f"{kind} gradients (fp32)", trainable)
        shapes = [p.shape for p in model.parameters() if p.requires_grad]
        plan.add(f"optimizer state ({config.optimizer.name})", state_bytes(config.optimizer.name, shapes))
        _add_ema(plan, config, trainable)
        what = f"{kind} r{config.lora.rank} on a {base}base"
    else:
        model.float()
        shards = world_size if world_size > 1 else 1
        count = sum(p.numel() for p in model.parameters())
        trained = count * copies.trained
        times = f"{copies.trained} x " if copies.trained > 1 else ""
        plan.add(f"fp32 master weights ({times}1/{shards} shard)", 4 * trained / shards)
        plan.add("fp32 gradients (shard)", 4 * trained / shards)
        shapes = [p.shape for p in model.parameters()] * copies.trained
        plan.add(f"optimizer state ({config.optimizer.name}, shard)", state_bytes(config.optimizer.name, shapes) / shards)
        _add_ema(plan, config, 4 * trained / shards)
        if copies.frozen:
            times = f"{copies.frozen} x " if copies.frozen > 1 else ""
            plan.add(f"frozen {copies.frozen_name} ({config.model.dtype}, {times}1/{shards} shard, no optimizer state)",
                     copies.frozen * count * stored.itemsize / shards)
        if shards > 1:
            block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
            # FSDP2: the block computing and the next one prefetched, gathered in the compute dtype,
            # plus the unsharded gradients of one block before its reduce-scatter. One model runs
            # at a time, so a frozen copy's gathered blocks (no gradients) never add to these.
            plan.add("gathered blocks in flight (2) + one block's full gradients", block * (2 * compute.itemsize + 4))
        what = f"full fine-tune of {count / 1e9:.2f}B parameters over {shards} process(es)"
    inputs, bucket = _meta_inputs(config, transformer_config, compute, copies)
    model.to(compute)
    for p in model.parameters():
        if not lora:
            p.requires_grad_(True)
    measured = measure_activations(model, inputs, blocks)
    mode = training.activation_checkpointing
    plan.add(f"activations ({bucket[0]}x{bucket[1]} px, batch {inputs['hidden_states'].shape[0]}, checkpointing {mode})",
             activation_bytes(measured, mode))
    plan.add("CUDA context, workspaces, fragmentation", RUNTIME_OVERHEAD)
    plan.notes.append("text encoder and VAE are off the GPU while training (features are cached first)")
    if copies.what:
        what = f"{what}; {copies.what}"
    return plan, what


def device_memory() -> tuple[str, int | None]:
    """(name, total bytes) of this process's GPU; ``("cpu (no GPU detected)", None)`` without one."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.name, props.total_memory
    return "cpu (no GPU detected)", None


def plan_text(config: TrainConfig, world_size: int = 1, copies: ModelCopies = ModelCopies(),
              device: tuple[str, int | None] | None = None) -> tuple[str, MemoryPlan]:
    """What ``--dry-run`` prints, and the plan: ``device`` (name, bytes) is the card compared
    against (default: this process's, :func:`device_memory`). Writes nothing."""
    from krea2_diffusers.pipelines.host_memory import host_ram

    # A card given by the caller (the app's presets) is planned as a GPU even on a CPU machine.
    on_gpu = torch.cuda.is_available() or device is not None
    name, available = device or device_memory()
    plan, what = build_plan(config, world_size, copies, on_gpu)
    host, ram = host_plan(config, plan, on_gpu), host_ram()
    short = (available is not None and plan.total > available) or host.total > ram
    fitting = _fitting_modes(config, world_size, copies, available if on_gpu else ram, on_gpu, plan) if short else []
    text = (f"dry run: {what}, {world_size} process(es)\n" + plan.render(name, available, fitting) + "\n"
            + host.render(ram, fitting))
    return text, plan


def _add_ema(plan: MemoryPlan, config: TrainConfig, size: float) -> None:
    """``training.ema``: one float32 copy of what trains (this process's shard), on the device or the host."""
    ema = config.training.ema
    if ema is not None:
        (plan.host_rows if ema.on_cpu else plan.rows).append(("EMA of the trained weights (fp32)", int(size)))


def host_plan(config: TrainConfig, plan: MemoryPlan, on_gpu: bool) -> HostPlan:
    """Host RAM of one process: the libraries, the text encoder and VAE, and the transformer's
    streamed load (one block in the file's precision plus the quantizer's temporaries beside the
    quantized base). The encoders cache the features before the transformer loads; they stay in
    host memory when validation samples need them, else they are gone by then and count only
    where the caching phase needs more than the training phase. On the CPU the training plan's
    rows are host memory too; the load's transient and training's own tensors never coexist."""
    from krea2_diffusers.loaders.quantized import planned_transformer_bytes
    from krea2_diffusers.pipelines.host_memory import PROCESS_BASELINE, file_bytes

    from .model import DTYPES, transformer_weights

    host = HostPlan()
    host.add("process (python, torch, libraries)", PROCESS_BASELINE)
    widen = max(1, DTYPES[config.model.dtype].itemsize // 2)  # bf16 files loaded as float32 double
    encoders = (file_bytes(config.model.text_encoder) + file_bytes(config.model.vae)) * widen
    if config.validation.prompts:
        host.add("text encoder and VAE (kept on the host for validation samples)", encoders)
    lora = config.training.method == "lora"
    quantization = config.model.quantize if lora and config.model.quantize != "none" else None
    transformer_config, source = transformer_weights(config.model)
    source.close()
    _, loading = planned_transformer_bytes(Krea2Transformer2DModel, transformer_config, quantization, DTYPES[config.model.dtype])
    rows = [(label, size) for label, size in plan.rows if not label.startswith("CUDA")]
    if not on_gpu:
        for label, size in rows:
            if label.startswith("frozen"):
                host.add(label, size)
        training = sum(size for label, size in rows if not label.startswith("frozen"))
        label = "training tensors"
        # Quantized layers compute in row chunks on the CPU (quantization.chunked_linear); under
        # activation checkpointing the recompute keeps one block's expanded weights for its backward.
        if quantization is not None and config.training.activation_checkpointing != "none":
            training += expanded_block_bytes(transformer_config, DTYPES[config.model.dtype])
            label += " (and one block's expanded weights)"
        host.add(f"{label}, or the load's one block + quantizer temporaries (the larger)", max(training, loading))
    else:
        host.add("the load's one block + quantizer temporaries", loading)
    for label, size in plan.host_rows:
        host.add(f"{label}, in host memory", size)
    if not config.validation.prompts:
        host.add("text encoder and VAE (freed after caching, before the transformer loads), beyond the above",
                 max(0, encoders - (host.total - PROCESS_BASELINE)))
    return host


def expanded_block_bytes(transformer_config: dict, dtype: torch.dtype) -> int:
    """Bytes of one transformer block's linear weights in ``dtype``: what a checkpointed block's
    recompute keeps expanded for its backward (quantization.chunked_linear.expanded_weights_kept)."""
    with torch.device("meta"):
        block = Krea2Transformer2DModel(**{**transformer_config, "num_layers": 1}).transformer_blocks[0]
    return sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)) * dtype.itemsize


def _fitting_modes(config: TrainConfig, world_size: int, copies: ModelCopies, available: int, on_gpu: bool,
                   own: MemoryPlan) -> list[str]:
    """The ``model.quantize`` values (smallest first) whose plan fits ``available`` bytes (LoRA only);
    ``own`` is the plan of ``config``'s own mode, already built (a full-size plan takes seconds)."""
    if config.training.method != "lora":
        return []
    fitting = []
    for mode in ("nf4", "int8", "fp8", "none"):
        other = copy.deepcopy(config)
        other.model.quantize = mode
        try:
            other.validate()  # e.g. LoKr/LoHa cannot train over nf4
        except ConfigError:
            continue
        plan = own if mode == config.model.quantize else build_plan(other, world_size, copies, on_gpu)[0]
        total = plan.total if on_gpu else host_plan(other, plan, on_gpu).total
        if total <= available:
            fitting.append(f"model.quantize={mode}")
    return fitting


def dry_run(config: TrainConfig, copies: ModelCopies = ModelCopies()) -> str:
    """Print and log the plan; returns the text. Nothing but ``dry-run.log`` is written."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    text, _ = plan_text(config, world_size, copies)
    if config.requires_data:  # post-training brings its own data (pairs, prompts)
        from .data.samples import planned_mix_text

        text += "\n" + planned_mix_text(config, world_size)
    if rank == 0:
        print(text)
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_write(out / LOG_NAME, "w") as handle:
            handle.write(text + "\n")
    return text
