"""A Linear layer whose weight stays in float8 with its scale, computed in a higher precision.

``Fp8Linear(weight_fp8, scale, bias)``: ``y = x @ (weight_fp8 * scale).T + bias``, the weight
dequantized per call in the input's dtype (bf16 in practice), so a model keeps fp8's memory (one
byte per weight) with bf16 arithmetic. ``scale`` is a scalar (per-tensor, ComfyUI's
``float8_e4m3fn`` format) or one value per output row (out_features,) / (out_features, 1).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class Fp8Linear(nn.Linear):
    """Linear layer over an fp8 weight (out, in) and a float32 scale (scalar or per row).

    An ``nn.Linear`` subclass (like GGUF's ``PackedLinear``) so LoRAs attach to it as to any linear layer.
    ``weight`` holds the fp8 values' bytes (uint8, (out, in)); :attr:`fp8_weight` views them as fp8.
    """

    def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a float weight
        if weight_fp8.dtype not in FP8_DTYPES or weight_fp8.ndim != 2:
            raise ValueError(f"Fp8Linear needs a 2-D float8 weight, got {weight_fp8.dtype} {tuple(weight_fp8.shape)}")
        scale = scale.detach().float()
        if scale.numel() not in (1, weight_fp8.shape[0]):
            raise ValueError(f"Fp8Linear scale must be a scalar or one value per output row ({weight_fp8.shape[0]}), "
                             f"got shape {tuple(scale.shape)}")
        self.out_features, self.in_features = weight_fp8.shape
        # Held as its raw bytes (uint8): float-dtype casts (``module.to(bf16)``, PEFT matching a LoRA's
        # dtype to its base layer's) must not turn the fp8 values into another format.
        self.fp8_dtype = weight_fp8.dtype
        self.weight = nn.Parameter(weight_fp8.detach().view(torch.uint8), requires_grad=False)
        # (1, 1) or (out, 1): broadcasts over the weight's rows either way.
        self.register_buffer("weight_scale", scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``dtype`` (out, in): fp8 values times their scale."""
        return (self.fp8_weight.to(torch.float32) * self.weight_scale).to(dtype)

    @property
    def fp8_weight(self) -> torch.Tensor:
        """The stored weight (out, in) in its fp8 dtype."""
        return self.weight.view(self.fp8_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in x's dtype."""
        bias = None if self.bias is None else self.bias.to(device=x.device, dtype=x.dtype)
        return nn.functional.linear(x, self.dequantized_weight(x.dtype).to(x.device), bias)

    def reset_parameters(self) -> None:
        # nn.Linear's initialiser would re-randomise the stored fp8 values: they are data.
        pass

    def extra_repr(self) -> str:
        per = "row" if self.weight_scale.ndim else "tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per-{per} scale"


def replace_linears_(model: nn.Module, scales: dict[str, torch.Tensor]) -> int:
    """Swap each ``nn.Linear`` named in ``scales`` (whose weight is already fp8) for an :class:`Fp8Linear`.

    Returns the number of layers replaced.
    """
    modules = dict(model.named_modules())
    for name, scale in scales.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"fp8 scale for {name!r}, which is not a Linear layer of {type(model).__name__}")
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        if linear.weight.dtype not in FP8_DTYPES:
            raise ValueError(f"fp8 scale for {name!r}, whose weight is {linear.weight.dtype}, not float8")
        setattr(parent, child, Fp8Linear(linear.weight, scale, linear.bias))
    return len(scales)
