"""How many CPU threads torch uses, chosen from the model's size before it loads.

torch starts one intra-op thread per core. A tiny model's matmuls (``tiny-random``: a 64-wide
transformer) take microseconds, so extra threads only synchronise, and on a busy machine they spin
against each other and the other processes: the tiny LoRA example ran 388 s with torch's default
on a loaded 2-core machine and 19 s single-threaded. An MLP step (300 tokens, forward + backward) on
this 2-core machine under a load of 5 was 23x slower with 2 threads than with 1 at width 64, 4x at
128 and 256, 2.3x at 384: on a busy machine threads lose at every width, while on a quiet one a wide
model's matmuls (milliseconds each) use the cores. So a transformer narrower than
:data:`SINGLE_THREAD_WIDTH` (tiny-random, the tiny pretraining architecture, test models) runs
single-threaded; wider or unknown models keep torch's default. The user's choice always wins: with
``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` set, or a count set with ``torch.set_num_threads`` (any
count other than torch's when this module was first imported), nothing changes.

Every entry point that loads a model calls :func:`choose_cpu_threads` once, before loading
(``krea2 generate / expand / train / posttrain / pretrain`` and the demo app). The library itself
never changes the thread count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

# Transformer width (heads x head dim) below which one thread is faster (see the module docstring).
SINGLE_THREAD_WIDTH = 256
USER_ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# torch's own count in this process, before any entry point changed it.
STARTING_THREADS = torch.get_num_threads()


def transformer_width(model) -> int | None:
    """The transformer's width D of ``model`` as the CLIs name it, read without loading weights:
    ``tiny-random``, ``krea2-digits``, a diffusers folder (``transformer/config.json``) or a ``.safetensors`` transformer
    file (its header's input-projection shape). None when unknown (a hub id, GGUF, unreadable)."""
    from .models.digits import FOLDER, is_digits
    from .models.tiny import is_tiny, tiny_transformer_config

    if is_tiny(model):
        config = tiny_transformer_config()
        return config["num_attention_heads"] * config["attention_head_dim"]
    path = FOLDER if is_digits(model) else Path(str(model))
    try:
        if path.is_dir():
            for config_path in (path / "transformer" / "config.json", path / "config.json"):
                if config_path.is_file():
                    config = json.loads(config_path.read_text())
                    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])
            return None
        if path.is_file() and path.suffix == ".safetensors":
            from .files import read_safetensors_header

            entries, _, _ = read_safetensors_header(path)
            for name, entry in entries.items():
                if name.endswith(("first.weight", "img_in.weight")):  # original / diffusers layout: (D, in_channels)
                    return int(entry["shape"][0])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the loader reports a broken model properly; the thread count stays torch's
    return None


def choose_cpu_threads(*models, width: int | None = None, announce=None) -> int | None:
    """Run single-threaded when every model about to load is narrower than :data:`SINGLE_THREAD_WIDTH`.

    Args:
        models: the models as the CLIs name them (see :func:`transformer_width`); all must be narrow.
        width: the transformer's width when it is known directly (pretraining's architecture).
        announce: where the one-line notice goes (default: a line on stderr).
    Returns:
        the new thread count, or None when the count was left alone (user's choice, wide or unknown model).
    """
    widths = [transformer_width(m) for m in models] + ([] if width is None else [width])
    if not widths or any(w is None or w >= SINGLE_THREAD_WIDTH for w in widths):
        return None
    if any(os.environ.get(name) for name in USER_ENVIRONMENT) or torch.get_num_threads() != STARTING_THREADS:
        return None
    if torch.get_num_threads() == 1:
        return None
    torch.set_num_threads(1)
    message = (f"threads: 1 instead of torch's {STARTING_THREADS} (a {max(widths)}-wide transformer runs faster "
               "single-threaded; set OMP_NUM_THREADS to choose)")
    (announce or (lambda text: print(text, file=sys.stderr)))(message)
    return 1
