"""Shared helpers of the GGUF tests: a tiny Krea 2 transformer whose widths are multiples of 256
(so every GGML type, K-quants included, can hold its matrices) and a file writer that uses only
the ``gguf`` package, following the community conventions (not our writer)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from krea2_diffusers.loaders.convert import convert_diffusers_to_original
from krea2_diffusers.models.transformer import Krea2Transformer2DModel

Q = GGMLQuantizationType

# D = 256 (4 heads x 64), SwiGLU 768 = rule(256), text width 256: all rows are whole 256-blocks.
TINY_GGUF_CONFIG = dict(
    in_channels=64, num_layers=4, attention_head_dim=64, num_attention_heads=4, num_key_value_heads=1,
    intermediate_size=768, timestep_embed_dim=256, text_hidden_dim=256, num_text_layers=3,
    text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=768,
    num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(16, 24, 24),
)
KEEP_PREFIXES = ("first.", "last.", "tproj.", "tmlp.", "txtmlp.", "txtfusion.projector.")
SMALL = 1024
TEXT_LEN, GRID = 5, 4


def make_model(seed: int = 0) -> Krea2Transformer2DModel:
    """fp32 model with variance-preserving random weights (matrices N(0, 1/fan_in), everything else
    N(0, 0.5^2)), so the quantized blocks carry a real share of the output."""
    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(**TINY_GGUF_CONFIG).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.ndim == 2:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
            else:
                param.copy_(torch.randn_like(param) * 0.5)
    return model


def make_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = TINY_GGUF_CONFIG
    n = GRID * GRID
    rows = torch.arange(n) // GRID
    cols = torch.arange(n) % GRID
    image_pos = torch.stack([torch.zeros(n, dtype=torch.long), rows, cols], dim=1)
    return dict(
        hidden_states=torch.randn(1, n, cfg["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, cfg["num_text_layers"], cfg["text_hidden_dim"], generator=g),
        timestep=torch.tensor([0.7]),
        position_ids=torch.cat([torch.zeros(TEXT_LEN, 3, dtype=torch.long), image_pos]),
    )


def run_model(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample.float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def community_type(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The community keep-in-F32 rules, restated here independently of krea2_diffusers.quantization.gguf.rules."""
    if len(shape) < 2 or int(np.prod(shape)) <= SMALL or name.startswith(KEEP_PREFIXES):
        return Q.F32
    return qtype


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf-py's quantizer where it has one; the K-quants have none in gguf-py, so ours."""
    try:
        return gguf_quants.quantize(values, qtype)
    except NotImplementedError:
        from krea2_diffusers.quantization.gguf.quantizer import quantize

        return quantize(values, qtype)


def write_with_gguf_writer(model, path, qtype, *, arch="krea2", prefix="", extra=None, orig_shape=True,
                           flatten=(), drop=()) -> None:
    """Write ``model`` the way community tools do, with ``gguf.GGUFWriter`` only.

    Args:
        extra: more original-name tensors (e.g. the dormant ``last.up.weight``).
        drop: original names left out of the file.
        flatten: names stored as 1-D rows of 256 values with ``comfy.gguf.orig_shape`` giving the
            real shape (what ComfyUI-GGUF does for tensors whose shape GGUF cannot hold).
    """
    state = {k: v.detach().float().numpy() for k, v in convert_diffusers_to_original(model.state_dict()).items()}
    state.update(extra or {})
    state = {k: v for k, v in state.items() if k not in drop}
    writer = GGUFWriter(str(path), arch=arch)
    for name, values in state.items():
        gtype = community_type(name, values.shape, qtype)
        stored = values.reshape(-1, 256) if name in flatten else values
        if orig_shape and (gtype != Q.F32 or name in flatten):
            writer.add_array(f"comfy.gguf.orig_shape.{prefix}{name}", list(values.shape))
        if gtype == Q.F32:
            writer.add_tensor(prefix + name, stored.astype(np.float32))
        else:
            writer.add_tensor(prefix + name, encode(stored, gtype), raw_dtype=gtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
