"""float8 weight storage for linear layers: one byte per weight plus a float32 scale, computed in a
higher precision. The one runtime fp8 layer of the library, for both of its uses:

- ComfyUI's scaled-fp8 checkpoints (:mod:`krea2_diffusers.loaders.comfy_fp8` reads the format):
  ``Fp8Linear(weight_fp8, scale, bias)`` keeps the file's fp8 values and scale as they are;
- a frozen LoRA base (``finetune``'s ``model.quantize: fp8``): ``Fp8Linear.from_linear(linear)``
  quantizes a float layer with a scale per output row. An unscaled cast to e4m3 clips large
  weights at 448 and flushes small rows toward the format's coarse low end; a per-row absolute-max
  scale uses the format's whole range for every row.

``y = x @ (weight_fp8 * scale).T + bias``, the weight dequantized per call in the input's dtype
(:mod:`.chunked_linear`: in output-row chunks on the CPU). Backward re-expands the *packed*
weight, so training keeps one byte per frozen weight resident instead of the compute-dtype copy
``F.linear`` would save for every layer.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from .chunked_linear import chunked_linear

FP8_DTYPE = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# An all-zero weight (or row) keeps a tiny positive scale: any scale reproduces it, and it avoids 0/0.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_weight(weight: torch.Tensor, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (out, in) e4m3 values and a float32 scale, weight ~= fp8 * scale.

    The scale is one value per output row, shaped (out, 1), or (``per_row=False``, ComfyUI's
    per-tensor format) a scalar of shape (): absolute maximum / 448 either way. Computed in row
    chunks of ~``CHUNK_WEIGHTS`` weights: the whole-matrix float32 copies (~13 bytes a weight) would
    add ~1 GiB to the streamed load of the 12.8B model's largest matrices; every element is
    computed by the same expression, so the result is the same to the bit.
    """
    from .bnb_packing import CHUNK_WEIGHTS

    w = weight.detach()
    if w.is_meta:  # a memory plan's model: shapes and dtypes only (the chunked arithmetic on meta costs seconds)
        scale = torch.empty((w.shape[0], 1) if per_row else (), dtype=torch.float32, device=w.device)
        return torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device), scale
    rows = max(1, CHUNK_WEIGHTS // max(1, w.shape[1]))
    if per_row:
        scale = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
        for start in range(0, w.shape[0], rows):
            scale[start:start + rows] = w[start:start + rows].float().abs().amax(dim=1, keepdim=True)
    else:
        amax = torch.zeros((), dtype=torch.float32, device=w.device)
        for start in range(0, w.shape[0], rows):
            amax = torch.maximum(amax, w[start:start + rows].float().abs().amax())
        scale = amax
    scale = (scale / FP8_MAX).clamp_min(_MIN_SCALE)
    out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    for start in range(0, w.shape[0], rows):
        part = w[start:start + rows].to(torch.float32, copy=True)  # a copy even for float32: divided in place
        # clamp: rounding in w / scale can land a hair above 448, which e4m3fn cannot hold.
        part.div_(scale[start:start + rows] if per_row else scale).clamp_(-FP8_MAX, FP8_MAX)
        out[start:start + rows] = part.to(FP8_DTYPE)
    return out, scale


def _scale_shape(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A scalar or per-row scale ((out,), (out, 1)) as a float32 () or (out, 1) that broadcasts over (out, in)."""
    scale = scale.detach().float()
    if scale.numel() not in (1, rows):
        raise ValueError(f"fp8 scale must be a scalar or one value per output row ({rows}), got shape {tuple(scale.shape)}")
    return scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())


def dequantize_weight(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) fp8 values times a scalar, (out,) or (out, 1) scale -> (out, in) in ``dtype``.

    Each weight is its fp8 value times its scale computed in float32 (as ComfyUI dequantizes) and
    rounded once to ``dtype``, straight into a ``dtype`` matrix: no float32 copy of a bf16 matrix.
    """
    from .bnb_packing import CHUNK_WEIGHTS

    scale = _scale_shape(scale, weight_fp8.shape[0]).to(weight_fp8.device).reshape(-1, 1)
    if weight_fp8.device.type != "cpu":
        # Off the CPU an in-place product of mixed dtypes is computed per element in the wider
        # one (a dimensioned float32 scale promotes), with no temporary of the matrix.
        return weight_fp8.to(dtype if dtype.itemsize < 4 else torch.float32).mul_(scale).to(dtype)
    # On the CPU fp8 casts are scalar code (~5 ns a weight, 10x a bf16 matmul's share of a weight at
    # 256 tokens) and mixed-dtype products go through float32 temporaries: instead each row's 256
    # possible weights are computed once and looked up (~0.5 ns a weight), row chunks at a time.
    codes = torch.arange(256, dtype=torch.uint8).view(weight_fp8.dtype).float()
    bits = weight_fp8.view(torch.uint8)
    out = torch.empty(weight_fp8.shape, dtype=dtype)
    step = max(1, CHUNK_WEIGHTS // max(1, weight_fp8.shape[1]))
    for start in range(0, weight_fp8.shape[0], step):
        rows = bits[start:start + step]
        tables = (scale[start:start + step] if scale.numel() > 1 else scale).mul(codes).to(dtype)
        index = rows.to(torch.int32)
        if tables.shape[0] > 1:  # row r's table starts at 256 r
            index += torch.arange(0, 256 * rows.shape[0], 256, dtype=torch.int32).unsqueeze(1)
        torch.index_select(tables.reshape(-1), 0, index.reshape(-1), out=out[start:start + step].view(-1))
    return out


def _chunk_weight(packed, scale, fp8_dtype, rows: slice, dtype, device) -> torch.Tensor:
    """Rows ``rows`` of the dequantized weight, (len(rows), in) in ``dtype`` on ``device``."""
    part = packed[rows].to(device).view(fp8_dtype)
    scale = scale if scale.numel() == 1 else scale.reshape(-1, 1)[rows]
    return dequantize_weight(part, scale, dtype)


class Fp8Linear(nn.Linear):
    """Linear layer over an fp8 weight (out, in) and a float32 scale (scalar or per output row).

    An ``nn.Linear`` subclass (like GGUF's ``PackedLinear``) so PEFT wraps it and LoRAs attach to it
    as to any linear layer. ``weight`` holds the fp8 values' bytes (uint8, (out, in)), so float-dtype
    casts (``module.to(bf16)``, PEFT matching a LoRA's dtype to its base layer's) cannot turn them
    into another format; :attr:`fp8_weight` views them as fp8. ``weight_scale`` is () or (out, 1).
    ``compute_dtype`` is the dtype the layer is meant to compute in (None: the input's); the
    forward always computes in the input's dtype. The weight, scale and bias are frozen.
    """

    def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a float weight
        if weight_fp8.dtype not in FP8_DTYPES or weight_fp8.ndim != 2:
            raise ValueError(f"Fp8Linear needs a 2-D float8 weight, got {weight_fp8.dtype} {tuple(weight_fp8.shape)}")
        self.out_features, self.in_features = weight_fp8.shape
        self.fp8_dtype = weight_fp8.dtype
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(weight_fp8.detach().view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale", _scale_shape(scale, self.out_features))
        if bias is not None:
            bias = bias.detach() if compute_dtype is None else bias.detach().to(compute_dtype)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype | None = None, per_row: bool = True) -> "Fp8Linear":
        """Quantize a float ``nn.Linear`` (a frozen LoRA base): per-row scale by default, per-tensor on request."""
        weight_fp8, scale = quantize_weight(linear.weight, per_row=per_row)
        return cls(weight_fp8, scale, linear.bias, compute_dtype)

    def reset_parameters(self) -> None:
        pass  # nn.Linear's initialiser would re-randomise the stored fp8 values: they are data

    @property
    def fp8_weight(self) -> torch.Tensor:
        """The stored weight (out, in) in its fp8 dtype."""
        return self.weight.view(self.fp8_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (out, in) as ``dtype`` (default: ``compute_dtype``, else float32): fp8 values times their scale."""
        return dequantize_weight(self.fp8_weight, self.weight_scale, dtype or self.compute_dtype or torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in x's dtype."""
        rows = partial(_chunk_weight, self.weight, self.weight_scale, self.fp8_dtype)
        return chunked_linear(x, rows, self.out_features, self.in_features, self.bias)

    def extra_repr(self) -> str:
        per = "row" if self.weight_scale.ndim else "tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-{per} scale"


def replace_linears_(model: nn.Module, scales: dict[str, torch.Tensor]) -> int:
    """Swap each ``nn.Linear`` named in ``scales`` (whose weight is already fp8, as loaded from a
    file) for an :class:`Fp8Linear` with that scale. Returns the number of layers replaced."""
    modules = dict(model.named_modules())
    for name, scale in scales.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"fp8 scale for {name!r}, which is not a Linear layer of {type(model).__name__}")
        if linear.weight.dtype not in FP8_DTYPES:
            raise ValueError(f"fp8 scale for {name!r}, whose weight is {linear.weight.dtype}, not float8")
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, Fp8Linear(linear.weight, scale, linear.bias))
    return len(scales)


def quantize_fp8_(module: nn.Module, keep: tuple[str, ...] = (), compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every plain ``nn.Linear`` of ``module`` (in place) by a per-row :class:`Fp8Linear`,
    except those whose name is or contains a ``keep`` entry; returns the number replaced."""
    from .bnb import keep_filter

    skip = keep_filter(keep)
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear and not skip(name)]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(child, compute_dtype))
    return len(targets)


def quantize_transformer_fp8_(transformer: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """fp8 for the Krea 2 transformer's block matrices; the precision-sensitive layers (image and
    text input projections, time embedders, text-fusion projector, final layer) stay as they are."""
    from .bnb import TRANSFORMER_KEEP

    return quantize_fp8_(transformer, TRANSFORMER_KEEP, compute_dtype)
