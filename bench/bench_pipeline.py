"""Our Krea2Pipeline vs diffusers.Krea2Pipeline on the same tiny-but-proportioned components.

512x512, 8 steps, CFG on, a short prompt; identical weights and noise. Prints both wall times,
the ratio (target: ours <= 0.4x theirs), the largest pixel difference, and the roofline of our
transformer (bench/roofline.py): this machine's fp32 and bf16 matmul peaks, measured in the same
run with the same threads, and the GFLOPS our transformer's denoising forwards achieved (counted
FLOPs / their time, in the fastest repeat) as a fraction of the peak of the dtype they ran in.

    python bench/bench_pipeline.py [--size 512] [--steps 8] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import TransformerMeter, describe, machine_peaks, roofline  # noqa: E402

# Proportions of the released model at 1/16 width: 4:1 GQA, SwiGLU ~2.67x, 36-layer encoder tapped at 12.
TRANSFORMER = dict(
    in_channels=64, num_layers=8, attention_head_dim=32, num_attention_heads=12, num_key_value_heads=3,
    intermediate_size=1024, timestep_embed_dim=256, text_hidden_dim=160, num_text_layers=12,
    text_num_attention_heads=5, text_num_key_value_heads=5, text_intermediate_size=432,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(8, 12, 12),
)


def build(seed: int = 0, components: str = "proportioned"):
    import diffusers

    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.models.tiny import tiny_components

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    parts = tiny_components(seed)
    if components == "proportioned":
        _proportion(parts, generator)
    # diffusers gets its own, untouched copy of the VAE (ours switches it to 2-D convolutions).
    theirs_vae = copy.deepcopy(parts["vae"])
    ours = Krea2Pipeline(**parts)
    config = dict(parts["transformer"].config)
    theirs_transformer = diffusers.Krea2Transformer2DModel(**config)
    theirs_transformer.load_state_dict(parts["transformer"].state_dict())
    theirs = diffusers.Krea2Pipeline(
        scheduler=parts["scheduler"], vae=theirs_vae, text_encoder=parts["text_encoder"].model,
        tokenizer=parts["tokenizer"], transformer=theirs_transformer.eval(),
    )
    for pipe in (ours, theirs):
        pipe.set_progress_bar_config(disable=True)
    return ours, theirs


def _proportion(parts: dict, generator) -> None:
    """Swap in the proportioned text encoder and transformer."""
    from transformers import Qwen3VLForConditionalGeneration

    from krea2_diffusers import Krea2Transformer2DModel
    from krea2_diffusers.models.tiny import randomize_, tiny_text_encoder_config

    te_config = tiny_text_encoder_config()
    te_config.text_config.hidden_size = TRANSFORMER["text_hidden_dim"]
    te_config.text_config.intermediate_size = 432
    te_config.text_config.num_attention_heads = 8
    te_config.text_config.num_key_value_heads = 4
    te_config.text_config.head_dim = 20
    te_config.text_config.rope_parameters["mrope_section"] = [4, 3, 3]
    te_config.vision_config.out_hidden_size = TRANSFORMER["text_hidden_dim"]
    parts["text_encoder"] = Qwen3VLForConditionalGeneration(te_config).eval()
    parts["transformer"] = Krea2Transformer2DModel(**TRANSFORMER).eval()
    for module in (parts["text_encoder"], parts["transformer"]):
        randomize_(module, generator)


def timed(pipe, repeats: int, meter: TransformerMeter | None = None, **kwargs):
    """Best wall time of ``repeats`` calls and the images; ``meter`` keeps the fastest call's counts."""
    best, images, counts = float("inf"), None, None
    for _ in range(repeats):
        if meter is not None:
            meter.reset()
        start = time.perf_counter()
        images = pipe(**kwargs).images
        elapsed = time.perf_counter() - start
        if elapsed < best and meter is not None:
            counts = (meter.flops, meter.seconds)
        best = min(best, elapsed)
    return best, images, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--components", choices=("proportioned", "tiny"), default="proportioned",
                        help="proportioned: 1/16-width model shaped like the release; tiny: the tiny-random test model")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    peaks = machine_peaks()
    ours, theirs = build(components=args.components)
    tokens = (args.size // 16) ** 2
    latents = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(0))
    kwargs = dict(prompt="a red fox in the snow", height=args.size, width=args.size, num_inference_steps=args.steps,
                  guidance_scale=args.guidance, output_type="np")
    with torch.inference_mode():
        t_theirs, img_theirs, _ = timed(theirs, args.repeats, latents=latents.clone(), **kwargs)
        with TransformerMeter(ours.transformer) as meter:
            t_ours, img_ours, (flops, seconds) = timed(ours, args.repeats, meter, latents=latents.clone(), **kwargs)
    # the best of the peaks before and after the runs: a shared machine's load changes meanwhile
    peaks = {k: max(v, peaks[k]) for k, v in machine_peaks().items()}
    dtype = ours.transformer.compute_dtype
    result = dict(seconds_diffusers=t_theirs, seconds_ours=t_ours, ratio=t_ours / t_theirs,
                  max_pixel_diff=float(np.abs(img_ours - img_theirs).max()), transformer_seconds=seconds,
                  transformer_gflop=flops / 1e9, dtype=str(dtype).removeprefix("torch."),
                  threads=torch.get_num_threads(), **roofline(flops, seconds, dtype, peaks))
    print(f"{args.components} components, {args.size}x{args.size}, {args.steps} steps, CFG {args.guidance}, torch threads {torch.get_num_threads()}")
    print(f"diffusers.Krea2Pipeline : {t_theirs:7.2f} s")
    print(f"krea2_diffusers         : {t_ours:7.2f} s")
    print(f"ratio ours/theirs       : {t_ours / t_theirs:7.3f}  (target <= 0.4)")
    print(f"max |pixel diff|        : {result['max_pixel_diff']:.2e}")
    print(f"roofline                : {describe(result, dtype)}; {flops / 1e9:.2f} GFLOP in {seconds:.2f} s of denoising forwards")
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
