"""A linear layer whose weight stays GGML-packed in memory.

:class:`PackedLinear` subclasses :class:`torch.nn.Linear` so that everything that recognises a
linear layer by type keeps working on it: PEFT wraps it as a LoRA base layer (like a
bitsandbytes ``Linear4bit``: PEFT moves adapter weights to the base weight's device and, since
the base weight is not floating point, leaves their dtype alone), ``model.to(device)`` moves the
packed bytes, and ``model.to(dtype)`` leaves them alone (PyTorch only casts floating tensors).
The weight is expanded to the input's dtype ON THE INPUT'S DEVICE at every call and dropped right
after, so at most one layer's full-precision weight exists at a time. Packed bytes kept elsewhere
(CPU offload) travel to the input's device first: 2-4x fewer bytes than the expanded weight, and
the accelerator, not the CPU, does the expansion.

The matmul is :func:`..chunked_linear.chunked_linear`'s, as fp8's: on the CPU the weight is
expanded a few MiB of output rows at a time into memory the allocator reuses. Expanded whole, each
call's matrix was fresh memory (0.19 GiB in bf16 for a 16384 x 6144 MLP matrix), and faulting
its pages in cost more than the dequantization itself (bench/bench_dequant.py: its ``fresh pages``
rows, and PackedLinear's forward against the matmul alone). Backward re-expands the packed rows
instead of keeping the expanded weight for it.

Q4_0, Q4_1 and Q4_K layers called on the CPU with bf16 activations and no gradient to compute
(generation) run torch's fused int4 kernel instead (:mod:`.int4_layout`): the first such call
re-lays out the layer's bytes for it, in place and at the same size, and later calls never expand
the weight. The kernel's cost grows with the rows of ``x`` and expansion's does not, so on CPUs
with bf16 matmul units it is taken up to ``int4_layout.NATIVE_BF16_MAX_ROWS`` rows a call (a
128 px image's tokens), and always on CPUs that emulate bf16.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from gguf import GGMLQuantizationType

from ..chunked_linear import chunked_linear, row_chunks
from . import int4_layout
from .dequant import dequantize
from .qtypes import PACKED_TYPES, row_bytes


class PackedLinear(nn.Linear):
    """``y = x @ W.T + b`` with ``W`` stored as GGML blocks.

    Attributes:
        weight: uint8 ``(out_features, row_bytes)`` packed rows, ``requires_grad=False``.
        bias: float ``(out_features,)`` or None.
        qtype: the GGML type of ``weight``.
    """

    def __init__(self, in_features: int, out_features: int, qtype: GGMLQuantizationType, packed: torch.Tensor,
                 bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a float weight
        if qtype not in PACKED_TYPES:
            raise ValueError(f"PackedLinear cannot hold {qtype.name}; packed types: {sorted(q.name for q in PACKED_TYPES)}")
        expected = (out_features, row_bytes(qtype, in_features))
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
            raise ValueError(f"packed {qtype.name} weight must be uint8 {expected}, got {packed.dtype} {tuple(packed.shape)}")
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = qtype
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Set when the bytes are in the int4 layout: ``weight`` then holds the (out, in // 2) nibbles
        # in the kernel's order and this the blocks' headers; together the same bytes as before.
        self.register_buffer("int4_heads", None)

    @property
    def in_int4_layout(self) -> bool:
        return self.int4_heads is not None

    def use_int4_layout(self) -> bool:
        """Re-lay out the packed bytes for torch's CPU int4 kernel, in place (same size); False when
        this type or shape has no such layout or the bytes are not on the CPU."""
        if self.in_int4_layout:
            return True
        if self.weight.device.type != "cpu" or not int4_layout.supported(self.qtype, self.out_features, self.in_features):
            return False
        # Ordinary tensors even when the first call runs under inference_mode: the layer may train later.
        with torch.inference_mode(False), torch.no_grad():
            parts = [int4_layout.to_int4_layout(self.weight[rows], self.qtype, self.in_features)
                     for rows in self.row_slices(self.weight.device)]
            nibbles, heads = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        self.weight = nn.Parameter(nibbles, requires_grad=False)
        self.int4_heads = heads
        return True

    def row_slices(self, device: torch.device) -> list[slice]:
        return row_chunks(self.out_features, self.in_features, device, int4_layout.ROW_BLOCK)

    def takes_int4_kernel(self, x: torch.Tensor) -> bool:
        """Whether this call runs torch's int4 kernel (converting the layout on the first one)."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or self.weight.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and x.requires_grad:
            return False  # the kernel has no backward
        limit = int4_layout.row_limit()
        if limit is not None and x.numel() // self.in_features > limit:
            return False
        if torch.compiler.is_compiling():
            return self.in_int4_layout  # never swap parameters inside a traced graph
        return self.use_int4_layout()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full ``(out_features, in_features)`` weight in ``dtype``, on the packed bytes' device."""
        return self.weight_rows(slice(0, self.out_features), dtype, self.weight.device)

    def packed_on(self, device: torch.device) -> torch.Tensor:
        """The packed bytes on ``device`` (the stored tensor itself when it is already there)."""
        if self.weight.device == device:
            return self.weight
        return self.weight.to(device, non_blocking=self.weight.is_pinned())

    def weight_rows(self, rows: slice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rows ``rows`` of the weight, ``(len(rows), in_features)`` in ``dtype``, expanded on ``device``."""
        if self.in_int4_layout:
            heads = self.int4_heads.to(device)
            packed = int4_layout.ggml_rows(self.packed_on(device), heads, self.qtype, self.in_features, rows)
        else:
            packed = self.packed_on(device)[rows]
        return dequantize(packed, self.qtype, (packed.shape[0], self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(..., in_features)`` float -> ``(..., out_features)`` in ``x.dtype``."""
        if self.takes_int4_kernel(x):
            table = int4_layout.scales_and_zeros(self.int4_heads, self.qtype, self.in_features)
            out = int4_layout.int4_matmul(x, self.weight, table)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        multiple = int4_layout.ROW_BLOCK if self.in_int4_layout else 1
        return chunked_linear(x, self.weight_rows, self.out_features, self.in_features, self.bias, multiple)

    def reset_parameters(self) -> None:
        # nn.Linear's initialiser would try to re-randomise the packed bytes; they are data, not parameters to init.
        pass

    def extra_repr(self) -> str:
        layout = ", layout=int4" if self.in_int4_layout else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, qtype={self.qtype.name}{layout}"


def resident_bytes(module: nn.Module) -> int:
    """Resident bytes of all parameters and buffers of ``module`` (packed or not), with the scales
    bitsandbytes keeps beside a packed weight (NF4's ``quant_state.absmax``, int8's ``SCB``)."""
    tensors = list(module.parameters()) + list(module.buffers())
    for param in module.parameters():
        state = getattr(param, "quant_state", None)
        nested = getattr(state, "state2", None)  # NF4's absmax is itself quantized (compress_statistics)
        tensors += [getattr(state, "absmax", None), getattr(nested, "absmax", None), getattr(param, "SCB", None)]
    for layer in module.modules():  # int8 layers move SCB into their state after the first forward
        tensors.append(getattr(getattr(layer, "state", None), "SCB", None))
    unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values())
