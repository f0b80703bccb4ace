"""GGUF dequantization of one Krea 2-sized layer, side by side, and the forward that consumes it.

    python bench/bench_dequant.py [--shape 6144x6144] [--types Q4_K,Q8_0,Q6_K] [--repeats 3]
                                  [--tokens 1056] [--forward-dtypes f32,bf16] [--threads 1] [--json OUT]

For each type, in one process, calls alternate (so a neighbour's load hits every candidate alike)
and each candidate keeps its fastest of ``--repeats``:

- ``ours``: :func:`krea2_diffusers.quantization.gguf.dequant.dequantize`, float32 block values
  rounded once to the output dtype, expanded a chunk at a time into a reused scratch buffer;
- ``before``: the implementation it replaced (this project's code at f0d6f02, kept below for
  the comparison): arithmetic in the output dtype on whole-matrix temporaries;
- ``comfy-style``: the same ggml math written the way ComfyUI-GGUF's torch dequantizers are (one
  function per type over the whole tensor, the fp16 scales cast to the layer's dtype and every
  product in it). Written here from the ggml block layouts, not taken from ComfyUI-GGUF, whose
  source is not installed on this machine; its default dequant dtype may differ from the target's;
- ``gguf-py``: ``gguf.quants.dequantize`` (numpy, float32), the exactness reference;
- ``fresh pages``: allocating and filling a tensor of the output's size: what faulting in the
  result alone costs (and the system time of one fault), so the other rows' system time and
  faults can be read against it.

Each row gives wall, user and system CPU seconds and minor page faults of its best call
(:class:`krea2_diffusers.cpu_usage.Usage`), ``ours / this`` wall ratio, the largest difference
to gguf-py's float32 values (for bf16, mostly bf16's own rounding) and the fraction of values
that differ from those values rounded once to the dtype: 0 when the result is exact.

The forward section times, for ``--forward-type`` at each dtype: ``x (tokens, in) @ W.T`` on an
already expanded ``W`` (the matmul alone), and :class:`PackedLinear`'s forward (the layer as the
model runs it: output rows dequantized a few MiB at a time, each chunk's matmul right after). The
difference is what dequantization adds; the "est." figures put each candidate's whole-matrix
dequantization time in its place (matmul + dequantize, the way a layer expanding whole would run).
``--chunk-sweep`` times ``ours`` (bf16) at other ``CHUNK_VALUES``.

The packed bytes: gguf-py's quantizer where it has one (Q8_0), else this package's
(:func:`krea2_diffusers.quantization.gguf.quantizer.quantize`, the K-quants), of N(0, 0.02)
weights. On a CPU without native bf16 matmul (AVX2 only) the bf16 matmul is several times slower
than float32's, so bf16's forward is matmul-bound whatever the dequantization costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

sys.path.insert(0, str(Path(__file__).resolve().parent))

from full_size_record import cpu_record, machine_state, threads_record  # noqa: E402

from krea2_diffusers.cpu_usage import Usage  # noqa: E402
from krea2_diffusers.quantization.gguf import dequant  # noqa: E402
from krea2_diffusers.quantization.gguf.packed import PackedLinear  # noqa: E402
from krea2_diffusers.quantization.gguf.qtypes import block_geometry  # noqa: E402
from krea2_diffusers.quantization.gguf.quantizer import quantize  # noqa: E402

Q = GGMLQuantizationType
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
WEIGHT_STD = 0.02
SEED = 0

# --- the implementation before the rewrite (f0d6f02's dequant.py, the three types benched) -----


def k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes -> two ``(n, 8)`` uint8 tensors of 6-bit sub-block scales and mins
    (bytes 0-3: scales 0-3 and the top 2 bits of scales 4-7; 4-7: the same for the mins; 8-11:
    the low 4 bits of scales 4-7 in the low nibble, of mins 4-7 in the high one)."""
    lo_sc, lo_mn, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & 0x3F, (mixed & 0x0F) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_mn & 0x3F, (mixed >> 4) | ((lo_mn >> 6) << 4)), dim=1)
    return sc, mn


def _fp16_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).to(dtype)


def _before_q8_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).to(dtype).mul_(_fp16_as(b[:, :2], dtype))


