"""LoRA training step on the full-size Krea 2 transformer (12.8B, random weights), one GPU, 1024 px.

    python bench/device/bench_train_full.py                  # 4 variants: grad checkpointing x {AdamW, 8-bit AdamW}
    python bench/device/bench_train_full.py --tiny           # CPU dry run of the same code on a tiny config
    python bench/device/bench_train_full.py --variants ckpt-adamw8bit --steps 5

One step = forward + backward + optimizer step of the LoRA (rank --rank, alpha = rank, targets:
attention q/k/v/out/gate and SwiGLU gate/up/down of all 28 blocks) on a batch of --batch images at
1024x1024 (4096 image tokens) with --text-len text tokens, bf16 base weights and autocast, fp32
LoRA weights. Random weights and inputs: speed and memory are those of real ones, no download.
It drives the training code itself (finetune.methods / objective / optim), not a copy.
Prints one row per variant: s/step (mean after warm-up) and peak allocated GPU memory.
8-bit AdamW needs bitsandbytes; without it that variant is reported as skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from finetune.config import LoRAConfig, ObjectiveConfig, OptimizerConfig  # noqa: E402
from finetune.methods import add_lora  # noqa: E402
from finetune.optimization.objective import add_noise, flow_matching_loss  # noqa: E402
from finetune.optimization.timesteps import sample_timesteps  # noqa: E402
from finetune.optimization.optim import make_optimizer  # noqa: E402
from krea2_diffusers.latents import position_ids  # noqa: E402
from krea2_diffusers.models.tiny import tiny_transformer_config  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402

FULL_CONFIG: dict = {}  # the class defaults are the released model (ARCHITECTURE.md)
TINY_CONFIG = tiny_transformer_config()
VARIANTS = {  # name: (gradient checkpointing, optimizer)
    "adamw": (False, "adamw"),
    "ckpt-adamw": (True, "adamw"),
    "adamw8bit": (False, "adamw8bit"),
    "ckpt-adamw8bit": (True, "adamw8bit"),
}
GIB = 1024**3


def build_model(config: dict, device: torch.device, dtype: torch.dtype) -> Krea2Transformer2DModel:
    """Random weights straight on the device (no 50 GB fp32 detour through host memory)."""
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**config)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.zero_()  # norm scales (1 + s) and biases
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            param.data = param.data.to(dtype)
    return model


def time_steps(model, params, optimizer, config: dict, args, device: torch.device, autocast: bool = True):
    """``args.warmup + args.steps`` LoRA steps (forward, backward, clip, optimizer) on random
    inputs at ``args.resolution``; returns (seconds of each timed step, last loss)."""
    grid = args.resolution // 16
    tokens = grid * grid
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, tokens, 64, generator=generator).to(device)
    text = torch.randn(args.batch, args.text_len, config.get("num_text_layers", 12), config.get("text_hidden_dim", 2560),
                       generator=generator)
    text = text.to(device, torch.bfloat16 if autocast else torch.float32)
    mask = torch.ones(args.batch, args.text_len, dtype=torch.bool, device=device)
    positions = position_ids(args.text_len, grid, grid, device=device)
    times = []
    for step in range(args.warmup + args.steps):
        noise = torch.randn(x0.shape, generator=generator).to(device)
        t = sample_timesteps(args.batch, tokens, ObjectiveConfig(), generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            pred = model(hidden_states=add_noise(x0, noise, t), encoder_hidden_states=text, timestep=t,
                         position_ids=positions, encoder_attention_mask=mask).sample
        loss = flow_matching_loss(pred, x0, noise, t)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, loss


def run_variant(name: str, args, device: torch.device) -> dict:
    checkpointing, optimizer_name = VARIANTS[name]
    config = TINY_CONFIG if args.tiny else FULL_CONFIG
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model = build_model(config, device, dtype)
    params = add_lora(model, LoRAConfig(rank=args.rank, alpha=float(args.rank)))
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    try:
        optimizer = make_optimizer(params, OptimizerConfig(name=optimizer_name, learning_rate=1e-4))
    except Exception as err:  # bitsandbytes missing: report, do not fail the other variants
        return {"variant": name, "skipped": str(err)}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = time_steps(model, params, optimizer, config, args, device, autocast=not args.tiny)
    result = {
        "variant": name, "gradient_checkpointing": checkpointing, "optimizer": optimizer_name,
        "s_per_step": sum(times) / len(times), "loss": loss.item(),
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None,
        "lora_params": sum(p.numel() for p in params),
    }
    del model, optimizer, params, loss
    release_memory(device)
    return result


def release_memory(device: torch.device) -> None:
    """Collect what the finished variant left and return the cached CUDA blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_step_arguments(description: str, variants) -> tuple[argparse.Namespace, torch.device]:
    """The LoRA step benches' shared command line (``--tiny``, ``--variants``, sizes, steps,
    ``--json``) and device; exits without CUDA unless ``--tiny``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny config (64 px)")
    parser.add_argument("--variants", default=",".join(variants))
    parser.add_argument("--resolution", type=int, default=None, help="pixels per side (default 1024; 64 with --tiny)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.resolution = args.resolution or (64 if args.tiny else 1024)
    if args.tiny:
        args.text_len = min(args.text_len, 16)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        sys.exit("no CUDA device: pass --tiny for the CPU dry run")
    return args, device


def main() -> None:
    args, device = parse_step_arguments(__doc__.splitlines()[0], VARIANTS)
    results = [run_variant(v, args, device) for v in args.variants.split(",")]
    print(f"{'variant':16} {'s/step':>8} {'peak GiB':>9}  ({args.resolution}px, batch {args.batch}, LoRA r{args.rank})")
    for r in results:
        if "skipped" in r:
            print(f"{r['variant']:16} skipped: {r['skipped']}")
        else:
            peak = f"{r['peak_gib']:9.2f}" if r["peak_gib"] is not None else f"{'-':>9}"
            print(f"{r['variant']:16} {r['s_per_step']:8.3f} {peak}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
