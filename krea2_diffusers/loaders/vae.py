"""The Qwen-Image VAE as one safetensors file: ComfyUI's Wan 2.1 layout
(``models/vae/qwen_image_vae.safetensors``) or diffusers' ``AutoencoderKLQwenImage`` layout.

Wan 2.1 names modules by position in ``nn.Sequential`` containers; diffusers by role. Per residual
block: ``residual.{0,2,3,6}`` = ``norm1, conv1, norm2, conv2`` and ``shortcut`` = ``conv_shortcut``.
The encoder's ``downsamples.N`` list keeps its indices as ``down_blocks.N``; the decoder's flat
``upsamples.N`` list is grouped per stage: with R residual blocks per stage, stage i holds
``R + 1`` resnets (``upsamples.{i(R+2) + r}``) then its upsampler (``upsamples.{i(R+2) + R + 1}``).
The config (width, depth, stages, temporal downsampling) is read from the shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..files import CheckpointError, read_safetensors, read_safetensors_header, save_safetensors
from .meta import assign_state_dict, parameters_on_meta

_RESNET = (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."), ("conv2.", "residual.6."),
           ("conv_shortcut.", "shortcut."))
_FIXED = (  # diffusers prefix -> Wan prefix, outside the per-block lists
    ("encoder.conv_in.", "encoder.conv1."), ("decoder.conv_in.", "decoder.conv1."),
    ("encoder.norm_out.", "encoder.head.0."), ("encoder.conv_out.", "encoder.head.2."),
    ("decoder.norm_out.", "decoder.head.0."), ("decoder.conv_out.", "decoder.head.2."),
    ("quant_conv.", "conv1."), ("post_quant_conv.", "conv2."),
)
_MID = (("resnets.0.", "0."), ("attentions.0.", "1."), ("resnets.1.", "2."))
WAN_MARKER = "decoder.middle.0.residual.0.gamma"
DIFFUSERS_MARKER = "decoder.mid_block.resnets.0.norm1.gamma"
# Keys that betray another VAE, for a helpful refusal.
_FOREIGN = (
    ("decoder.upsamples.0.upsamples.0.residual.2.weight", "the Wan 2.2 VAE (48 latent channels)"),
    ("decoder.mid.block_1.norm1.weight", "a Flux / Stable Diffusion VAE (2-D, original layout)"),
    ("decoder.mid_block.resnets.0.norm1.weight", "a Flux / Stable Diffusion VAE (2-D, diffusers layout)"),
    ("first_stage_model.decoder.mid.block_1.norm1.weight", "a Stable Diffusion checkpoint's VAE"),
)
LATENT_CHANNELS = 16


def _rename_prefix(name: str, pairs, reverse: bool) -> str | None:
    for a, b in pairs:
        src, dst = (b, a) if reverse else (a, b)
        if name.startswith(src):
            return dst + name[len(src):]
    return None


def _resnet(tail: str, reverse: bool) -> str:
    return _rename_prefix(tail, _RESNET, reverse) or tail  # attention / resample tensors keep their names


def diffusers_to_wan(name: str, num_res_blocks: int) -> str:
    """One diffusers ``AutoencoderKLQwenImage`` tensor name -> its Wan 2.1 name."""
    fixed = _rename_prefix(name, _FIXED, reverse=False)
    if fixed is not None:
        return fixed
    if m := re.match(r"^(encoder|decoder)\.mid_block\.(.*)$", name):
        part, tail = m.groups()
        inner = _rename_prefix(tail, _MID, reverse=False)
        head, _, rest = inner.partition(".")
        return f"{part}.middle.{head}.{_resnet(rest, False)}"
    if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", name):
        return f"encoder.downsamples.{m.group(1)}.{_resnet(m.group(2), False)}"
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.*)$", name):
        stage, _, resnet, tail = m.groups()
        offset = int(resnet) if resnet is not None else num_res_blocks + 1
        index = int(stage) * (num_res_blocks + 2) + offset
        return f"decoder.upsamples.{index}.{_resnet(tail, False) if resnet is not None else tail}"
    raise CheckpointError(f"unknown Qwen-Image VAE tensor {name!r}")


def wan_to_diffusers(name: str, num_res_blocks: int) -> str:
    """One Wan 2.1 tensor name -> its diffusers name (the inverse of :func:`diffusers_to_wan`)."""
    fixed = _rename_prefix(name, _FIXED, reverse=True)
    if fixed is not None:
        return fixed
    if m := re.match(r"^(encoder|decoder)\.middle\.(\d)\.(.*)$", name):
        part, index, tail = m.groups()
        head = _rename_prefix(f"{index}.", _MID, reverse=True)
        return f"{part}.mid_block.{head}{tail if index == '1' else _resnet(tail, True)}"
    if m := re.match(r"^encoder\.downsamples\.(\d+)\.(.*)$", name):
        return f"encoder.down_blocks.{m.group(1)}.{_resnet(m.group(2), True)}"
    if m := re.match(r"^decoder\.upsamples\.(\d+)\.(.*)$", name):
        stage, offset = divmod(int(m.group(1)), num_res_blocks + 2)
        if offset == num_res_blocks + 1:
            return f"decoder.up_blocks.{stage}.upsamplers.0.{m.group(2)}"
        return f"decoder.up_blocks.{stage}.resnets.{offset}.{_resnet(m.group(2), True)}"
    raise CheckpointError(f"unknown Wan 2.1 VAE tensor {name!r}")


def _wan_num_res_blocks(keys) -> int:
    """R from a Wan file: the first decoder upsampler sits at ``upsamples.{R + 1}``."""
    upsamplers = sorted(int(m.group(1)) for k in keys if (m := re.match(r"^decoder\.upsamples\.(\d+)\.resample\.", k)))
    if not upsamplers:
        raise CheckpointError("a Wan 2.1 VAE without decoder upsamplers")
    return upsamplers[0] - 1


def config_from_shapes(shapes: dict[str, tuple]) -> dict:
    """``AutoencoderKLQwenImage`` config from diffusers-layout shapes."""
    base_dim = shapes["encoder.conv_in.weight"][0]
    z_dim = shapes["post_quant_conv.weight"][0]
    stages = len({k.split(".")[2] for k in shapes if k.startswith("decoder.up_blocks.")})
    num_res_blocks = len({k.split(".")[4] for k in shapes if k.startswith("decoder.up_blocks.0.resnets.")}) - 1
    dim_mult = [shapes[f"encoder.down_blocks.{i * (num_res_blocks + 1)}.conv1.weight"][0] // base_dim for i in range(stages)]
    temporal = [f"encoder.down_blocks.{i * (num_res_blocks + 1) + num_res_blocks}.time_conv.weight" in shapes
                for i in range(stages - 1)]
    return dict(base_dim=base_dim, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=num_res_blocks, temperal_downsample=temporal)


def identify(keys, path) -> str:
    """'wan' or 'diffusers', or a CheckpointError naming what the file is instead."""
    keys = set(keys)
    for marker, what in _FOREIGN:
        if marker in keys:
            raise CheckpointError(f"{path}: this is {what}, not the Qwen-Image VAE Krea 2 uses")
    if WAN_MARKER in keys:
        return "wan"
    if DIFFUSERS_MARKER in keys and "post_quant_conv.weight" in keys:
        return "diffusers"
    if any(k.startswith(("blocks.", "first.", "model.diffusion_model.", "model.language_model.")) for k in keys):
        raise CheckpointError(f"{path}: this is a diffusion model or text encoder, not a VAE")
    raise CheckpointError(f"{path}: not a Qwen-Image VAE (no {WAN_MARKER!r} or {DIFFUSERS_MARKER!r}); "
                          f"first tensors: {sorted(keys)[:4]}")


def load_vae_file(path, torch_dtype: torch.dtype | None = None):
    """An ``AutoencoderKLQwenImage`` from one safetensors file in Wan 2.1 or diffusers layout."""
    from diffusers import AutoencoderKLQwenImage

    path = Path(path)
    header, _, _ = read_safetensors_header(path)
    layout = identify(header, path)
    rename = (lambda n: n) if layout == "diffusers" else (lambda n, r=_wan_num_res_blocks(header): wan_to_diffusers(n, r))
    try:
        shapes = {rename(k): tuple(e["shape"]) for k, e in header.items()}
        config = config_from_shapes(shapes)
    except (CheckpointError, KeyError) as err:
        raise CheckpointError(f"{path}: not a complete Qwen-Image VAE ({err})") from None
    if config["z_dim"] != LATENT_CHANNELS:
        raise CheckpointError(f"{path}: a Wan-style VAE with {config['z_dim']} latent channels; Krea 2 needs {LATENT_CHANNELS}")
    dtype_for = None if torch_dtype is None else (lambda n, d: torch_dtype if d.is_floating_point else d)
    tensors = {rename(k): v for k, v in read_safetensors(path, dtype_for=dtype_for).items()}
    with parameters_on_meta():
        vae = AutoencoderKLQwenImage(**config)
    return assign_state_dict(vae, tensors, str(path), f"the Qwen-Image VAE config {config}")


def save_wan_vae(vae, path) -> None:
    """Write ``vae`` (``AutoencoderKLQwenImage``) as one Wan 2.1-layout file, as ComfyUI's VAELoader reads it."""
    num_res_blocks = vae.config.num_res_blocks
    tensors = {diffusers_to_wan(k, num_res_blocks): v for k, v in vae.state_dict().items()}
    save_safetensors(tensors, path, metadata={"format": "pt"})
