"""Step caches and compiled blocks on the full-size Krea 2 transformer (12.8B, random bf16 weights) on one GPU, in one call.

    python bench/device/bench_cache_full.py [--json OUT]            # 1024x1024, 28 steps, CFG 3.5, on CUDA
    python bench/device/bench_cache_full.py --tiny --size 64        # CPU dry run of the same code on a tiny config

What bench/bench_cache.py's side by side measures on the CPU, at full size (bench/cache_side_by_side.py):
ours uncached and with each preset (fbcache, taylorseer, magcache: diffusers' hooks; dbcache:
cache-dit) against ``diffusers.Krea2Pipeline`` uncached and with cache-dit's DBCache at the same
preset, on the same weights and noise: wall seconds (best of --repeats, round-robin in this
process), full transformer forwards per image, the ratio to diffusers + cache-dit and the relative
difference of the final latents; the peer check (ours with separate CFG calls vs diffusers +
cache-dit, identical tokens); compiled blocks vs eager (ratio, max difference, recompiles).

Random weights need no download and do the real work (values do not change it); their outputs are
noise, so quality is the CPU bench's business (the proving ground's digits model). The text enters
as random prompt embeddings (--text-len tokens, 12 tapped layers of width 2560, the negative
masked to 8 real tokens) and the latents stay packed (output_type="latent"): the transformer is the
whole cost. Both transformers (ours and diffusers') are on the GPU at once: about 52 GB.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))  # run from a checkout without installing
sys.path.insert(0, str(BENCH))  # bench/cache_side_by_side.py

WEIGHT_STD = 0.02
NEGATIVE_TOKENS = 8


def random_transformers(config: dict, device, dtype):
    """Ours and diffusers' transformer on ``device`` with the same random weights (norm scales float32)."""
    import diffusers
    import torch
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

    from krea2_diffusers.models.layers import RMSNorm
    from krea2_diffusers.models.transformer import Krea2Transformer2DModel

    out = []
    for cls, norm in ((Krea2Transformer2DModel, RMSNorm), (diffusers.Krea2Transformer2DModel, Krea2RMSNorm)):
        with torch.device("meta"):
            model = cls(**config)
        model = model.to_empty(device=device).eval()
        for module in model.modules():
            for param in module.parameters(recurse=False):
                param.data = param.data.to(torch.float32 if isinstance(module, norm) else dtype)
        out.append(model)
    ours, theirs = out
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, WEIGHT_STD, generator=generator)
        theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def pipelines(config: dict, device, dtype):
    """Our Krea2Pipeline and diffusers' around the two transformers (tiny text encoder and VAE: never run)."""
    import diffusers

    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.models.tiny import tiny_components

    parts = tiny_components(seed=0)
    ours_transformer, theirs_transformer = random_transformers(config, device, dtype)
    ours = Krea2Pipeline(**dict(parts, transformer=ours_transformer))
    theirs = diffusers.Krea2Pipeline(scheduler=parts["scheduler"], vae=copy.deepcopy(parts["vae"]),
                                     text_encoder=parts["text_encoder"].model, tokenizer=parts["tokenizer"], transformer=theirs_transformer)
    for pipe in (ours, theirs):
        pipe.set_progress_bar_config(disable=True)
    return ours, theirs


def call_for(config: dict, args, device, dtype, text_len: int | None = None) -> dict:
    """One generation's arguments: random prompt embeddings (the negative masked to NEGATIVE_TOKENS real tokens), fixed noise."""
    import torch

    generator = torch.Generator(device).manual_seed(1)
    length = text_len or args.text_len
    shape = (1, length, config.get("num_text_layers", 12), config.get("text_hidden_dim", 2560))
    embeds = torch.randn(shape, generator=generator, device=device).to(dtype)
    negative = torch.randn(shape, generator=generator, device=device).to(dtype)
    mask = torch.ones(1, length, dtype=torch.bool, device=device)
    negative_mask = torch.arange(length, device=device)[None] < NEGATIVE_TOKENS
    tokens = (args.size // 16) ** 2
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative, negative_prompt_embeds_mask=negative_mask,
                height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="latent",
                latents=torch.randn(1, tokens, config.get("in_channels", 64), generator=generator, device=device))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (a dry run of this script)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds after one warm-up round (best of)")
    parser.add_argument("--no-compile", action="store_true", help="skip compiled blocks vs eager")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from cache_side_by_side import compare, compile_check, forward_parity, peer_check

    from krea2_diffusers.models.tiny import tiny_transformer_config

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = tiny_transformer_config() if args.tiny else {}  # the class defaults are the released model
    ours, theirs = pipelines(config, device, dtype)
    call = call_for(config, args, device, dtype)

    def emit(result: dict) -> None:
        # Written after each part: a run stopped at its time cap keeps the parts it finished.
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))

    with torch.inference_mode():
        result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "size": args.size,
                  "steps": args.steps, "guidance": args.guidance, "text_len": args.text_len,
                  **compare(ours, theirs, call, args.repeats)}
        emit(result)
        result["peer_check"] = peer_check(ours, theirs, call)
        emit(result)
        if not args.no_compile:
            variants = {"cfg": call, "no_cfg": dict(call, guidance_scale=0.0),
                        "cfg_long_prompt": call_for(config, args, device, dtype, text_len=2 * args.text_len)}
            result["compile"] = compile_check(ours, variants, args.repeats)
            emit(result)
        # Last: it leaves ours in float32 (at full size 51 GB beside diffusers' 26 GB bf16).
        result["forward_parity"] = forward_parity(ours.transformer, theirs.transformer, call)
        emit(result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
