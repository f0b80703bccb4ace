"""Full-size Krea 2 (12.8B, random weights) LoRA r32 at 1024 px on one GPU, with the frozen base
stored as fp8 (per-row scale) or NF4, with and without block swap: s/step and peak GPU memory, the
figure to compare against 16 / 24 GB cards.

    python bench/device/bench_lora_quantized_full.py                  # fp8, fp8+swap, nf4, nf4+swap
    python bench/device/bench_lora_quantized_full.py --tiny           # CPU smoke run of the same code
    python bench/device/bench_lora_quantized_full.py --variants fp8-swap14 --steps 5

Drives the trainer's own code: ``quantize_base``, ``add_lora`` and ``engine.parallel.wrap_model``
(activation checkpointing ``full``, block swap of the last N blocks on a side CUDA stream). The base
comes through the library's streamed quantized loader from the random checkpoint
(bench/full_size_models.py, written first if missing), quantized block by block on the GPU as a
24 GB card needs it; block swap then moves its blocks' frozen weights to pinned host memory; the peak is measured from the first training step,
so it is what a training step needs on the card. Also prints the ``--dry-run`` plan's total for the
same setup, so the plan can be checked against the measurement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_full import (  # noqa: E402
    FULL_CONFIG, TINY_CONFIG, parse_step_arguments, release_memory, time_steps)
from full_size_models import streamed_transformer  # noqa: E402

from finetune.config import LoRAConfig, OptimizerConfig, build_config  # noqa: E402
from finetune.engine.parallel import wrap_model  # noqa: E402
from finetune.methods import add_lora, quantize_base  # noqa: E402
from finetune.optimization.optim import make_optimizer  # noqa: E402

VARIANTS = {"fp8": ("fp8", 0), "fp8-swap14": ("fp8", 14), "nf4": ("nf4", 0), "nf4-swap14": ("nf4", 14)}
GIB = 1024**3


def planned_gib(quantize: str, offload: int, args) -> float | None:
    """The ``--dry-run`` plan's total for this setup (full size only)."""
    if args.tiny:
        return None
    import finetune.model as model_module
    from finetune.dryrun import build_plan
    from finetune.engine.weights import MemoryWeights

    model_module.transformer_weights = lambda config: (dict(FULL_CONFIG), MemoryWeights({}))
    config = build_config({"output_dir": "/tmp/plan", "data": {"synthetic": {}, "resolution": args.resolution},
                           "model": {"quantize": quantize, "dtype": "bfloat16", "max_sequence_length": args.text_len},
                           "training": {"activation_checkpointing": "full", "offload_blocks": offload,
                                        "mixed_precision": "bf16", "batch_size": 1},
                           "lora": {"rank": args.rank, "alpha": args.rank,
                                    "train_text_fusion": False}})  # the blocks only, as first measured
    plan, _ = build_plan(config, 1)
    return plan.total / GIB


def run_variant(name: str, args, device: torch.device) -> dict:
    quantize, offload = VARIANTS[name]
    config = TINY_CONFIG if args.tiny else FULL_CONFIG
    offload = min(offload, config.get("num_layers", 28) - 1)
    try:
        model = streamed_transformer(quantize, device, None if config == FULL_CONFIG else config)
        quantize_base(model, quantize, torch.bfloat16)  # nothing left to quantize: it came in quantized
    except Exception as err:  # bitsandbytes missing: report, never fall back
        return {"variant": name, "skipped": f"{type(err).__name__}: {err}"}
    params = add_lora(model, LoRAConfig(rank=args.rank, alpha=float(args.rank)))
    model.train()
    runtime = SimpleNamespace(strategy="single", device=device)
    blocks = list(model.transformer_blocks)
    model = wrap_model(model, blocks, runtime, activation_checkpointing="full", compile=False,
                       mixed_precision="bf16", offloaded_blocks=offload)
    optimizer = make_optimizer(params, OptimizerConfig(name="adamw", learning_rate=1e-4))
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = time_steps(model, params, optimizer, config, args, device)
    result = {"variant": name, "quantize": quantize, "offload_blocks": offload, "s_per_step": sum(times) / len(times),
              "peak_gib": torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None,
              "reserved_gib": torch.cuda.max_memory_reserved() / GIB if device.type == "cuda" else None,
              "plan_gib": planned_gib(quantize, offload, args), "loss": loss.item()}
    del model, optimizer, params, loss
    release_memory(device)
    return result


def main() -> None:
    args, device = parse_step_arguments(__doc__.splitlines()[0], VARIANTS)
    results = [run_variant(v, args, device) for v in args.variants.split(",")]
    print(f"{'variant':12} {'s/step':>8} {'peak GiB':>9} {'reserved':>9} {'plan GiB':>9}  ({args.resolution}px, LoRA r{args.rank}, checkpointing full)")
    for r in results:
        if "skipped" in r:
            print(f"{r['variant']:12} skipped: {r['skipped'][:120]}")
            continue
        cells = [f"{r[k]:9.2f}" if r[k] is not None else f"{'-':>9}" for k in ("peak_gib", "reserved_gib", "plan_gib")]
        print(f"{r['variant']:12} {r['s_per_step']:8.3f} {' '.join(cells)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
