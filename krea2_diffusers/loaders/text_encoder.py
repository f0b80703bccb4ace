"""The Qwen3-VL text encoder as ONE safetensors file in Hugging Face layout (what ComfyUI users
hold as ``models/text_encoders/qwen3vl_4b_{bf16,fp8_scaled}.safetensors``).

Layout: ``model.language_model.*``, ``model.visual.*`` and an optional ``lm_head.weight`` (tied to
the token embeddings when absent). The config is built in for Qwen3-VL-4B-Instruct (and the
offline ``tiny-random`` test model) and checked against the file's shapes; other sizes take
``text_encoder_config=`` (a config folder, a JSON file or a ``Qwen3VLConfig``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files import CheckpointError, read_safetensors, read_safetensors_header
from . import comfy_fp8
from .comfy_fp8 import EMBEDDINGS
from .meta import assign_state_dict, parameters_on_meta

LM_HEAD = "lm_head.weight"
# Qwen3-VL-4B-Instruct as released (its config.json); the vision tower's rotary and patch sizes are shared by all sizes.
QWEN3VL_4B_INSTRUCT = dict(
    text_config=dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6,
        attention_bias=False, rope_theta=5000000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ),
    vision_config=dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
    ),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True,
)
# Keys that betray another model family, for a helpful refusal (checked in order).
_FOREIGN_MARKERS = (
    ("encoder.block.0.layer.0.SelfAttention.q.weight", "a T5 encoder (Flux / SD3 / Wan text encoder)"),
    ("shared.weight", "a T5 encoder (Flux / SD3 / Wan text encoder)"),
    ("text_model.encoder.layers.0.self_attn.q_proj.weight", "a CLIP text encoder"),
    ("visual.blocks.0.attn.qkv.weight", "Qwen2.5-VL (Qwen-Image's text encoder), not Qwen3-VL"),
    ("model.layers.0.self_attn.q_norm.weight", "a text-only Qwen3 LLM (no vision tower), not Qwen3-VL"),
    ("model.layers.0.self_attn.q_proj.bias", "Qwen2.5-VL (Qwen-Image's text encoder), not Qwen3-VL"),
)


def builtin_configs() -> dict:
    """Configs recognised from a file's shapes alone, by name."""
    from transformers import Qwen3VLConfig

    from ..models.tiny import tiny_text_encoder_config

    return {"Qwen3-VL-4B-Instruct": Qwen3VLConfig(**QWEN3VL_4B_INSTRUCT), "tiny-random": tiny_text_encoder_config()}


def read_config(config):
    """``text_encoder_config=``: a ``Qwen3VLConfig``, a JSON file, or a folder holding ``config.json``."""
    from transformers import Qwen3VLConfig

    if config is None or isinstance(config, Qwen3VLConfig):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the Qwen3-VL config ({err})") from None
    if values.get("model_type", "qwen3_vl") != "qwen3_vl":
        raise CheckpointError(f"{path}: config of model_type {values['model_type']!r}, expected 'qwen3_vl'")
    values.pop("model_type", None)
    return Qwen3VLConfig(**values)


def _describe(shapes: dict[str, tuple]) -> str:
    """What a Qwen3-VL-like file looks like: its widths and depths, for error messages."""
    layers = len({k.split(".")[3] for k in shapes if k.startswith("model.language_model.layers.")})
    hidden = shapes.get(EMBEDDINGS, (None, None))[1]
    vision = len({k.split(".")[3] for k in shapes if k.startswith("model.visual.blocks.")})
    return f"a Qwen3-VL-like model with hidden size {hidden}, {layers} text layers and {vision} vision blocks"


