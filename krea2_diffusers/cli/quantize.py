"""``krea2 quantize IN OUT --type Q8_0|...|fp8``: a community-compatible GGUF, or ComfyUI's scaled fp8."""

from __future__ import annotations

import argparse
import time

from ..quantization.gguf.qtypes import WRITABLE_TYPES

FP8 = "fp8"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "quantize",
        help="quantize a transformer .safetensors to GGUF, or a transformer / Qwen3-VL text encoder to ComfyUI's fp8",
        description="GGUF types write original tensor names with the community keep-unquantized rules, readable by "
                    "ComfyUI-GGUF and by Krea2Transformer2DModel.from_single_file. --type fp8 writes ComfyUI's "
                    "scaled-fp8 safetensors (float8_e4m3fn weights + weight_scale + _quantization_metadata), "
                    "read by ComfyUI's UNETLoader / CLIPLoader and by this library.",
    )
    p.add_argument("input", help="transformer .safetensors (original or diffusers layout), or a Qwen3-VL text "
                                 "encoder .safetensors (Hugging Face layout; fp8 only)")
    p.add_argument("output", help="new .gguf file, or new .safetensors file for --type fp8")
    p.add_argument("--type", dest="qtype", choices=(*WRITABLE_TYPES, FP8), default="Q8_0",
                   help="quantization of the large matrices (default Q8_0)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (the input is never replaced)")
    return p


def run(args) -> int:
    suffix = ".safetensors" if args.qtype == FP8 else ".gguf"
    if not str(args.output).endswith(suffix):
        raise ValueError(f"{args.output}: the output name must end in {suffix} for --type {args.qtype}")
    start = time.perf_counter()
    if args.qtype == FP8:
        from ..loaders.comfy_fp8 import quantize_checkpoint_fp8

        counts = quantize_checkpoint_fp8(args.input, args.output, overwrite=args.force)
        summary = f"{counts['kind']}: {counts['fp8']} layers fp8, {counts['kept']} tensors kept"
    else:
        from ..quantization.gguf.writer import quantize_checkpoint

        counts = quantize_checkpoint(args.input, args.output, args.qtype, overwrite=args.force)
        summary = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items()))
    print(f"wrote {args.output} ({summary}) in {time.perf_counter() - start:.1f} s")
    return 0
