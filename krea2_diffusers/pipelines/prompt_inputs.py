"""The conditioning side of a generation: prompts as lists, prompts and negatives encoded in one
text-encoder call, the rows the transformer runs on (CFG's two branches padded to one length), and
where style / reference latents join the image tokens.

Shapes: text embeds (B, L, 12, 2560) with bool masks (B, L); positions (L + N, 3) for N image
tokens, (L + N + R, 3) once R reference-latent tokens follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..conditioning.text import pad_conditioning


def prompt_list(value, name: str, batch: int | None = None) -> list[str] | None:
    """``value`` (a string or a non-empty list of strings) as a list; with ``batch``, one string is
    repeated for every prompt and any other count than ``batch`` is refused. None stays None."""
    if value is None:
        return None
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values) or not values:
        raise ValueError(f"{name} must be a string or a non-empty list of strings, got {value!r}")
    values = list(values)
    if batch is not None and len(values) != batch:
        if len(values) == 1:
            return values * batch
        raise ValueError(f"{name} has {len(values)} entries but there are {batch} prompts")
    return values


def encode_with_negatives(pipe, prompts, negatives, max_sequence_length, device):
    """Encode positive and negative prompts in one encoder call; returns ((e, m), (ne, nm) | None)."""
    texts = prompts + (negatives or [])
    embeds, mask = pipe.encode_prompt(texts, device=device, max_sequence_length=max_sequence_length)
    n = len(prompts)
    if not negatives:
        return (embeds, mask), None
    return (embeds[:n], mask[:n]), (embeds[n:], mask[n:])


@dataclass
class PromptRows:
    """The text rows of a generation, each prompt's repeated ``num_images_per_prompt`` times:
    ``embeds`` (B * n, L, 12, 2560) the prompts' alone; ``all_embeds`` / ``all_mask`` what the
    transformer runs, the prompts' rows then (with CFG) the negatives', padded to one length."""

    embeds: torch.Tensor
    all_embeds: torch.Tensor
    all_mask: torch.Tensor


def prompt_rows(pipe, prompts, negatives, style, *, batch: int, num_images_per_prompt: int, do_cfg: bool,
                prompt_embeds, prompt_embeds_mask, negative_prompt_embeds, negative_prompt_embeds_mask,
                max_sequence_length: int, device) -> PromptRows:
    """Text conditioning from, in this order of precedence: the ``style`` batch (its text rows are
    the prompts then the negatives), the prompts and negatives encoded in one call, or the given
    embeds (each side encoded on its own where only its text is given)."""
    if style is not None:
        embeds, mask = style.embeds[:batch], style.mask[:batch]
        neg = (style.embeds[batch:], style.mask[batch:]) if do_cfg else None
    elif prompt_embeds is None and (negative_prompt_embeds is None or not do_cfg):
        (embeds, mask), neg = encode_with_negatives(pipe, prompts, negatives, max_sequence_length, device)
    else:
        embeds, mask = pipe.encode_prompt(prompts, device, 1, prompt_embeds, prompt_embeds_mask, max_sequence_length)
        neg = None
        if do_cfg:
            neg = pipe.encode_prompt(negatives, device, 1, negative_prompt_embeds, negative_prompt_embeds_mask, max_sequence_length)
    n = num_images_per_prompt
    embeds, mask = embeds.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    if do_cfg:
        neg_embeds, neg_mask = neg[0].repeat_interleave(n, 0), neg[1].repeat_interleave(n, 0)
        all_embeds, all_mask = pad_conditioning([embeds, neg_embeds], [mask, neg_mask])
    else:
        all_embeds, all_mask = embeds, mask
    return PromptRows(embeds=embeds, all_embeds=all_embeds, all_mask=all_mask)


def reference_inputs(style, positions: torch.Tensor, rows: int, image_tokens: int):
    """``(positions, reference_hidden_states, key_bias)`` for the transformer: with a style /
    reference batch its latents' positions follow ``positions``, its latents (1, R, C) are shared by
    every row (the transformer broadcasts them) and its strength bias (rows, L + N + R) is
    expanded from the first row; without one, ``positions`` and no reference."""
    if style is None:
        return positions, None, None
    reference = None
    if style.latents is not None:
        positions = torch.cat([positions, style.positions.to(positions)])
        reference = style.latents[:1]
    bias = style.key_bias(image_tokens)
    return positions, reference, None if bias is None else bias[:1].expand(rows, -1)
