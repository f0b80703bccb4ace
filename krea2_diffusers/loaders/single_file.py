"""Loading the transformer from the files people have: original single files (optionally
prefixed or sharded with an index), diffusers-layout single files, and GGUF (``krea2_diffusers.quantization.gguf``).

The model is built on the meta device and the tensors read from disk are assigned to it, so a
load needs about one copy of the weights in memory, not two.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import SAFETENSORS_DTYPES, CheckpointError, read_safetensors, read_safetensors_header
from ..models.layers import rope_axes_dims
from . import comfy_fp8
from .convert import (
    DORMANT_ORIGINAL_PREFIXES,
    UnknownKeyError,
    convert_original_to_diffusers,
    original_module_to_diffusers,
    strip_original_prefix,
)
from .meta import assign_state_dict

logger = logging.getLogger(__name__)

# Keys that betray another architecture, for a helpful error.
_FOREIGN_MARKERS = {
    "double_blocks.": "Flux", "single_blocks.": "Flux", "joint_blocks.": "SD3", "transformer_blocks.0.ff_context.": "SD3/Flux (diffusers)",
    "model.diffusion_model.input_blocks.": "Stable Diffusion (UNet)", "input_blocks.": "Stable Diffusion (UNet)",
    "transformer_blocks.0.img_mlp.": "Qwen-Image",
}
# Norm scales keep float32 storage when a torch_dtype is requested: original names end in
# ".scale", diffusers names in one of these.
_FP32_SUFFIXES = (".scale", ".norm.weight", ".norm1.weight", ".norm2.weight", ".norm_q.weight", ".norm_k.weight")


def _count(prefix_re: str, keys) -> int:
    pattern = re.compile(prefix_re)
    return len({m.group(1) for k in keys if (m := pattern.match(k))})


def infer_config_from_shapes(shapes: dict[str, tuple[int, ...]]) -> dict:
    """Transformer config from the tensor shapes of an original-layout checkpoint (prefix stripped)."""
    try:
        dim, in_channels = shapes["first.weight"]
        head_dim = shapes["blocks.0.attn.qknorm.qnorm.scale"][0]
        text_dim = shapes["txtmlp.0.scale"][0]
        text_head_dim = shapes["txtfusion.layerwise_blocks.0.attn.qknorm.qnorm.scale"][0]
        config = dict(
            in_channels=in_channels,
            num_layers=_count(r"^blocks\.(\d+)\.", shapes),
            attention_head_dim=head_dim,
            num_attention_heads=dim // head_dim,
            num_key_value_heads=shapes["blocks.0.attn.wk.weight"][0] // head_dim,
            intermediate_size=shapes["blocks.0.mlp.gate.weight"][0],
            timestep_embed_dim=shapes["tmlp.0.weight"][1],
            text_hidden_dim=text_dim,
            num_text_layers=shapes["txtfusion.projector.weight"][1],
            text_num_attention_heads=text_dim // text_head_dim,
            text_num_key_value_heads=shapes["txtfusion.layerwise_blocks.0.attn.wk.weight"][0] // text_head_dim,
            text_intermediate_size=shapes["txtfusion.layerwise_blocks.0.mlp.gate.weight"][0],
            num_layerwise_text_blocks=_count(r"^txtfusion\.layerwise_blocks\.(\d+)\.", shapes),
            num_refiner_text_blocks=_count(r"^txtfusion\.refiner_blocks\.(\d+)\.", shapes),
            axes_dims_rope=rope_axes_dims(head_dim),
        )
    except KeyError as err:
        raise CheckpointError(f"cannot infer the Krea 2 config: tensor {err.args[0]!r} is missing") from None
    return config


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files behind ``path``: one file, an index's shards, or a folder's index."""
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if indexes:
            path = indexes[0]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: folder holds no .safetensors files")
            return files
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: not a safetensors index ({err})") from None
        shards = sorted({path.parent / name for name in weight_map.values()})
        missing = [str(s) for s in shards if not s.exists()]
        if missing:
            raise CheckpointError(f"{path}: shard files missing: {missing}")
        return shards
    if path.suffix in (".ckpt", ".pt", ".pth", ".bin"):
        raise CheckpointError(f"{path}: pickle-based checkpoints are not loaded (unsafe); convert it to safetensors")
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    return [path]


def identify_layout(keys: list[str], path: Path) -> str:
    """'original' or 'diffusers' layout, or a CheckpointError saying what the file is instead."""
    bare = {strip_original_prefix(k) for k in keys}
    if "txtfusion.projector.weight" in bare or "first.weight" in bare:
        return "original"
    if "text_fusion.projector.weight" in bare and "img_in.weight" in bare:
        return "diffusers"
    for marker, name in _FOREIGN_MARKERS.items():
        if any(k.startswith(marker) for k in keys):
            raise CheckpointError(f"{path}: this is a {name} checkpoint, not Krea 2")
    raise CheckpointError(f"{path}: not a Krea 2 transformer checkpoint (no 'txtfusion.projector.weight' or 'first.weight')")


def _target_dtype(torch_dtype):
    def choose(name: str, stored: torch.dtype) -> torch.dtype:
        if comfy_fp8.is_auxiliary(name):  # fp8 scales: exact as stored, float32
            return torch.float32 if stored.is_floating_point else stored
        if torch_dtype is None or not stored.is_floating_point or stored == comfy_fp8.FP8_DTYPE:
            return stored
        if name.endswith(_FP32_SUFFIXES):
            return torch.float32
        return torch_dtype
    return choose


def load_state_dict_into_meta_model(cls, state_dict: dict[str, torch.Tensor], config: dict, source: str):
    """Build ``cls(**config)`` on the meta device and assign ``state_dict`` (diffusers names) to it."""
    with torch.device("meta"):
        model = cls(**config)
    return assign_state_dict(model, state_dict, source, "the Krea 2 config")


