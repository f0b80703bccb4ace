"""Full-size Krea 2 transformer (12.8B, random weights) on one GPU: s/step at 1024x1024 per weight format.

    python bench/device/bench_quant_full.py                 # bf16, Q8_0, Q4_K, NF4, fp8 on CUDA
    python bench/device/bench_quant_full.py --tiny          # CPU dry run of the same code on a tiny config
    python bench/device/bench_quant_full.py --formats bf16,Q8_0 --batch 2

One step = one transformer forward over 4096 image tokens (1024x1024) and --text-len text
tokens, batch --batch (2 = a CFG step). Random weights: the speed and memory are those of real
weights (values do not change the work); no download is needed. Packed GGUF weights are random
valid blocks built directly on the device (quantizing 12.8B weights with numpy would take long).
Prints one table row per format: weight bytes on the GPU, peak allocated memory, s/step.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/full_size_models.py

from krea2_diffusers.quantization.gguf import PackedLinear, resident_bytes  # noqa: E402
from krea2_diffusers.quantization.gguf.qtypes import block_geometry  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

Q = GGMLQuantizationType
FULL_CONFIG: dict = {}  # the class defaults are the released model (ARCHITECTURE.md)
TINY_CONFIG = dict(
    in_channels=64, num_layers=2, attention_head_dim=64, num_attention_heads=4, num_key_value_heads=1,
    intermediate_size=768, timestep_embed_dim=256, text_hidden_dim=256, num_text_layers=12,
    text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=768,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(16, 24, 24),
)
FORMATS = ("bf16", "Q8_0", "Q4_K", "nf4", "fp8")
PACKED = {"Q8_0": Q.Q8_0, "Q4_K": Q.Q4_K}
# fp16 scale fields inside each block (random bytes there could decode to inf/NaN)
FP16_FIELDS = {Q.Q8_0: (0,), Q.Q4_K: (0, 2)}
KEEP = ("img_in", "time_embed", "time_mod_proj", "txt_in", "final_layer", "text_fusion.projector")
PIXELS_PER_TOKEN = 16
WEIGHT_STD = 0.02
GIB = 1024**3


def random_packed(qtype, out_features: int, in_features: int, device) -> torch.Tensor:
    """Valid random GGML blocks: random payload bytes, small finite fp16 scales."""
    block_size, type_size = block_geometry(qtype)
    blocks = torch.randint(0, 256, (out_features * in_features // block_size, type_size), dtype=torch.uint8, device=device)
    scale = torch.full((blocks.shape[0], 1), WEIGHT_STD / 64, dtype=torch.float16, device=device).view(torch.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = scale
    return blocks.reshape(out_features, -1)


def _kept(name: str) -> bool:
    return any(name == k or name.startswith(k + ".") for k in KEEP)


def build(config: dict, fmt: str, device: torch.device) -> nn.Module:
    """The transformer in ``fmt`` on ``device``, built without a full-precision copy: fp8 and NF4
    through the library's streamed loader from the random checkpoint (bench/full_size_models.py)."""
    if fmt in ("fp8", "nf4"):
        from full_size_models import streamed_transformer

        return streamed_transformer(fmt, device, None if config == FULL_CONFIG else config)
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**config)
    if fmt in PACKED:
        for name, module in list(model.named_modules()):
            if type(module) is nn.Linear and not _kept(name):
                parent, _, attr = name.rpartition(".")
                packed = random_packed(PACKED[fmt], module.out_features, module.in_features, device)
                setattr(model.get_submodule(parent), attr, PackedLinear(module.in_features, module.out_features, PACKED[fmt], packed))
    keep_fp32 = set(model._keep_in_fp32_modules)  # diffusers' ModelMixin class attribute (its API for model classes)
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        dtype = torch.float32 if any(p in keep_fp32 for p in name.split(".")[:-1]) else torch.bfloat16
        value = torch.empty(param.shape, dtype=dtype, device=device).normal_(0, WEIGHT_STD)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nn.Parameter(value, requires_grad=False))
    return model.eval()


def inputs(config, resolution: int, text_len: int, batch: int, device) -> dict:
    """Random inputs for a model of ``config`` (the built model's config: FULL_CONFIG is empty)."""
    grid = resolution // PIXELS_PER_TOKEN
    n = grid * grid
    in_channels, layers, width = config["in_channels"], config["num_text_layers"], config["text_hidden_dim"]
    pos = torch.stack([torch.zeros(n, dtype=torch.long), torch.arange(n) // grid, torch.arange(n) % grid], 1)
    return dict(
        hidden_states=torch.randn(batch, n, in_channels, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, text_len, layers, width, device=device, dtype=torch.bfloat16),
        timestep=torch.full((batch,), 0.5, device=device),
        position_ids=torch.cat([torch.zeros(text_len, 3, dtype=torch.long), pos]).to(device),
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fmt: str, config: dict, args, device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model = build(config, fmt, device)
    sync(device)
    build_s = time.perf_counter() - start
    weights = resident_bytes(model)
    batch = inputs(model.config, args.resolution, args.text_len, args.batch, device)
    with torch.inference_mode():
        for _ in range(args.warmup):
            model(**batch)
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            out = model(**batch).sample
        sync(device)
        step_s = (time.perf_counter() - start) / args.steps
    finite = bool(torch.isfinite(out).all())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, batch, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(format=fmt, weights=weights, peak=peak, build_s=build_s, step_s=step_s, finite=finite)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny config at 128x128")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; 128 with --tiny)")
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.tiny:
        config, device = TINY_CONFIG, torch.device("cpu")
        args.resolution = args.resolution or 128
        args.text_len = min(args.text_len, 16)
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --tiny for a CPU dry run", file=sys.stderr)
            return 2
        config, device = FULL_CONFIG, torch.device("cuda")
        args.resolution = args.resolution or 1024
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(f"unknown formats {sorted(unknown)}; choose from {FORMATS}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"Krea 2 transformer {'TINY dry run' if args.tiny else 'full size (12.8B)'} on {name}: "
          f"{args.resolution}x{args.resolution}, {args.text_len} text tokens, batch {args.batch}, {args.steps} timed steps")
    print(f"{'format':<6} {'weights GiB':>12} {'peak GiB':>9} {'build s':>8} {'s/step':>8}  finite")
    for fmt in formats:
        try:
            r = bench(fmt, config, args, device)
        except Exception as err:  # one failing format must not hide the others' numbers
            print(f"{fmt:<6} failed: {type(err).__name__}: {err}", flush=True)
            continue
        print(f"{r['format']:<6} {r['weights'] / GIB:>12.2f} {r['peak'] / GIB:>9.2f} {r['build_s']:>8.1f} {r['step_s']:>8.3f}  {r['finite']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
