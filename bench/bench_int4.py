"""A 4-bit GGUF layer's forward: torch's fused int4 kernel against expanding the weight, side by side.

    python bench/bench_int4.py [--shape 16384x6144] [--type Q4_K] [--tokens 64,128,256,1024]
                               [--repeats 3] [--threads 0] [--compiled] [--json OUT]

One process, one layer (N(0, 0.02) weights quantized by this package), calls alternating and each
candidate keeping its fastest of ``--repeats``, at each row count of ``x``:

- ``int4 kernel``: :class:`PackedLinear` in its int4 layout (``aten._weight_int4pack_mm_for_cpu``,
  bf16 activations; what generation on the CPU runs now);
- ``expand bf16`` / ``expand f32``: the path every call took before, and still takes for float32
  activations and gradients: output rows expanded a few MiB at a time, each chunk's matmul after;
- ``comfy-style bf16``: ComfyUI-GGUF's way, the whole weight dequantized in the layer's dtype
  (``bench_dequant.comfy_style_dequantize``: every product in bf16), then one ``F.linear``;
- ``inductor int4`` (``--compiled``): the kernel's call compiled by ``torch.compile`` with
  ``mode="max-autotune-no-cudagraphs"`` and inductor's ``freezing`` (the weight and table as
  constants), which lets inductor's autotuner pick its own C++ int4 GEMM (on a CPU with AMX: a
  micro-kernel that expands a tile of the weight to bf16 and multiplies it on AMX) when it times
  faster than aten's; its compile (and autotune) seconds are recorded per row count (``compile_s``),
  since each static shape compiles once. Its table of scales and zeros is a constant; the ``int4
  kernel`` row builds it at each call, as :class:`PackedLinear` does (~18 ms of a 16384 x 6144 call).

Each row prints seconds, GFLOPS, the kernel's speedup over it and the output's error against a
float64 matmul of the file's exact weights (gguf-py's float32 decoding). 128 px at guidance 0 is
~100 rows (64 image tokens and the prompt), 1024 px 4,096 and more.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dequant import best_of, comfy_style_dequantize, packed_weight  # noqa: E402
from full_size_record import cpu_record, machine_state, threads_record  # noqa: E402

from krea2_diffusers.precision import cpu_bf16  # noqa: E402
from krea2_diffusers.quantization.chunked_linear import chunked_linear  # noqa: E402
from krea2_diffusers.quantization.gguf.packed import PackedLinear  # noqa: E402

Q = GGMLQuantizationType
SEED = 0


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def compiled_int4(kernel: PackedLinear, example: torch.Tensor):
    """(the frozen, max-autotuned int4 call on ``kernel``'s weight, its compile seconds)."""
    import torch._inductor.config as inductor_config

    from krea2_diffusers.quantization.gguf import int4_layout

    table = int4_layout.scales_and_zeros(kernel.int4_heads, kernel.qtype, kernel.in_features)

    def call(inputs):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(inputs, kernel.weight, int4_layout.GROUP, table)

    compiled = torch.compile(call, mode="max-autotune-no-cudagraphs", dynamic=False)
    start = time.perf_counter()
    # Frozen at the first call, which compiles here. Without its caches: a graph cached by an earlier
    # process for the same shapes came back with that process's frozen weight (relative error 1.58
    # against 3e-3 compiled afresh, seen on this bench).
    with torch.no_grad(), inductor_config.patch(freezing=True, force_disable_caches=True):
        compiled(example)
    return compiled, time.perf_counter() - start


def bench_rows(qtype, rows: int, cols: int, tokens: int, repeats: int, compiled: bool = False) -> dict:
    raw, _ = packed_weight(qtype, rows, cols)
    packed = torch.from_numpy(raw).reshape(rows, -1)
    exact_weight = torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(rows, cols).double()
    expanding = PackedLinear(cols, rows, qtype, packed.clone())
    kernel = PackedLinear(cols, rows, qtype, packed.clone())
    assert kernel.use_int4_layout(), f"{qtype.name} {rows} x {cols} has no int4 layout"
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(SEED))
    xb = x.bfloat16()
    exact = {"bf16": xb.double() @ exact_weight.T, "f32": x.double() @ exact_weight.T}

    def expand(inputs):
        return chunked_linear(inputs, expanding.weight_rows, rows, cols)

    candidates = {
        "int4 kernel": (lambda: kernel(xb), "bf16"),
        "expand bf16": (lambda: expand(xb), "bf16"),
        "expand f32": (lambda: expand(x), "f32"),
        "comfy-style bf16": (lambda: F.linear(xb, comfy_style_dequantize(packed, qtype, (rows, cols), torch.bfloat16)), "bf16"),
    }
    compile_s = None
    if compiled:
        call, compile_s = compiled_int4(kernel, xb)
        candidates["inductor int4"] = (lambda: call(xb), "bf16")
    with torch.no_grad():
        best, errors = best_of({k: fn for k, (fn, _) in candidates.items()}, repeats,
                               check=lambda name, out: relative_error(out, exact[candidates[name][1]]))
    flops = 2 * tokens * rows * cols
    kernel_wall = best["int4 kernel"].wall
    return {"tokens": tokens, "compile_s": compile_s, "rows": [{"impl": name, **best[name].as_dict(), "gflops": flops / best[name].wall / 1e9,
                                        "kernel_speedup": best[name].wall / kernel_wall,
                                        "relative_error": errors[name]} for name in candidates]}


def print_report(record: dict) -> None:
    rows, cols = record["shape"]
    print(f"{record['qtype']} {rows} x {cols}, best of {record['repeats']}, torch threads {record['threads']['torch']}, "
          f"{record['bf16_units']}; load average {record['machine_before']['load_average']} -> "
          f"{record['machine_after']['load_average']}")
    for entry in record["results"]:
        compile_note = f" (inductor int4 compiled in {entry['compile_s']:.0f} s)" if entry.get("compile_s") else ""
        print(f"\n{entry['tokens']} rows{compile_note}: {'impl':<17} {'wall s':>7} {'GFLOPS':>7} {'kernel x':>8} {'error vs f64':>12}")
        for r in entry["rows"]:
            print(f"{'':>{len(str(entry['tokens'])) + 7}}{r['impl']:<17} {r['wall']:7.3f} {r['gflops']:7.1f} "
                  f"{r['kernel_speedup']:8.2f} {r['relative_error']:12.2e}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16384x6144", help="out x in (Krea 2: 6144x6144, 16384x6144, 6144x16384)")
    parser.add_argument("--type", default="Q4_K", choices=["Q4_K", "Q4_0", "Q4_1"])
    parser.add_argument("--tokens", default="64,128,256,1024", help="rows of x, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    parser.add_argument("--compiled", action="store_true",
                        help="also time inductor's int4 GEMM (torch.compile max-autotune, frozen weights; compiles per row count)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, cols = (int(n) for n in args.shape.lower().split("x"))
    qtype = Q[args.type]
    record = {"qtype": qtype.name, "shape": [rows, cols], "repeats": args.repeats, "threads": threads_record(),
              "bf16_units": cpu_bf16().reason, "cpu": cpu_record(), "machine_before": machine_state(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    record["results"] = [bench_rows(qtype, rows, cols, int(t), args.repeats, args.compiled) for t in args.tokens.split(",")]
    record["machine_after"] = machine_state()
    print_report(record)
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    return record


if __name__ == "__main__":
    main()
