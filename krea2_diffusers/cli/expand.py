"""``krea2 expand PROMPT``: print the prompt the expander would encode at a creativity level."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..conditioning.expander import (
    CREATIVITY_LEVELS, DEFAULT_CREATIVITY, DEFAULT_EXPANSION_SEED, DEFAULT_MAX_NEW_TOKENS, expand_prompts, load_expander,
)
from ..models.tiny import TINY_LABEL, is_tiny

# What single-file transformer checkpoints are paired with (see Krea2Pipeline.from_single_file).
DEFAULT_TEXT_ENCODER = "Qwen/Qwen3-VL-4B-Instruct"
# tiny-random's random LM never samples an end token, so it always wrote the full default of 512
# tokens of noise (106 s on a busy 2-core machine with torch's 2 threads, 16 s of CPU single-threaded);
# 32 tokens prove the plumbing as well.
TINY_MAX_NEW_TOKENS = 32
# A progress line on stderr every this many sampled tokens.
PROGRESS_EVERY = 64


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
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"cap on the expansion's length (default {DEFAULT_MAX_NEW_TOKENS}; "
                        f"{TINY_MAX_NEW_TOKENS} for tiny-random, whose random text never ends)")
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


class TokenProgress:
    """A transformers streamer that prints ``expand: N/MAX tokens (S s)`` to stderr every ``every``
    sampled tokens of a prompt, so a long expansion on a CPU is visibly alive. The first ``put`` of
    each generation is the prompt's ids (not counted); ``end`` closes a prompt's generation."""

    def __init__(self, max_new_tokens: int, every: int = PROGRESS_EVERY, stream=None):
        self.max_new_tokens, self.every, self.stream = max_new_tokens, every, stream or sys.stderr
        self.tokens, self.prompt_seen, self.start = 0, False, time.perf_counter()

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += 1
        if self.tokens % self.every == 0:
            print(f"expand: {self.tokens}/{self.max_new_tokens} tokens ({time.perf_counter() - self.start:.0f} s)",
                  file=self.stream, flush=True)

    def end(self) -> None:
        self.tokens, self.prompt_seen, self.start = 0, False, time.perf_counter()


def max_new_tokens_for(args) -> int:
    """``--max-new-tokens``, else the default for the LM that expands (tiny-random's is short)."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    tiny = is_tiny(args.expander) if args.expander is not None else is_tiny(args.model)
    return TINY_MAX_NEW_TOKENS if tiny else DEFAULT_MAX_NEW_TOKENS


def run(args) -> int:
    import torch

    from ..cpu_threads import choose_cpu_threads
    from ..heap import hold_freed_chunks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.creativity == "raw":
        print(args.prompt)  # raw is the identity: no model is loaded
        return 0
    # The LM that runs: --expander, tiny-random's own, else a Qwen3-VL text encoder (wide: threads stay torch's).
    hold_freed_chunks()
    choose_cpu_threads(args.expander or (args.model if is_tiny(args.model) else args.text_encoder or DEFAULT_TEXT_ENCODER))
    lm, tokenizer, label = resolve_expander(args.model, args.expander, args.text_encoder, device)
    if label == TINY_LABEL:
        print(f"model: {label}")
    max_new_tokens = max_new_tokens_for(args)
    (expanded,) = expand_prompts(lm, tokenizer, [args.prompt], creativity=args.creativity, seed=args.seed,
                                 max_new_tokens=max_new_tokens, streamer=TokenProgress(max_new_tokens))
    print(expanded)
    return 0
