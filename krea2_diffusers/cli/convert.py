"""``krea2 convert IN OUT``: original single file <-> diffusers-format transformer folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="convert a transformer between the original and diffusers layouts")
    p.add_argument("input", help="original .safetensors (or index) file, or a diffusers transformer folder")
    p.add_argument("output", help="a new folder (to diffusers) or a new .safetensors file (to original)")
    p.add_argument("--to", choices=("auto", "diffusers", "original"), default="auto",
                   help="auto: a file becomes a diffusers folder, a folder becomes an original file")
    p.add_argument("--dtype", choices=("keep", "bfloat16", "float16", "float32"), default="keep")
    return p


def run(args) -> int:
    import torch

    from ..loaders.convert import convert_diffusers_to_original
    from ..files import atomic_write_dir, save_safetensors
    from ..models.transformer import Krea2Transformer2DModel

    src, dst = Path(args.input), Path(args.output)
    if dst.exists():
        raise ValueError(f"{dst} already exists; choose a new output path")
    is_diffusers_folder = src.is_dir() and (src / "config.json").exists()
    target = args.to if args.to != "auto" else ("original" if is_diffusers_folder else "diffusers")
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    if is_diffusers_folder:
        model = Krea2Transformer2DModel.from_pretrained(src, torch_dtype=dtype)
    else:
        model = Krea2Transformer2DModel.from_single_file(src, torch_dtype=dtype)
    if target == "diffusers":
        with atomic_write_dir(dst) as tmp:
            model.save_pretrained(tmp)
    else:
        if dst.suffix != ".safetensors":
            raise ValueError(f"original-layout output must be a .safetensors file, got {dst}")
        original = convert_diffusers_to_original(model.state_dict())
        save_safetensors(original, dst, metadata={"format": "pt", "krea2.layout": "original"})
    print(f"wrote {dst} ({target} layout)")
    return 0