def _before_q4_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d, dmin = _fp16_as(b[:, 0:2], dtype), _fp16_as(b[:, 2:4], dtype)
    sc, mn = k_scales_mins(b[:, 4:16])
    scale = (d * sc.to(dtype)).unsqueeze(-1)
    offset = (dmin * mn.to(dtype)).unsqueeze(-1)
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2)
    return (scale * q.view(-1, 8, 32).to(dtype) - offset).flatten(1)


def _before_q6_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(dtype)
    d = _fp16_as(b[:, 208:210], dtype)
    low = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, -1, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 3).reshape(-1, 2, 128)
    q = (low | (high << 4)).to(dtype).reshape(-1, 16, 16) - 32
    return ((d * scales).unsqueeze(-1) * q).flatten(1)


BEFORE = {Q.Q8_0: _before_q8_0, Q.Q4_K: _before_q4_k, Q.Q6_K: _before_q6_k}


def before_dequantize(packed: torch.Tensor, qtype, shape, dtype) -> torch.Tensor:
    """The replaced ``dequantize``: every operation in ``dtype`` over the whole tensor at once."""
    return BEFORE[qtype](packed.reshape(-1, block_geometry(qtype)[1]), dtype).reshape(shape)


# --- ComfyUI-GGUF's style: one whole-tensor function per type, scales in the target dtype ------


def _comfy_q8_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = b[:, :2].contiguous().view(torch.float16).to(dtype)
    return d * b[:, 2:].contiguous().view(torch.int8)


def _comfy_q4_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    d = b[:, 0:2].contiguous().view(torch.float16).to(dtype)
    dmin = b[:, 2:4].contiguous().view(torch.float16).to(dtype)
    sc, mn = k_scales_mins(b[:, 4:16])
    # each 32-byte group holds two sub-blocks: low nibbles, then high nibbles
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    q = ((b[:, 16:].reshape(n, 4, 1, 32) >> shifts) & 0x0F).reshape(n, 8, 32)
    return ((d * sc).view(n, 8, 1) * q - (dmin * mn).view(n, 8, 1)).reshape(n, 256)


def _comfy_q6_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    d = b[:, 208:210].contiguous().view(torch.float16).to(dtype)
    sc = b[:, 192:208].contiguous().view(torch.int8)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 2, 128) | (high.reshape(n, 2, 128) << 4)).to(torch.int8) - 32
    return ((d * sc).view(n, 16, 1) * q.view(n, 16, 16)).reshape(n, 256)


COMFY_STYLE = {Q.Q8_0: _comfy_q8_0, Q.Q4_K: _comfy_q4_k, Q.Q6_K: _comfy_q6_k}


def comfy_style_dequantize(packed: torch.Tensor, qtype, shape, dtype) -> torch.Tensor:
    """ComfyUI-GGUF's way: the whole tensor at once, in the layer's dtype."""
    return COMFY_STYLE[qtype](packed.reshape(-1, block_geometry(qtype)[1]), dtype).reshape(shape)


# --- measuring -------------------------------------------------------------------------------


def packed_weight(qtype, rows: int, cols: int) -> tuple[np.ndarray, str]:
    """GGML bytes of N(0, 0.02) weights and which quantizer made them."""
    weights = np.random.default_rng(SEED).standard_normal((rows, cols), dtype=np.float32) * WEIGHT_STD
    try:
        return gguf_quants.quantize(weights, qtype), "gguf-py"
    except NotImplementedError:  # gguf-py quantizes the legacy types only
        return quantize(weights, qtype), "krea2_diffusers"


def timed(fn):
    start = Usage.now()
    out = fn()
    return out, Usage.now() - start


def best_of(candidates: dict, repeats: int, check=None) -> tuple[dict, dict]:
    """Each candidate's fastest call of ``repeats``, calls alternating; ``check(name, out)`` on the
    first round's outputs (then dropped, so one result is alive at a time)."""
    best, checks = {}, {}
    for round_ in range(repeats):
        for name, fn in candidates.items():
            out, spent = timed(fn)
            if round_ == 0 and check is not None:
                checks[name] = check(name, out)
            del out
            if name not in best or spent.wall < best[name].wall:
                best[name] = spent
    return best, checks


def exactness(out, reference: torch.Tensor, dtype: torch.dtype) -> dict:
    out = torch.as_tensor(out)
    rounded = reference.to(dtype)
    return {"max_abs_diff": float((out.float() - reference).abs().max()),
            "differ_from_once_rounded": float((out != rounded).double().mean()),
            "is_once_rounded": bool(torch.equal(out, rounded))}


