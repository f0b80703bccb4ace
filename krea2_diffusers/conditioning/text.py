"""Text conditioning: Krea 2's chat template around the prompt, Qwen3-VL, 12 tapped layers.

Layout of one row: ``[prefix | prompt (<= max_sequence_length - suffix) | padding | suffix]``.
Padding consumes no position (position ids are ``cumsum(mask) - 1``) and is masked as a key,
so the real tokens' features do not depend on how much padding there is. We therefore pad
only to the batch's longest prompt instead of the reference's fixed 512.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

SYSTEM_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
ASSISTANT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Indices into the encoder's hidden_states tuple (0 = embeddings) that the transformer reads.
TAPPED_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class TemplateCounts:
    prefix: int
    suffix: int


@lru_cache(maxsize=8)
def template_counts(tokenizer) -> TemplateCounts:
    """Token counts of the template's prefix and suffix (34 and 5 with the Qwen tokenizer)."""
    prefix = len(tokenizer(SYSTEM_PREFIX, add_special_tokens=False).input_ids)
    suffix = len(tokenizer(ASSISTANT_SUFFIX, add_special_tokens=False).input_ids)
    return TemplateCounts(prefix, suffix)


def tokenize_prompts(tokenizer, prompts: list[str], max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH, pad_to_max: bool = False):
    """Tokenize prompts into the Krea 2 layout.

    Returns:
        input_ids (B, P + L) long, attention_mask (B, P + L) bool, and P (prefix tokens to drop);
        L = longest (prompt + suffix) in the batch, or ``max_sequence_length`` with ``pad_to_max``.
    """
    counts = template_counts(tokenizer)
    if max_sequence_length <= counts.suffix:
        raise ValueError(f"max_sequence_length must exceed the template suffix ({counts.suffix} tokens), got {max_sequence_length}")
    # Prefix and prompt are tokenized together, as in the reference (a merge could cross the seam).
    heads = tokenizer(
        [SYSTEM_PREFIX + p for p in prompts], add_special_tokens=False, truncation=True,
        max_length=counts.prefix + max_sequence_length - counts.suffix,
    ).input_ids
    limit = counts.prefix + max_sequence_length - counts.suffix
    cut = [i for i, head in enumerate(heads) if len(head) == limit]
    if cut:
        logger.warning("prompts %s reach the %d-token limit and may be truncated", cut, max_sequence_length - counts.suffix)
    suffix = tokenizer(ASSISTANT_SUFFIX, add_special_tokens=False).input_ids
    longest = max_sequence_length + counts.prefix if pad_to_max else max(len(h) for h in heads) + counts.suffix
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for row, head in enumerate(heads):
        input_ids[row, : len(head)] = torch.tensor(head)
        input_ids[row, longest - counts.suffix:] = torch.tensor(suffix)
        mask[row, : len(head)] = True
        mask[row, longest - counts.suffix:] = True
    return input_ids, mask, counts.prefix


def text_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """(3, B, S) mRoPE positions counting only real tokens, identical on the three axes."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return positions.unsqueeze(0).expand(3, -1, -1)


def base_text_model(text_encoder):
    """The ``Qwen3VLModel`` inside a ``Qwen3VLForConditionalGeneration`` (or the model itself)."""
    inner = getattr(text_encoder, "model", None)
    return inner if inner is not None and hasattr(inner, "language_model") else text_encoder


@torch.no_grad()
def encode_prompts(
    text_encoder, tokenizer, prompts: list[str], *, layers=TAPPED_LAYERS, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
    device=None, pad_to_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode prompts into the transformer's text input.

    Returns:
        embeds (B, L, len(layers), hidden) in the encoder's dtype and mask (B, L) bool (prefix dropped).
    """
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    unique = list(dict.fromkeys(prompts))
    if len(unique) < len(prompts):
        # Each distinct prompt once (CFG's B empty negatives, a seed sweep's copies of one prompt): the
        # rows of a batch never mix, and the padded length is the longest prompt's either way, so the
        # copies are the same rows. A batch of 256 copies encoded 256 times took 2 s a call on the tiny encoder.
        embeds, mask = encode_prompts(text_encoder, tokenizer, unique, layers=layers, max_sequence_length=max_sequence_length,
                                      device=device, pad_to_max=pad_to_max)
        row = {prompt: i for i, prompt in enumerate(unique)}
        index = torch.tensor([row[prompt] for prompt in prompts], device=embeds.device)
        return embeds[index], mask[index]
    model = base_text_model(text_encoder)
    device = device or next(model.parameters()).device
    input_ids, mask, prefix = tokenize_prompts(tokenizer, prompts, max_sequence_length, pad_to_max)
    input_ids, mask = input_ids.to(device), mask.to(device)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=text_position_ids(mask), output_hidden_states=True)
    hidden = out.hidden_states
    if max(layers) >= len(hidden):
        raise ValueError(f"text encoder has {len(hidden) - 1} layers; tapped layers {tuple(layers)} need {max(layers)}")
    embeds = torch.stack([hidden[i] for i in layers], dim=2)
    return embeds[:, prefix:], mask[:, prefix:]


def pad_conditioning(embeds: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Join encodings of different text lengths into one batch.

    Extra padding is appended at the end of the shorter rows. Inside the transformer every text
    token sits at RoPE position (0, 0, 0), padding is masked as a key and its outputs are never
    read, so where the padding sits does not change any real token's result.
    """
    length = max(e.shape[1] for e in embeds)
    out_e, out_m = [], []
    for e, m in zip(embeds, masks):
        extra = length - e.shape[1]
        out_e.append(torch.nn.functional.pad(e, (0, 0, 0, 0, 0, extra)))
        out_m.append(torch.nn.functional.pad(m, (0, extra), value=False))
    return torch.cat(out_e), torch.cat(out_m)
