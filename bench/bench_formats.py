"""Resident size, speed, load-time peak RSS and quality of each weight format, on a tiny model
with Krea 2's proportions (head dim 128, GQA 4:1, SwiGLU rule, 12 tapped text layers).

    python bench/bench_formats.py [--layers 6] [--steps 3]

Each format is loaded in a fresh subprocess so its peak RSS is its own. "error" is the relative
L2 error of one velocity prediction against the fp32 model. CPU, float32 compute (the packed
formats dequantize to float32 per layer), so s/step compares formats, not hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# D = 1024 (8 x 128, kv 2), SwiGLU 2816 = rule(1024); text 768 (6 x 128), SwiGLU 2048 = rule(768).
# Every width is a multiple of 256, so every GGML type (K-quants included) applies.
CONFIG = dict(
    in_channels=64, attention_head_dim=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2816,
    timestep_embed_dim=256, text_hidden_dim=768, num_text_layers=12, text_num_attention_heads=6,
    text_num_key_value_heads=6, text_intermediate_size=2048, num_layerwise_text_blocks=2, num_refiner_text_blocks=2,
    axes_dims_rope=(32, 48, 48),
)
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0")
FORMATS = ("fp32", "bf16", *GGUF_TYPES, "fp8", "int8", "nf4")
IMAGE_GRID, TEXT_LEN = 12, 32  # 144 image tokens (a 192x192 image) and 32 text tokens
KIB = 1024
MIB = 1024**2


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * KIB  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux clear_refs "5"); returns current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        # without the reset the peak includes the imports; report that rather than hide it
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    return _status_bytes("VmHWM")


def make_inputs(config) -> dict:
    g = torch.Generator().manual_seed(1)
    n = IMAGE_GRID * IMAGE_GRID
    grid = torch.stack([torch.zeros(n, dtype=torch.long), torch.arange(n) // IMAGE_GRID, torch.arange(n) % IMAGE_GRID], 1)
    return dict(
        hidden_states=torch.randn(1, n, config["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, config["num_text_layers"], config["text_hidden_dim"], generator=g),
        timestep=torch.tensor([0.6]),
        position_ids=torch.cat([torch.zeros(TEXT_LEN, 3, dtype=torch.long), grid]),
    )


def build_files(folder: Path, layers: int) -> None:
    """Random fp32 model (variance-preserving init) saved as fp32/bf16 safetensors and every GGUF type."""
    from krea2_diffusers import Krea2Transformer2DModel, convert_diffusers_to_original
    from krea2_diffusers.files import save_safetensors
    from krea2_diffusers.quantization.gguf import quantize_checkpoint

    torch.manual_seed(0)
    model = Krea2Transformer2DModel(**CONFIG, num_layers=layers).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = param.shape[1] ** -0.5 if param.ndim == 2 and name.endswith("weight") else 0.3
            param.copy_(torch.randn_like(param) * scale)
        reference = model(**make_inputs(model.config)).sample
    torch.save(reference, folder / "reference.pt")  # our own tensor, read back with weights_only=True
    state = convert_diffusers_to_original(model.state_dict())
    save_safetensors(state, folder / "fp32.safetensors")
    save_safetensors({k: v.to(torch.bfloat16) if v.ndim == 2 else v for k, v in state.items()}, folder / "bf16.safetensors")
    for qtype in GGUF_TYPES:
        quantize_checkpoint(folder / "bf16.safetensors", folder / f"{qtype}.gguf", qtype)


def load(fmt: str, folder: Path):
    from krea2_diffusers import Krea2Transformer2DModel

    if fmt in GGUF_TYPES:
        return Krea2Transformer2DModel.from_single_file(folder / f"{fmt}.gguf", torch_dtype=torch.float32)
    if fmt == "bf16":  # bf16 storage and compute, as shipped
        return Krea2Transformer2DModel.from_single_file(folder / "bf16.safetensors", torch_dtype=torch.bfloat16)
    source = "fp32" if fmt == "fp32" else "bf16"
    # the converted formats are built from a float32 load: their load peak includes that copy
    model = Krea2Transformer2DModel.from_single_file(folder / f"{source}.safetensors", torch_dtype=torch.float32)
    if fmt == "fp8":  # the project's one fp8 layer (per-row scale), as `memory=` presets and `krea2 quantize` use it
        from krea2_diffusers.quantization.fp8 import quantize_transformer_fp8_

        quantize_transformer_fp8_(model, compute_dtype=torch.float32)
    elif fmt in ("int8", "nf4"):
        from krea2_diffusers.quantization.bnb import quantize_transformer_

        quantize_transformer_(model, fmt, compute_dtype=torch.float32)
    return model


def measure(fmt: str, folder: Path, steps: int) -> dict:
    """Runs in the child process: load, then time ``steps`` forward passes."""
    import krea2_diffusers.models.transformer  # noqa: F401  (imports are not part of the load cost)
    from krea2_diffusers.quantization.gguf import resident_bytes

    torch.set_num_threads(os.cpu_count() or 1)
    before = reset_peak_rss()
    start = time.perf_counter()
    model = load(fmt, folder)
    load_s = time.perf_counter() - start
    load_peak = peak_rss() - before
    inputs = make_inputs(model.config)
    with torch.no_grad():
        out = model(**inputs).sample.float()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            model(**inputs)
        step_s = (time.perf_counter() - start) / steps
    reference = torch.load(folder / "reference.pt", weights_only=True)
    error = float((out - reference).norm() / reference.norm())
    return dict(format=fmt, resident=resident_bytes(model), load_peak=load_peak, load_s=load_s, step_s=step_s, error=error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (the release has 28)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: FORMAT
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, Path(args.folder), args.steps)))
        return
    with tempfile.TemporaryDirectory(prefix="krea2-bench-") as tmp:
        folder = Path(tmp)
        build_files(folder, args.layers)
        rows = []
        for fmt in args.formats.split(","):
            proc = subprocess.run([sys.executable, __file__, "--measure", fmt, "--folder", tmp, "--steps", str(args.steps)],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(f"{fmt}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        files = {p.stem: p.stat().st_size for p in folder.iterdir() if p.suffix in (".gguf", ".safetensors")}
    base = next((r["resident"] for r in rows if r["format"] == "fp32"), None)
    print(f"tiny proportioned Krea 2: {args.layers} blocks, D=1024, {IMAGE_GRID**2} image + {TEXT_LEN} text tokens, CPU x{os.cpu_count()}")
    print(f"{'format':<7} {'file MiB':>9} {'resident MiB':>13} {'vs fp32':>8} {'load peak RSS MiB':>18} {'load s':>7} {'s/step':>7} {'rel error':>10}")
    for r in rows:
        ratio = f"{r['resident'] / base:.3f}" if base else "-"
        file_size = files.get(r["format"])
        file_mib = f"{file_size / MIB:.1f}" if file_size else "-"
        print(f"{r['format']:<7} {file_mib:>9} {r['resident'] / MIB:>13.1f} {ratio:>8} {r['load_peak'] / MIB:>18.1f} "
              f"{r['load_s']:>7.2f} {r['step_s']:>7.3f} {r['error']:>10.2e}")


if __name__ == "__main__":
    main()
