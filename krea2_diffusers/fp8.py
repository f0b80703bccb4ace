"""float8 (e4m3) weight storage with a per-row scale, for frozen linear layers (a LoRA base).

An unscaled cast to e4m3 clips large weights at 448 and flushes small rows toward the format's
coarse low end; scaling each output row by its own absolute maximum uses the full range of the
format for every row. Storage: 1 byte per weight + one float32 per row.

The matmul is an autograd function that saves the *packed* weight for the backward pass and
re-expands it there, so training keeps one byte per frozen weight resident instead of the
compute-dtype copy ``F.linear`` would save for every layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A row of zeros keeps scale 1 (any scale reproduces it); avoids a division by zero.
_MIN_AMAX = 1e-12


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (out, in) e4m3 values and (out,) float32 scales, weight ~= q * scale."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp(min=_MIN_AMAX)
    scale = amax / FP8_MAX
    return (w / scale[:, None]).to(FP8_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q, scale, bias):
        weight = dequantize_rows(q, scale, x.dtype)
        ctx.save_for_backward(q, scale)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        q, scale = ctx.saved_tensors
        grad_x = grad_out @ dequantize_rows(q, scale, grad_out.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class Fp8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is stored as e4m3 with a float32 scale per output row.

    Subclasses ``nn.Linear`` so PEFT wraps it like any linear layer; ``compute_dtype`` tells PEFT
    (and readers) the dtype the layer computes in. The weight and scale are frozen.
    """

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a float weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype

    def reset_parameters(self) -> None:
        pass  # the stored values are data, not an initialisation

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8Matmul.apply(x, self.weight, self.weight_scale, self.bias)


def quantize_fp8_(module: nn.Module, keep: tuple[str, ...] = (), compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every plain ``nn.Linear`` of ``module`` (in place) by :class:`Fp8Linear`, except
    those whose name is or contains a ``keep`` entry; returns the number replaced."""
    from .bnb import _skipper

    skip = _skipper(keep)
    targets = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear and not skip(name)]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear(child, compute_dtype))
    return len(targets)


def quantize_transformer_fp8_(transformer: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """fp8 for the Krea 2 transformer's block matrices; the precision-sensitive layers (image and
    text input projections, time embedders, text-fusion projector, final layer) stay as they are."""
    from .bnb import TRANSFORMER_KEEP

    return quantize_fp8_(transformer, TRANSFORMER_KEEP, compute_dtype)