def bench_type(qtype, rows: int, cols: int, repeats: int) -> dict:
    raw, source = packed_weight(qtype, rows, cols)
    packed = torch.from_numpy(raw)
    reference = torch.from_numpy(gguf_quants.dequantize(raw, qtype))
    candidates = {"gguf-py/f32": lambda: gguf_quants.dequantize(raw, qtype)}
    impls = {"ours": dequant.dequantize, "before": before_dequantize, "comfy-style": comfy_style_dequantize}
    for label, dtype in DTYPES.items():
        for impl, fn in impls.items():
            candidates[f"{impl}/{label}"] = lambda fn=fn, dtype=dtype: fn(packed, qtype, (rows, cols), dtype)
        candidates[f"fresh pages/{label}"] = lambda dtype=dtype: torch.empty(rows, cols, dtype=dtype).fill_(1)

    def check(name, out):
        impl, label = name.split("/")
        return None if impl == "fresh pages" else exactness(out, reference, DTYPES[label])

    def row(name):
        impl, label = name.split("/")
        spent = best[name]
        if impl == "fresh pages":  # the kernel's price of one fresh page, the figure the faults are read with
            return {"impl": impl, "dtype": label, **spent.as_dict(),
                    "system_us_per_fault": spent.system / max(1, spent.minor_faults) * 1e6}
        return {"impl": impl, "dtype": label, **spent.as_dict(),
                "ours_over_this": best[f"ours/{label}"].wall / spent.wall, **checks[name]}

    best, checks = best_of(candidates, repeats, check)
    return {"qtype": qtype.name, "bytes_from": source, "max_abs_weight": float(reference.abs().max()),
            "rows": [row(name) for name in candidates]}


def bench_forward(qtype, rows: int, cols: int, tokens: int, repeats: int, dequant_rows: list[dict],
                  labels: list[str]) -> list[dict]:
    raw, _ = packed_weight(qtype, rows, cols)
    layer = PackedLinear(cols, rows, qtype, torch.from_numpy(raw))
    flops = 2 * tokens * rows * cols
    walls = {(r["impl"], r["dtype"]): r["wall"] for r in dequant_rows}
    out = []
    for label in labels:
        dtype = DTYPES[label]
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(SEED)).to(dtype)
        weight = layer.dequantized_weight(dtype)
        with torch.no_grad():
            best, _ = best_of({"matmul": lambda: F.linear(x, weight), "forward": lambda: layer(x)}, repeats)
        matmul, forward = best["matmul"].wall, best["forward"].wall
        entry = {"dtype": label, "tokens": tokens,
                 "matmul": best["matmul"].as_dict(), "forward": best["forward"].as_dict(),
                 "matmul_gflops": flops / matmul / 1e9, "forward_gflops": flops / forward / 1e9,
                 "dequant_share_of_forward": 1 - matmul / forward,
                 # CPU seconds: with one thread, the time the process had a core, steadier than wall
                 # when neighbours take turns on it
                 "forward_gflops_cpu": flops / best["forward"].cpu / 1e9,
                 "dequant_share_of_forward_cpu": 1 - best["matmul"].cpu / best["forward"].cpu,
                 "ours_whole_matrix_over_forward": walls[("ours", label)] / forward,
                 "est_forward_gflops": {impl: flops / (matmul + walls[(impl, label)]) / 1e9
                                        for impl in ("ours", "before", "comfy-style")}}
        out.append(entry)
        del weight
    return out


def chunk_sweep(qtype, rows: int, cols: int, sizes: list[int], repeats: int) -> list[dict]:
    """``ours`` to bf16 at each ``CHUNK_VALUES`` (the module's constant, restored after)."""
    packed = torch.from_numpy(packed_weight(qtype, rows, cols)[0])
    kept = dequant.CHUNK_VALUES

    def at(size):
        dequant.CHUNK_VALUES = size
        try:
            return dequant.dequantize(packed, qtype, (rows, cols), torch.bfloat16)
        finally:
            dequant.CHUNK_VALUES = kept

    best, _ = best_of({size: lambda size=size: at(size) for size in sizes}, repeats)
    return [{"chunk_values": size, **best[size].as_dict()} for size in sizes]