def identify(shapes: dict[str, tuple], path) -> None:
    """Refuse a file that is not a Hugging Face-layout Qwen3-VL, naming what it looks like."""
    if EMBEDDINGS in shapes and any(k.startswith("model.visual.") for k in shapes):
        if not any(k.endswith("self_attn.q_norm.weight") for k in shapes):
            raise CheckpointError(f"{path}: this is Qwen2.5-VL (Qwen-Image's text encoder), not the Qwen3-VL Krea 2 uses")
        return
    for marker, what in _FOREIGN_MARKERS:
        if marker in shapes:
            raise CheckpointError(f"{path}: this is {what}; Krea 2 needs Qwen3-VL-4B-Instruct "
                                  "(e.g. ComfyUI's text_encoders/qwen3vl_4b_bf16.safetensors)")
    if any(k.startswith(("model.diffusion_model.", "blocks.", "first.", "txtfusion.")) for k in shapes):
        raise CheckpointError(f"{path}: this is a Krea 2 transformer (a diffusion model), not the text encoder")
    raise CheckpointError(f"{path}: not a Qwen3-VL text encoder in Hugging Face layout "
                          f"(no {EMBEDDINGS!r} with 'model.visual.*'); first tensors: {sorted(shapes)[:4]}")


def _expected_shapes(config) -> dict[str, tuple]:
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def match_config(shapes: dict[str, tuple], path, config=None):
    """The config for a file's ``shapes``: ``config`` checked against them, or the built-in one they fit."""
    weights = {k: v for k, v in shapes.items() if k != LM_HEAD}
    candidates = {"text_encoder_config": config} if config is not None else builtin_configs()
    for name, candidate in candidates.items():
        expected = _expected_shapes(candidate)
        expected.pop(LM_HEAD, None)
        if expected == weights:
            return candidate
        if config is not None:
            wrong = sorted(set(expected) ^ set(weights))[:4] or [
                f"{k}: file {weights[k]} vs config {expected[k]}" for k in expected if expected[k] != weights[k]][:4]
            raise CheckpointError(f"{path}: {_describe(shapes)} does not fit text_encoder_config ({wrong})")
    raise CheckpointError(f"{path}: {_describe(shapes)}, not Qwen3-VL-4B-Instruct (hidden size 2560, 36 layers, "
                          "24 vision blocks); pass text_encoder_config= (a config folder, JSON file or Qwen3VLConfig) for other sizes")


def load_text_encoder_file(path, torch_dtype: torch.dtype | None = None, config=None, upcast_fp8: bool = False):
    """A ``Qwen3VLForConditionalGeneration`` from one Hugging Face-layout safetensors file.

    Args:
        path: the ``.safetensors`` file (bf16/fp32, or ComfyUI's scaled fp8).
        torch_dtype: dtype of the floating weights (None: as stored).
        config: ``text_encoder_config`` (see :func:`read_config`); None picks the built-in config the shapes fit.
        upcast_fp8: dequantize fp8 weights instead of keeping them as ``Fp8Linear`` layers.
    """
    from transformers import Qwen3VLForConditionalGeneration

    from .single_file import finish_fp8

    path = Path(path)
    header, _, _ = read_safetensors_header(path)
    shapes = {k: tuple(e["shape"]) for k, e in header.items() if not comfy_fp8.is_auxiliary(k)}
    identify(shapes, path)
    config = match_config(shapes, path, read_config(config))

    def dtype_for(name, stored):
        if comfy_fp8.is_auxiliary(name):
            return torch.float32
        keep = torch_dtype is None or not stored.is_floating_point or stored == comfy_fp8.FP8_DTYPE
        return stored if keep else torch_dtype

    tensors, scales = comfy_fp8.split_scales(read_safetensors(path, dtype_for=dtype_for), str(path))
    if upcast_fp8:
        tensors, scales = comfy_fp8.dequantize(tensors, scales, torch_dtype), {}
    with parameters_on_meta():
        model = Qwen3VLForConditionalGeneration(config)
    if LM_HEAD not in tensors:
        # Released 4B files tie the head to the embeddings and do not store it.
        tensors[LM_HEAD] = tensors[EMBEDDINGS]
    assign_state_dict(model, tensors, str(path), "the Qwen3-VL config")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    return finish_fp8(model, scales)


def text_encoder_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors of a single-file text encoder in Hugging Face layout (a tied LM head left out)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop(LM_HEAD, None)
    return state
