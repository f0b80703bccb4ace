"""Key conversion between Krea's original checkpoint layout and the diffusers layout.

This is the only module that spells the original names (``first``, ``wq``, ``txtfusion`` ...).
Both directions are pure renames plus one reshape (the per-block modulation table is stored
flat, ``(6 * D,)``, in the original file and as ``(6, D)`` in diffusers), so
``convert_diffusers_to_original(convert_original_to_diffusers(sd))`` returns ``sd`` exactly.

The module-level renames are exposed separately (:func:`original_module_to_diffusers`,
:func:`diffusers_module_to_original`) because LoRA files name *modules*, not tensors.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# Top-level module renames, original -> diffusers. Order matters only for readability: the
# prefixes are disjoint.
_TOP_LEVEL = (
    ("first.", "img_in."),
    ("tmlp.0.", "time_embed.linear_1."),
    ("tmlp.2.", "time_embed.linear_2."),
    ("tproj.1.", "time_mod_proj."),
    ("txtmlp.0.scale", "txt_in.norm.weight"),
    ("txtmlp.1.", "txt_in.linear_1."),
    ("txtmlp.3.", "txt_in.linear_2."),
    ("txtfusion.", "text_fusion."),
    ("last.linear.", "final_layer.linear."),
    ("last.norm.scale", "final_layer.norm.weight"),
    ("last.modulation.lin", "final_layer.scale_shift_table"),
)

# Renames inside a block (transformer blocks and text-fusion blocks alike).
_IN_BLOCK = (
    ("attn.wq.", "attn.to_q."),
    ("attn.wk.", "attn.to_k."),
    ("attn.wv.", "attn.to_v."),
    ("attn.wo.", "attn.to_out.0."),
    ("attn.gate.", "attn.to_gate."),
    ("attn.qknorm.qnorm.scale", "attn.norm_q.weight"),
    ("attn.qknorm.knorm.scale", "attn.norm_k.weight"),
    ("mlp.", "ff."),
    ("prenorm.scale", "norm1.weight"),
    ("postnorm.scale", "norm2.weight"),
    ("mod.lin", "scale_shift_table"),
)

_ORIG_BLOCK = re.compile(r"^(blocks\.\d+\.|txtfusion\.(?:layerwise|refiner)_blocks\.\d+\.)(.*)$")
_DIFF_BLOCK = re.compile(r"^(transformer_blocks\.\d+\.|text_fusion\.(?:layerwise|refiner)_blocks\.\d+\.)(.*)$")

# Tensors some community files carry that the released model never reads.
DORMANT_ORIGINAL_PREFIXES = ("last.up.", "last.down.")


class UnknownKeyError(KeyError):
    """A key that has no counterpart in the other layout."""


def strip_original_prefix(name: str) -> str:
    for prefix in ORIGINAL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _rename(name: str, pairs, reverse: bool) -> str | None:
    for a, b in pairs:
        src, dst = (b, a) if reverse else (a, b)
        if name.startswith(src):
            return dst + name[len(src):]
        if name == src.rstrip("."):  # a module name (LoRA files), not a tensor name
            return dst.rstrip(".")
    return None


# Block containers: (original head, diffusers head); block indices are kept.
_BLOCK_HEADS = (("blocks.", "transformer_blocks."), ("txtfusion.", "text_fusion."))


def _map_name(name: str, reverse: bool) -> str:
    layout = "diffusers" if reverse else "original"
    match = (_DIFF_BLOCK if reverse else _ORIG_BLOCK).match(name)
    if match:
        head, tail = match.groups()
        head = _rename(head, _BLOCK_HEADS, reverse)
        new_tail = _rename(tail, _IN_BLOCK, reverse)
        if new_tail is None:
            raise UnknownKeyError(f"unknown {layout} key {name!r} (no rename for {tail!r} inside a block)")
        return head + new_tail
    renamed = _rename(name, _TOP_LEVEL, reverse)
    if renamed is None:
        raise UnknownKeyError(f"unknown {layout} key {name!r}")
    return renamed


def original_module_to_diffusers(name: str) -> str:
    """Map one original tensor or module name (prefix allowed) to its diffusers name."""
    return _map_name(strip_original_prefix(name), reverse=False)


def diffusers_module_to_original(name: str) -> str:
    """Map one diffusers tensor or module name to its original name (no prefix)."""
    return _map_name(name, reverse=True)


def _is_block_modulation(diffusers_name: str) -> bool:
    return diffusers_name.startswith("transformer_blocks.") and diffusers_name.endswith(".scale_shift_table")


def convert_original_to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original layout -> diffusers layout. Dormant extras (``last.up/down``) are dropped.

    Args:
        state_dict: original names (``model.diffusion_model.`` prefix optional) to tensors.
    Returns:
        diffusers names to the same tensors; ``blocks.N.mod.lin`` ``(6D,)`` becomes a ``(6, D)`` view.
    Raises:
        UnknownKeyError: naming the first key with no diffusers counterpart.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        bare = strip_original_prefix(key)
        if bare.startswith(DORMANT_ORIGINAL_PREFIXES):
            continue
        new = original_module_to_diffusers(bare)
        if _is_block_modulation(new) and tensor.ndim == 1:
            tensor = tensor.view(6, -1)
        out[new] = tensor
    return out


def convert_diffusers_to_original(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers layout -> original layout (no prefix); the exact inverse of :func:`convert_original_to_diffusers`."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        new = diffusers_module_to_original(key)
        if _is_block_modulation(key) and tensor.ndim == 2:
            tensor = tensor.reshape(-1)
        out[new] = tensor
    return out


def is_original_layout(keys) -> bool:
    """True when the keys look like the original layout (possibly prefixed)."""
    return any(strip_original_prefix(k).startswith(("first.", "txtfusion.", "tproj.")) for k in keys)