def print_report(record: dict) -> None:
    rows, cols = record["shape"]
    print(f"{rows} x {cols}, best of {record['repeats']}, torch threads {record['threads']['torch']}, "
          f"load average {record['machine_before']['load_average']} -> {record['machine_after']['load_average']}, "
          f"THP {record['machine_before']['transparent_hugepage']}")
    head = f"{'impl':<12} {'dtype':<5} {'wall s':>7} {'user s':>7} {'sys s':>6} {'faults':>8} {'ours/this':>9} " \
           f"{'max|d-ref|':>10} {'!=once-rounded':>14}"
    for t in record["types"]:
        print(f"\n{t['qtype']} (bytes from {t['bytes_from']}, max |w| {t['max_abs_weight']:.3g})\n{head}")
        for r in t["rows"]:
            if "max_abs_diff" in r:
                tail = f"{r['ours_over_this']:9.2f} {r['max_abs_diff']:10.3g} {r['differ_from_once_rounded']:13.1%}"
            else:
                tail = f"{'':9} ({r['system_us_per_fault']:.2f} us of system time a fault)"
            print(f"{r['impl']:<12} {r['dtype']:<5} {r['wall']:7.3f} {r['user']:7.3f} {r['system']:6.3f} "
                  f"{r['minor_faults']:8.0f} {tail}")
    for f in record.get("forward", []):
        est = ", ".join(f"{k} {v:.1f}" for k, v in f["est_forward_gflops"].items())
        print(f"\nforward {record['forward_type']} {f['dtype']}, {f['tokens']} tokens: "
              f"matmul {f['matmul']['wall']:.3f} s ({f['matmul_gflops']:.1f} GFLOPS), "
              f"PackedLinear {f['forward']['wall']:.3f} s ({f['forward_gflops']:.1f} "
              f"GFLOPS, {f['forward']['minor_faults']:.0f} faults); dequant {f['dequant_share_of_forward']:.0%} of it; "
              f"on CPU seconds {f['forward_gflops_cpu']:.1f} GFLOPS, dequant {f['dequant_share_of_forward_cpu']:.0%}; "
              f"whole-matrix ours / forward {f['ours_whole_matrix_over_forward']:.2f}; est. GFLOPS with whole-matrix "
              f"dequant: {est}")
    for c in record.get("chunk_sweep", []):
        print(f"chunk {c['chunk_values']:>8}: ours bf16 {c['wall']:.3f} s, {c['minor_faults']:.0f} faults")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6144x6144", help="out x in of the layer (Krea 2: 6144x6144, 16384x6144)")
    parser.add_argument("--types", default="Q4_K,Q8_0,Q6_K")
    parser.add_argument("--repeats", type=int, default=3, help="calls per candidate; the fastest is kept")
    parser.add_argument("--tokens", type=int, default=1056, help="rows of x in the forward; 0 skips the forward")
    parser.add_argument("--forward-type", default="Q4_K")
    parser.add_argument("--forward-dtypes", default="f32,bf16", help="dtypes of x and W in the forward")
    parser.add_argument("--forward-repeats", type=int, default=1)
    parser.add_argument("--chunk-sweep", default="65536,262144,1048576", help="CHUNK_VALUES to try; '' skips")
    # One thread by default: on a shared machine a neighbour descheduling one of torch's threads
    # stalls every parallel region at its barrier, and the chunked loop's ~1,000 small regions
    # then measured 5-30x slower than one thread, swinging run to run. 0: torch's own count.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default")
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, cols = (int(n) for n in args.shape.lower().split("x"))
    types = [Q[name] for name in args.types.split(",") if name]
    record = {"shape": [rows, cols], "repeats": args.repeats, "threads": threads_record(),
              "cpu": cpu_record(), "machine_before": machine_state(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "types": [bench_type(qtype, rows, cols, args.repeats) for qtype in types]}
    forward_type = Q[args.forward_type]
    if args.tokens:
        dequant_rows = next((t["rows"] for t in record["types"] if t["qtype"] == forward_type.name), None)
        if dequant_rows is None:
            dequant_rows = bench_type(forward_type, rows, cols, args.repeats)["rows"]
        record["forward_type"] = forward_type.name
        record["forward"] = bench_forward(forward_type, rows, cols, args.tokens, args.forward_repeats, dequant_rows,
                                          args.forward_dtypes.split(","))
    if args.chunk_sweep:
        sizes = [int(s) for s in args.chunk_sweep.split(",")]
        record["chunk_sweep"] = chunk_sweep(forward_type, rows, cols, sizes, args.repeats)
    record["machine_after"] = machine_state()
    print_report(record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