def finish_fp8(model: torch.nn.Module, scales: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Give the layers loaded with fp8 weights their scales (:class:`krea2_diffusers.quantization.fp8.Fp8Linear`)."""
    if scales:
        from ..quantization.fp8 import replace_linears_

        replace_linears_(model, scales)
    return model


def load_single_file(cls, path, torch_dtype: torch.dtype | None = None, config: dict | None = None, upcast_fp8: bool = False):
    """Load a Krea 2 transformer from a single file, a sharded index or a GGUF file.

    Args:
        path: ``.safetensors`` (original or diffusers layout, ``model.diffusion_model.`` prefix allowed,
            ComfyUI's scaled fp8 included), ``*.safetensors.index.json`` or a folder of shards, or ``.gguf``.
        torch_dtype: cast floating tensors to this dtype as they are read (norm scales stay float32);
            None keeps the stored dtypes.
        config: transformer config kwargs; inferred from the tensor shapes when None.
        upcast_fp8: dequantize a scaled-fp8 file's weights to ``torch_dtype`` (None: the file's other tensors' dtype)
            instead of keeping them in fp8 with their scales (``Fp8Linear``, computed in the input's dtype).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        from ..quantization.gguf import load_gguf_transformer

        return load_gguf_transformer(cls, path, config=config, torch_dtype=torch_dtype)
    files = _shard_files(path)
    headers = {f: read_safetensors_header(f)[0] for f in files}
    keys = [k for h in headers.values() for k in h if not comfy_fp8.is_auxiliary(k)]
    layout = identify_layout(keys, path)
    if layout == "original":
        dormant = [k for k in keys if strip_original_prefix(k).startswith(DORMANT_ORIGINAL_PREFIXES)]
        if dormant:
            logger.warning("%s: ignoring unused tensors %s", path, dormant)
        for k in keys:
            if k not in dormant:
                try:
                    original_module_to_diffusers(k)
                except UnknownKeyError:
                    raise CheckpointError(f"{path}: unexpected tensor {k!r} (not part of Krea 2)") from None
        shapes = {strip_original_prefix(k): tuple(e["shape"]) for h in headers.values() for k, e in h.items() if k in keys}
        if config is None:
            config = infer_config_from_shapes(shapes)
    elif config is None:
        raise CheckpointError(f"{path}: a diffusers-layout single file needs `config=` (or load its folder with from_pretrained)")
    tensors: dict[str, torch.Tensor] = {}
    choose = _target_dtype(torch_dtype)
    for f, header in headers.items():
        names = [k for k in header if not strip_original_prefix(k).startswith(DORMANT_ORIGINAL_PREFIXES)]
        tensors.update(read_safetensors(f, names, dtype_for=lambda n, d: choose(strip_original_prefix(n), d)))
    tensors, scales = comfy_fp8.split_scales(tensors, str(path))
    if layout == "original":
        tensors = convert_original_to_diffusers(tensors)
        scales = {original_module_to_diffusers(layer): scale for layer, scale in scales.items()}
    if upcast_fp8:
        tensors, scales = comfy_fp8.dequantize(tensors, scales, torch_dtype), {}
    return finish_fp8(load_state_dict_into_meta_model(cls, tensors, config, str(path)), scales)


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes sit in a safetensors file: row-major, ``shape`` as stored."""

    file: Path
    offset: int  # absolute byte offset of the first element
    dtype: torch.dtype
    shape: tuple[int, ...]


def locate_transformer_tensors(path, config: dict | None = None) -> tuple[dict, dict[str, TensorLocation]]:
    """The transformer config and, per diffusers tensor name, where its bytes are, without reading them.

    For readers that take only part of each tensor (a sharded training setup reads its own rows).
    ``path``: an original-layout single file or index (the config is inferred from shapes), a
    diffusers ``transformer`` folder (its ``config.json``), or a diffusers pipeline folder.
    Stored element order equals the diffusers tensor's (the modulation table's reshape is a view).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        raise CheckpointError(f"{path}: GGUF files hold quantized blocks; reading row slices needs safetensors")
    if path.is_dir() and (path / "model_index.json").exists():
        path = path / "transformer"
    if path.is_dir() and (path / "config.json").exists() and config is None:
        config = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if not k.startswith("_")}
    files = _shard_files(path)
    headers = {f: read_safetensors_header(f) for f in files}
    if any(comfy_fp8.is_scaled_fp8(h, meta) for h, meta, _ in headers.values()):
        raise CheckpointError(f"{path}: a scaled-fp8 file holds rounded weights that cannot be trained in place; "
                              "train from a bf16/fp32 file (or a LoRA over it with model.quantize: fp8)")
    keys = [k for h, _, _ in headers.values() for k in h]
    layout = identify_layout(keys, path)
    if layout == "original" and config is None:
        config = infer_config_from_shapes({strip_original_prefix(k): tuple(e["shape"]) for h, _, _ in headers.values() for k, e in h.items()})
    if config is None:
        raise CheckpointError(f"{path}: a diffusers-layout single file needs `config=`")
    located: dict[str, TensorLocation] = {}
    for file, (header, _, data_start) in headers.items():
        for key, entry in header.items():
            if layout == "original":
                if strip_original_prefix(key).startswith(DORMANT_ORIGINAL_PREFIXES):
                    continue
                try:
                    name = original_module_to_diffusers(key)
                except UnknownKeyError:
                    raise CheckpointError(f"{path}: unexpected tensor {key!r} (not part of Krea 2)") from None
            else:
                name = key
            located[name] = TensorLocation(file, data_start + entry["data_offsets"][0],
                                           SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return config, located
