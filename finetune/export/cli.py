"""``krea2 export CHECKPOINT_DIR OUT [--format ...] [--dtype bfloat16]``: the files a run exports,
written from one of its DCP checkpoints (``<output_dir>/checkpoints/step-<N>``), streaming tensor
by tensor, on any machine and without the processes that wrote it."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="write LoRA files or full weights from a training checkpoint",
        description="Write LoRA files (diffusers/comfyui/kohya) or full weights (diffusers folder, original "
                    "single file) from a DCP training checkpoint, streaming.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. outputs/run/checkpoints/step-1500")
    parser.add_argument("out", help="output folder (created; existing files of the same name are refused)")
    parser.add_argument("--format", action="append", dest="formats",
                        choices=["diffusers", "comfyui", "kohya", "original"],
                        help="repeatable; default: every format of the checkpoint's kind")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="full weights: cast to this dtype")
    parser.add_argument("--trigger-word", action="append", default=[], dest="trigger_words", help="LoRA metadata")
    parser.add_argument("--weights", choices=["raw", "ema"],
                        help="the trained weights or their EMA (training.ema); default: what the run exports")
    return parser


def run(args: argparse.Namespace) -> int:
    import torch

    from ..engine.checkpoint import STATE_FILE
    from .writer import export_checkpoint

    checkpoint, out = Path(args.checkpoint), Path(args.out)
    if not (checkpoint / STATE_FILE).is_file() or not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint}: not a training checkpoint (needs {STATE_FILE} and DCP's .metadata)")
    out.mkdir(parents=True, exist_ok=True)
    taken = [p for p in out.iterdir() if p.name.startswith(("lora_", "transformer", "krea2_original"))]
    if taken:
        raise ValueError(f"{out} already holds exported files ({taken[0].name}); choose another folder")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    for path in export_checkpoint(checkpoint, out, args.formats, args.trigger_words, dtype, args.weights):
        print(path)
    return 0
