"""LoRA on a frozen base stored as bf16 / fp8 (per-row scale) / int8 / NF4: steps/s and the base's
resident bytes, side by side in one process, on a proportioned model (CPU or GPU).

    python bench/bench_lora_bases.py                       # ~170 MB-fp32 model, 256 px, 3 timed steps
    python bench/bench_lora_bases.py --layers 4 --steps 5 --json out.json

Random weights and inputs (speed and bytes do not depend on the values). The model is quantized
and adapted by the trainer's own code (``finetune.methods.quantize_base`` / ``add_lora``); a base
bitsandbytes cannot run on is reported as skipped, not replaced.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config import LoRAConfig  # noqa: E402
from finetune.methods import add_lora, quantize_base  # noqa: E402
from finetune.optimization.objective import add_noise, flow_matching_loss  # noqa: E402
from krea2_diffusers.latents import position_ids  # noqa: E402
from krea2_diffusers.models.tiny import proportioned_transformer_config, randomize_  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402

BASES = ("none", "fp8", "int8", "nf4")


def frozen_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.requires_grad)


def run(base: str, config: dict, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = Krea2Transformer2DModel(**config)
    randomize_(model, torch.Generator().manual_seed(0))
    fp32 = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    model.to(torch.bfloat16)
    try:
        quantize_base(model, base, torch.bfloat16)
    except Exception as err:  # bitsandbytes missing or unable to run here
        return {"base": base, "skipped": f"{type(err).__name__}: {err}"}
    add_lora(model, LoRAConfig(rank=args.rank, alpha=float(args.rank)))
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    grid = args.resolution // 16
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, grid * grid, 64, generator=generator).to(device)
    text = torch.randn(1, args.text_len, config["num_text_layers"], config["text_hidden_dim"], generator=generator).to(device)
    positions = position_ids(args.text_len, grid, grid, device=device)
    times = []
    for step in range(args.warmup + args.steps):
        noise = torch.randn(x0.shape, generator=generator).to(device)
        t = torch.rand(1, generator=generator).to(device)
        start = time.perf_counter()
        pred = model(hidden_states=add_noise(x0, noise, t), encoder_hidden_states=text, timestep=t,
                     position_ids=positions).sample
        flow_matching_loss(pred, x0, noise, t).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"base": base, "steps_per_s": len(times) / sum(times), "frozen_bytes": frozen_bytes(model), "fp32_bytes": fp32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--text-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bases", default=",".join(BASES))
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = proportioned_transformer_config(num_layers=args.layers)
    results = [run(b, config, args, device) for b in args.bases.split(",")]
    reference = next((r for r in results if r["base"] == "none" and "skipped" not in r), None)
    print(f"{'base':6} {'steps/s':>8} {'frozen MB':>10} {'/ fp32':>7} {'speed vs bf16':>14}   ({device}, {args.resolution}px, LoRA r{args.rank})")
    for r in results:
        if "skipped" in r:
            print(f"{r['base']:6} skipped: {r['skipped'][:100]}")
            continue
        speed = f"{r['steps_per_s'] / reference['steps_per_s']:.2f}x" if reference else "-"
        print(f"{r['base']:6} {r['steps_per_s']:8.3f} {r['frozen_bytes'] / 1e6:10.1f} {r['frozen_bytes'] / r['fp32_bytes']:7.3f} {speed:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
