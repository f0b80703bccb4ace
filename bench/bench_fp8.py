"""fp8 layers' expansion on the CPU: the library's per-row table against fp16 bit shifts, side by side.

    python bench/bench_fp8.py [--shapes 16384x6144,6144x16384,6144x6144] [--tokens 82,1024]
                              [--repeats 4] [--json OUT]

One process; for each shape and row count an :class:`Fp8Linear` (N(0, 0.02) weights, per-row
scales) runs its bf16 forward with each expansion in turn, beside the matmul alone on the weight expanded
beforehand (``bench_dequant.best_of``: calls alternating, each keeping its fastest of ``--repeats``):

- ``table``: :func:`krea2_diffusers.quantization.fp8.dequantize_weight`, each row's 256 possible
  values computed once and looked up with ``index_select`` (what the library runs);
- ``shifted``: :func:`shifted_dequantize` below, not adopted (README, "fp8's expansion, measured
  faster and not adopted": a full-size LoRA step peaked ~0.5 GiB higher with it). Every fp8 value is
  exactly an fp16 value (e5m2: an fp16's top byte; e4m3fn: an fp16's bits at 2^-8 of the value,
  subnormals included), so a chunk is built with integer shifts in the output's own memory and
  multiplied once by the float32 scale.

The outputs of the two must be equal to the bit (the bench stops otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from krea2_diffusers.quantization import fp8  # noqa: E402
from krea2_diffusers.quantization.bnb_packing import CHUNK_WEIGHTS  # noqa: E402
from bench_dequant import best_of  # noqa: E402
from full_size_record import cpu_record, threads_record  # noqa: E402


def shifted_dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) fp8 (CPU) times a scalar or per-row float32 scale -> (out, in) in ``dtype``, the
    float32 product rounded once: the same values as :func:`fp8.dequantize_weight`."""
    scale = scale.detach().float().reshape(-1, 1)
    e4m3 = weight_fp8.dtype == torch.float8_e4m3fn
    scale = scale * 256.0 if e4m3 else scale
    bits = weight_fp8.view(torch.int8)
    out = torch.empty(weight_fp8.shape, dtype=dtype)
    step = max(1, CHUNK_WEIGHTS // 4 // max(1, weight_fp8.shape[1]))
    for start in range(0, weight_fp8.shape[0], step):
        part, target = bits[start:start + step], out[start:start + step]
        half = target.view(torch.int16) if dtype.itemsize == 2 else torch.empty_like(part, dtype=torch.int16)
        half.copy_(part)
        if e4m3:  # sign extension also set bit 14 (the fp16 exponent's top bit) of negatives: cleared
            half.bitwise_left_shift_(7).bitwise_and_(~(1 << 14))
        else:
            half.bitwise_left_shift_(8)
        values = half.view(torch.float16)
        # e4m3fn's NaN codes (0x7F, 0xFF) land on +-1.875, past every value's +-1.75 (448 / 256)
        nans = e4m3 and max(-float(values.amin()), float(values.amax())) > 1.75
        if nans:
            nan_mask = part.view(torch.uint8).bitwise_and(0x7F) == 0x7F
        torch.mul(values, scale[start:start + step] if scale.numel() > 1 else scale, out=target)
        if nans:
            target.masked_fill_(nan_mask, float("nan"))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="16384x6144,6144x16384,6144x6144")
    parser.add_argument("--tokens", default="82,1024")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    library = fp8.dequantize_weight
    rows_out = []
    try:
        for shape in args.shapes.split(","):
            out_features, in_features = map(int, shape.split("x"))
            torch.manual_seed(0)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            torch.nn.init.normal_(linear.weight, std=0.02)
            layer = fp8.Fp8Linear.from_linear(linear, compute_dtype=torch.bfloat16)
            weight = layer.dequantized_weight(torch.bfloat16)
            for tokens in map(int, args.tokens.split(",")):
                x = torch.randn(tokens, in_features, dtype=torch.bfloat16)
                outputs = {}

                def forward(fn):
                    def call():
                        fp8.dequantize_weight = fn  # the layer's chunks look it up at each call
                        return layer(x)
                    return call

                with torch.no_grad():
                    best, _ = best_of({"table": forward(library), "shifted": forward(shifted_dequantize),
                                       "matmul": lambda: torch.nn.functional.linear(x, weight)},
                                      args.repeats, check=lambda name, out: outputs.setdefault(name, out))
                fp8.dequantize_weight = library
                if not torch.equal(outputs["table"], outputs["shifted"]):
                    raise SystemExit(f"{shape} at {tokens} rows: the two expansions' outputs differ")
                table, shifted, matmul = (best[name].wall for name in ("table", "shifted", "matmul"))
                row = {"shape": [out_features, in_features], "tokens": tokens, "table_s": table,
                       "shifted_s": shifted, "matmul_s": matmul, "speedup": table / shifted}
                rows_out.append(row)
                print(f"{shape} {tokens:5d} rows: table {table * 1e3:7.1f} ms, shifted {shifted * 1e3:7.1f} ms "
                      f"({row['speedup']:.2f}x), matmul alone {matmul * 1e3:6.1f} ms; outputs equal", flush=True)
    finally:
        fp8.dequantize_weight = library
    record = {"threads": threads_record(), "cpu": cpu_record(), "rows": rows_out}
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    return record


if __name__ == "__main__":
    main()
