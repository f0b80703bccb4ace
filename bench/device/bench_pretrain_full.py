"""A short 256 px pretraining stage of the full-width Krea 2 architecture (random init), one GPU:
samples/s, MFU and peak memory, AdamW vs Muon.

    python bench/device/bench_pretrain_full.py                       # 12 of the 28 blocks, both optimizers
    python bench/device/bench_pretrain_full.py --num-layers 28 --optimizers muon   # needs > 1 GPU's memory
    python bench/device/bench_pretrain_full.py --tiny                # CPU smoke run of the same code

Why not all 28 blocks by default: pretraining keeps fp32 master weights, their gradients and the
optimizer state, 16 bytes/parameter with AdamW (12 with Muon's single momentum): the 12.8B model
needs ~205 GB (AdamW) / ~155 GB (Muon) before activations, more than one 141 GB H200 holds; the
real run shards it over GPUs with FSDP2 (``torchrun -m finetune.pretrain``). The bench keeps the
full width and cuts depth, and extrapolates samples/s to 28 blocks (blocks dominate the FLOPs).

One step = forward + backward + optimizer step at --batch images of 256x256 (256 image tokens)
plus --text-len text tokens, bf16 autocast over fp32 weights, selective activation checkpointing
(the recipe's low-resolution setting), scratch init (:func:`init_from_scratch_`), the recipe's
optimizer split. Text features and latents are random: the frozen encoders are not part of the
transformer's step (text can be precomputed into the pack). MFU = model FLOPs / (s x peak bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from finetune.config import ObjectiveConfig  # noqa: E402
from finetune.engine.parallel import apply_activation_checkpointing  # noqa: E402
from finetune.optimization.objective import add_noise, flow_matching_loss  # noqa: E402
from finetune.optimization.timesteps import sample_timesteps  # noqa: E402
from finetune.pretrain.architecture import init_from_scratch_, transformer_config  # noqa: E402
from finetune.pretrain.config import PretrainModelConfig, PretrainOptimizerConfig  # noqa: E402
from finetune.pretrain.optimizers import make_optimizers  # noqa: E402
from krea2_diffusers.latents import position_ids  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402

# Dense bf16 tensor-core peak (FLOP/s) by device name; MFU is left out for unknown devices.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}
GIB = 1024**3


def model_flops_per_step(model: Krea2Transformer2DModel, batch: int, image_tokens: int, text_len: int) -> float:
    """6 x (matmul parameters x tokens they see) for the blocks, the text fusion (layer-wise blocks
    see each text token's stack of tapped layers, the refiner the text tokens) and the in/out
    layers, plus attention scores and values of the main blocks (4 x seq^2 x dim per block forward,
    x3 for training). Small layers (embeddings, text projection) are left out."""
    seq = image_tokens + text_len
    dim = model.config.attention_head_dim * model.config.num_attention_heads

    def matmul_params(module):
        return sum(p.numel() for n, p in module.named_parameters() if n.endswith("weight") and p.ndim == 2)

    fusion = model.text_fusion
    flops = 6 * batch * (matmul_params(model.transformer_blocks) * seq
                         + matmul_params(fusion.layerwise_blocks) * text_len * model.config.num_text_layers
                         + matmul_params(fusion.refiner_blocks) * text_len)
    flops += 6 * batch * (model.img_in.weight.numel() + model.final_layer.linear.weight.numel()) * image_tokens
    flops += 3 * 4 * batch * seq * seq * dim * model.config.num_layers
    return float(flops)


def run(optimizer_name: str, args, device: torch.device) -> dict:
    config = transformer_config(PretrainModelConfig(architecture="tiny" if args.tiny else "krea2"))
    if args.num_layers and not args.tiny:
        config["num_layers"] = args.num_layers
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**config)
    model.to_empty(device=device)
    torch.manual_seed(0)
    init_from_scratch_(model)
    apply_activation_checkpointing(list(model.transformer_blocks), args.activation_checkpointing)
    model.train()
    optimizers, split = make_optimizers(model, PretrainOptimizerConfig(name=optimizer_name, learning_rate=1e-4))
    grid = args.resolution // 16
    tokens = grid * grid
    generator = torch.Generator().manual_seed(0)
    text = torch.randn(args.batch, args.text_len, config["num_text_layers"], config["text_hidden_dim"], generator=generator)
    text, x0 = text.to(device, torch.bfloat16), torch.randn(args.batch, tokens, 64, generator=generator).to(device)
    positions = position_ids(args.text_len, grid, grid, device=device)
    objective = ObjectiveConfig()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        noise = torch.randn_like(x0)
        t = sample_timesteps(args.batch, tokens, objective, generator).to(device)
        with autocast:
            pred = model(hidden_states=add_noise(x0, noise, t), encoder_hidden_states=text, timestep=t,
                         position_ids=positions, return_dict=False)[0]
        flow_matching_loss(pred, x0, noise, t).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = sum(times) / len(times)
    flops = model_flops_per_step(model, args.batch, tokens, args.text_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    layers = config["num_layers"]
    row = {"optimizer": optimizer_name, "num_layers": layers, "parameters": sum(p.numel() for p in model.parameters()),
           "s_per_step": seconds, "samples_per_s": args.batch / seconds,
           "samples_per_s_28_layers_est": args.batch / seconds * layers / 28,
           "tflops_per_s": flops / seconds / 1e12, "mfu": flops / seconds / peak if peak else None,
           "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
           "muon_matrices": len(split.muon)}
    del model, optimizers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--num-layers", type=int, default=12, help="blocks of the full-width model (28 = all)")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--activation-checkpointing", default="selective", choices=["none", "selective", "full"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny config on CPU (smoke test of this script)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.text_len, args.resolution, args.steps, args.warmup = 2, 8, 64, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    rows = [run(name, args, device) for name in args.optimizers.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
