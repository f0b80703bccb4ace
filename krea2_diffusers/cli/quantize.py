"""``krea2 quantize IN.safetensors OUT.gguf --type Q8_0``: write a community-compatible GGUF."""

from __future__ import annotations

import argparse
import time

from ..gguf.qtypes import WRITABLE_TYPES


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "quantize",
        help="quantize a transformer .safetensors (original or diffusers layout) to a GGUF file",
        description="Writes original tensor names with the community keep-unquantized rules, readable by "
                    "ComfyUI-GGUF and by Krea2Transformer2DModel.from_single_file.",
    )
    p.add_argument("input", help="transformer .safetensors (original or diffusers layout)")
    p.add_argument("output", help="new .gguf file")
    p.add_argument("--type", dest="qtype", choices=tuple(WRITABLE_TYPES), default="Q8_0",
                   help="quantization of the large matrices (default Q8_0)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (the input is never replaced)")
    return p


def run(args) -> int:
    from ..gguf.writer import quantize_checkpoint

    if not str(args.output).endswith(".gguf"):
        raise ValueError(f"{args.output}: the output name must end in .gguf")
    start = time.perf_counter()
    counts = quantize_checkpoint(args.input, args.output, args.qtype, overwrite=args.force)
    summary = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items()))
    print(f"wrote {args.output} ({summary}) in {time.perf_counter() - start:.1f} s")
    return 0
