"""``krea2 generate PROMPT``: images to PNG files that record their settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..presets import CACHE_METHODS, MEMORY_PRESETS, REFERENCE_ATTENTION, REFERENCE_METHODS

# Text-to-image size of the released models (the pipeline's default comes from the model's preset:
# krea2-digits draws 64 px); --dry-run plans with it.
DEFAULT_SIZE = 1024


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate images from a prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default="tiny-random", help="tiny-random (random weights), krea2-digits (a small trained model of 64 px digits), "
                        "a diffusers folder/hub id, or a .safetensors/.gguf transformer file")
    p.add_argument("--text-encoder", default=None, help="Qwen3-VL-4B-Instruct: hub id, folder or single file (e.g. ComfyUI's qwen3vl_4b_bf16.safetensors)")
    p.add_argument("--vae", default=None, help="Qwen-Image VAE: hub id, folder or single file (Wan 2.1 or diffusers layout, e.g. qwen_image_vae.safetensors)")
    p.add_argument("--turbo", dest="is_distilled", action="store_const", const=True, default=None, help="treat the model as Turbo")
    p.add_argument("--raw", dest="is_distilled", action="store_const", const=False, help="treat the model as RAW")
    p.add_argument("--negative", default=None, help="negative prompt (default empty when guidance is on)")
    p.add_argument("--steps", type=int, default=None, help="default: 52 RAW, 8 Turbo, 16 krea2-digits")
    p.add_argument("--guidance", type=float, default=None,
                   help="CFG in Krea's convention (0 = off; ComfyUI's cfg = this + 1). Default: 3.5 RAW, 0 Turbo, 3 krea2-digits")
    p.add_argument("--seed", type=int, default=0, help="image i of the batch uses seed + i")
    p.add_argument("--width", type=int, default=None, help=f"default {DEFAULT_SIZE} (krea2-digits 64), or the --init-image's width")
    p.add_argument("--height", type=int, default=None, help=f"default {DEFAULT_SIZE} (krea2-digits 64), or the --init-image's height")
    p.add_argument("--init-image", default=None, metavar="PATH", help="image-to-image: start from this image")
    p.add_argument("--strength", type=float, default=0.6,
                   help="with --init-image: 0 keeps the image, 1 ignores it (default 0.6)")
    p.add_argument("--mask", default=None, metavar="PATH",
                   help="with --init-image: inpaint where the mask is white, keep where it is black")
    p.add_argument("--num-images", type=int, default=1)
    p.add_argument("--output", default="outputs/krea2.png", help="PNG path; batches get -0, -1, ... suffixes")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on CUDA GPUs and CPUs with bf16 units (Ampere or later; AVX512-BF16 / AMX), "
                        "float16 on older GPUs, else float32; "
                        "KREA2_CPU_BF16=0|1 overrides the CPU detection")
    p.add_argument("--memory", default=None, choices=MEMORY_PRESETS,
                   help="fit a memory budget (prints what it chose); a quantized storage it picks is applied while loading")
    p.add_argument("--quantize", default=None, choices=("fp8", "int8", "nf4"),
                   help="store the transformer's block matrices quantized, read and quantized block by block "
                        "(the full-precision model never exists whole); not for GGUF files")
    p.add_argument("--dry-run", action="store_true",
                   help="print the host-memory plan (and whether it fits this machine) without loading anything")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="a LoRA file (diffusers, ComfyUI or kohya format); repeatable")
    p.add_argument("--creativity", choices=("raw", "low", "medium", "high"), default=None,
                   help="expand the prompt with the text encoder's LM before generating")
    p.add_argument("--style-ref", action="append", default=[], metavar="IMAGE[:STRENGTH]",
                   help="style reference image with its strength (default 1); repeatable, up to 10")
    p.add_argument("--style-mode", choices=("reference", "describe"), default="reference",
                   help="reference: vision tokens + reference latents (use a style-reference LoRA); describe: training-free")
    p.add_argument("--reference-attention", choices=REFERENCE_ATTENTION, default="joint",
                   help="joint: as the style-reference LoRA was trained; cached: references attend among themselves, "
                        "computed once per image (cheaper per step)")
    p.add_argument("--reference", action="append", default=[], metavar="PATH",
                   help="reference image for an edit / identity / insertion LoRA (vision tokens + reference latents, "
                        "own aspect, at most 1024^2 px); repeatable, up to 3")
    p.add_argument("--reference-method", choices=REFERENCE_METHODS, default="index_timestep_zero",
                   help="index_timestep_zero: reference tokens modulated as timestep 0 (ComfyUI's native Krea 2); "
                        "index: with each step's timestep")
    p.add_argument("--no-reference-vision-tokens", dest="reference_vision_tokens", action="store_false",
                   help="--reference images enter as latents only, not as vision tokens in the prompt")
    p.add_argument("--no-reference-latents", dest="reference_latents", action="store_false",
                   help="--reference images enter as vision tokens only, not as latents")
    p.add_argument("--cache", choices=CACHE_METHODS, default="none",
                   help="step cache (skips transformer work between steps; krea2_diffusers.caching.presets): fbcache, "
                        "taylorseer, magcache (diffusers' hooks) or dbcache (cache-dit's, pip install cache-dit)")
    p.add_argument("--cache-threshold", type=float, default=None, metavar="X",
                   help="the cache's knob instead of its RAW/Turbo preset: higher skips more, 0 never skips "
                        "(taylorseer: steps per full forward, a whole number)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer's repeated blocks (regional, dynamic shapes: the first call of "
                        "a layout compiles, later steps and prompts reuse it)")
    p.add_argument("--guidance-interval", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="CFG only while the noise level t (1 = noise, 0 = clean) is in [LO, HI]; the unconditional "
                        "pass is skipped elsewhere")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p


def check_speed_options(args) -> None:
    """``--cache``, ``--cache-threshold`` and ``--guidance-interval``, refused before anything loads."""
    import importlib.util

    from ..sampling import check_guidance_interval

    check_guidance_interval(args.guidance_interval)
    if args.cache_threshold is not None:
        if args.cache == "none":
            raise ValueError("--cache-threshold needs --cache (fbcache, taylorseer, magcache or dbcache)")
        if not args.cache_threshold >= 0:
            raise ValueError(f"--cache-threshold must be >= 0, got {args.cache_threshold}")
    if args.cache == "dbcache" and importlib.util.find_spec("cache_dit") is None:
        raise ValueError("--cache dbcache needs cache-dit: pip install 'krea2-diffusers[cache]'")


def output_paths(output: str, count: int) -> list[Path]:
    path = Path(output)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--output must end in .png, got {output!r}")
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]


def resolve_dtype(name: str, device: str):
    """``--dtype``: ``auto`` is the project's compute-dtype policy for ``device`` (bf16 on CUDA GPUs and
    CPUs with bf16 units, float16 on older GPUs, else float32; :mod:`krea2_diffusers.precision`), a
    name is obeyed.
    Returns the :class:`~krea2_diffusers.precision.ComputeDtype` (dtype and reason)."""
    import torch

    from ..precision import ComputeDtype, choose_compute_dtype

    if name == "auto":
        return choose_compute_dtype(device)
    return ComputeDtype(getattr(torch, name), f"--dtype {name}")


def check_quantize_target(model: str, quantize: str | None) -> str | None:
    """``--quantize`` needs a transformer file or folder in full precision, not a GGUF file."""
    if quantize is not None and str(model).endswith(".gguf"):
        from ..files import CheckpointError

        raise CheckpointError(f"{model}: a GGUF file is already quantized (it stays packed); drop --quantize")
    return quantize


def print_host_plan(args, quantization, dtype, size) -> int:
    """``--dry-run``: the host plan of this run, DOES NOT FIT (and what would) when it exceeds the RAM."""
    from ..pipelines.host_memory import host_ram, plan_host_memory, storages_that_fit

    tokens = (size.get("width", DEFAULT_SIZE) // 16) * (size.get("height", DEFAULT_SIZE) // 16) + len(args.prompt.split()) * 2
    sources = dict(text_encoder=args.text_encoder, vae=args.vae, tokens=tokens)
    plan = plan_host_memory(args.model, quantization, dtype, **sources)
    available = host_ram()
    fitting = [] if plan.total <= available or str(args.model).endswith(".gguf") else \
        storages_that_fit(args.model, dtype, available, **sources)
    print(plan.render(available, fitting))
    return 0


def check_arguments(args) -> tuple[list[Path], list, list]:
    """Everything that can be refused without loading a model, checked before torch is imported
    (a refusal then takes a second, not the imports' ten): returns (output paths, style refs, LoRAs)."""
    if args.num_images < 1:
        raise ValueError(f"--num-images must be >= 1, got {args.num_images}")
    if args.mask and not args.init_image:
        raise ValueError("--mask needs --init-image (the image to inpaint)")
    for path in filter(None, (args.init_image, args.mask)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file")
    paths = output_paths(args.output, args.num_images)
    existing = [str(p) for p in paths if p.exists()]
    if existing and not args.overwrite:
        raise ValueError(f"refusing to overwrite {existing}; pass --overwrite or choose another --output")
    from ..conditioning.references import parse_style_ref  # imports torch: after the refusals above

    style = [parse_style_ref(spec) for spec in args.style_ref]
    loras = [parse_style_ref(spec) for spec in args.lora]  # same PATH[:NUMBER] syntax
    for path, _ in style + loras:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file")
    check_speed_options(args)
    return paths, style, loras


def check_references(args, style):
    """``--reference`` images read and checked (count, each an image) before any model loads; None without."""
    from ..conditioning.reference_images import MAX_REFERENCE_IMAGES, check_reference_images
    from ..presets import check_reference_options

    check_reference_options(args.reference_attention, args.reference_method)
    if not args.reference:
        return None
    if len(args.reference) > MAX_REFERENCE_IMAGES:
        raise ValueError(f"at most {MAX_REFERENCE_IMAGES} --reference images are supported, got {len(args.reference)}: "
                         f"{', '.join(args.reference)}")
    if style:
        raise ValueError("--reference and --style-ref cannot be combined: pass one kind of reference")
    for path in args.reference:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file (--reference)")
    return check_reference_images(args.reference, vision_tokens=args.reference_vision_tokens, latents=args.reference_latents)


def run(args) -> int:
    paths, style, loras = check_arguments(args)
    references = check_references(args, style)
    import torch

    from .. import Krea2Img2ImgPipeline, Krea2InpaintPipeline, Krea2Pipeline
    from ..loaders.assembly import load_pipeline
    from ..metadata import save_png
    from ..models.tiny import is_tiny
    from ..sampling import check_strength

    image_args = {}
    if args.init_image:
        image_args = dict(image=args.init_image, strength=check_strength(args.strength))
        if args.mask:
            image_args["mask_image"] = args.mask
    # Unset sides are the pipeline's: the --init-image's size, else the model's preset's.
    size = {k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = resolve_dtype(args.dtype, device)
    print(chosen.describe())
    dtype = chosen.dtype
    quantization = check_quantize_target(args.model, args.quantize)
    if args.memory and quantization is None:
        from ..pipelines.memory import storage_for_file

        quantization = storage_for_file(args.model, args.memory, device, args.text_encoder, args.vae)
    if args.dry_run:
        return print_host_plan(args, quantization, dtype, size)
    from ..cpu_threads import choose_cpu_threads
    from ..heap import hold_freed_chunks

    hold_freed_chunks()
    choose_cpu_threads(args.model)
    pipe = load_pipeline(Krea2Pipeline, args.model, text_encoder=args.text_encoder, vae=args.vae,
                         torch_dtype=dtype, is_distilled=args.is_distilled,
                         device=None if args.memory else device, quantization=quantization)
    if pipe.label and not is_tiny(args.model):  # tiny-random's loader already warned, once
        print(f"model: {pipe.label}")
    for path, strength in loras:
        pipe.load_lora_weights(path, strength=strength)
    if args.memory:
        print(f"memory: {pipe.enable_memory_preset(args.memory, device=device)}")
    if args.init_image:
        pipe = (Krea2InpaintPipeline if args.mask else Krea2Img2ImgPipeline).from_pipe(pipe)
    generators = [torch.Generator(device).manual_seed(args.seed + i) for i in range(args.num_images)]
    from ..caching.apply import compile_blocks, step_cache

    if args.compile:
        compile_blocks(pipe.transformer)
    with step_cache(pipe, args.cache, num_inference_steps=args.steps, threshold=args.cache_threshold):
        result = pipe(args.prompt, negative_prompt=args.negative, **size, **image_args, reference_attention=args.reference_attention,
                      num_inference_steps=args.steps, guidance_scale=args.guidance, guidance_interval=args.guidance_interval,
                      num_images_per_prompt=args.num_images, generator=generators, creativity=args.creativity,
                      expansion_seed=args.seed, style_images=[p for p, _ in style] or None,
                      style_strengths=[s for _, s in style] or None, style_mode=args.style_mode,
                      reference_images=None if references is None else references.images,
                      reference_vision_tokens=args.reference_vision_tokens, reference_latents=args.reference_latents,
                      reference_method=args.reference_method)
    if result.expanded_prompts is not None:
        print(f"expanded prompt: {result.expanded_prompts[0]}")
    preset = pipe.preset
    steps = args.steps if args.steps is not None else preset.num_inference_steps
    guidance = args.guidance if args.guidance is not None else preset.guidance_scale
    for i, (image, path) in enumerate(zip(result.images, paths)):
        settings = {
            "prompt": result.expanded_prompts[0] if result.expanded_prompts else args.prompt,
            "negative_prompt": args.negative or "", "seed": args.seed + i, "steps": steps,
            "guidance_scale": guidance, "guidance_convention": "krea (standard = value + 1)",
            "width": image.width, "height": image.height, "model": pipe.label or args.model,
        }
        if args.creativity:
            settings.update(original_prompt=args.prompt, creativity=args.creativity)
        if style:
            settings["style_references"] = [{"image": str(p), "strength": s} for p, s in style]
            settings.update(style_mode=args.style_mode, reference_attention=args.reference_attention)
        if references is not None:
            settings.update(references=[str(p) for p in args.reference], reference_method=args.reference_method,
                            reference_vision_tokens=args.reference_vision_tokens, reference_latents=args.reference_latents,
                            reference_attention=args.reference_attention)
        if args.init_image:
            settings.update(init_image=str(args.init_image), strength=args.strength)
            if args.mask:
                settings["mask"] = str(args.mask)
        if loras:
            from ..metadata import lora_entries

            settings["loras"] = lora_entries(loras)
        if args.cache != "none":
            settings.update(cache=args.cache, cache_threshold=args.cache_threshold)
        if args.guidance_interval is not None:
            settings["guidance_interval"] = list(args.guidance_interval)
        if args.compile:
            settings["compiled_blocks"] = True
        save_png(image, path, settings)
        print(f"wrote {path}")
    return 0
