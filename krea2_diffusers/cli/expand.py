"""``krea2 expand PROMPT``: print the prompt the expander would encode at a creativity level."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..conditioning.expander import (
    CREATIVITY_LEVELS, DEFAULT_CREATIVITY, DEFAULT_EXPANSION_SEED, DEFAULT_MAX_NEW_TOKENS, expand_prompts, load_expander,
)
from ..models.tiny import TINY_LABEL, is_tiny

# What single-file transformer checkpoints are paired with (see Krea2Pipeline.from_single_file).
DEFAULT_TEXT_ENCODER = "Qwen/Qwen3-VL-4B-Instruct"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("expand", help="expand a short prompt the way `generate --creativity` does")
    p.add_argument("prompt")
    p.add_argument("--model", default="tiny-random",
                   help="whose text encoder expands: tiny-random, a diffusers folder/hub id, or a .safetensors/.gguf "
                        "transformer file (then --text-encoder is used)")
    p.add_argument("--text-encoder", default=None,
                   help=f"Qwen3-VL hub id or folder for single-file models (default {DEFAULT_TEXT_ENCODER})")
    p.add_argument("--expander", default=None, help="any causal LM (hub id or folder) to use instead of the text encoder")
    p.add_argument("--creativity", choices=CREATIVITY_LEVELS, default=DEFAULT_CREATIVITY,
                   help="raw = as written; low / medium / high expand increasingly freely")
    p.add_argument("--seed", type=int, default=DEFAULT_EXPANSION_SEED, help="same seed, same expansion (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return p


def resolve_expander(model: str, expander: str | None, text_encoder: str | None, device: str | None):
    """``(model, tokenizer, label)`` for the CLI's choice of LM; loads only the text encoder of a Krea 2 model."""
    if expander is not None:
        lm, tokenizer = load_expander(expander, device=device)
        return lm, tokenizer, TINY_LABEL if is_tiny(expander) else expander
    if is_tiny(model):
        lm, tokenizer = load_expander(model, device=device)
        return lm, tokenizer, TINY_LABEL
    path = Path(model)
    if path.is_file() or path.name.endswith(".index.json"):
        source = text_encoder or DEFAULT_TEXT_ENCODER
        lm, tokenizer = load_expander(source, device=device)
        return lm, tokenizer, source
    from transformers import Qwen3VLForConditionalGeneration

    from ..loaders.assembly import load_tokenizer

    if path.is_dir() and not (path / "text_encoder").is_dir():
        raise FileNotFoundError(f"{path}: no text_encoder/ folder (expected a diffusers-format Krea 2 folder)")
    lm = Qwen3VLForConditionalGeneration.from_pretrained(model, subfolder="text_encoder", dtype="auto").eval()
    tokenizer = load_tokenizer(str(path / "tokenizer") if (path / "tokenizer").is_dir() else None, None)
    return (lm.to(device) if device else lm), tokenizer, model


def run(args) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.creativity == "raw":
        print(args.prompt)  # raw is the identity: no model is loaded
        return 0
    lm, tokenizer, label = resolve_expander(args.model, args.expander, args.text_encoder, device)
    if label == TINY_LABEL:
        print(f"model: {label}")
    (expanded,) = expand_prompts(lm, tokenizer, [args.prompt], creativity=args.creativity, seed=args.seed,
                                 max_new_tokens=args.max_new_tokens)
    print(expanded)
    return 0
