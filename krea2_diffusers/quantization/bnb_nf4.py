"""bitsandbytes' NF4 layer, computing on the CPU in output-row chunks.

bitsandbytes' CPU path (``gemm_4bit``, and its backward) dequantizes the whole matrix at every call:
a fresh 75-201 MiB bf16 matrix for each of the 12.8B model's block matrices, above glibc's 32 MiB
mmap threshold, so every call maps new pages and the kernel zeroes them. A full-size LoRA step at
128 px faulted in 17 million pages (~70 GB) that way: 40 of its 107 CPU seconds were system time
(bench/full_size.py's ``step_split``). Row chunks of a few MiB (:mod:`.chunked_linear`, as the fp8
and int8 layers compute) come from the heap and are reused.

Each chunk goes through the same bitsandbytes operators on a slice (the nested absmax codes through
``dequantize_blockwise``, plus the offset, then ``dequantize_4bit`` into the input's dtype), so every
weight is the value bitsandbytes' own ``gemm_4bit`` multiplies by. Slices start on a boundary of the
absmax's own 256-block quantization (rows x in a multiple of 64 x 256), so no block is cut.
Imported only once bitsandbytes is known to be importable (:mod:`.bnb` checks it first).
"""

from __future__ import annotations

import math
from functools import partial

import bitsandbytes as bnb
import torch

from .chunked_linear import chunked_linear


def row_multiple(quant_state, in_features: int) -> int | None:
    """Rows a chunk must be a multiple of so that it starts on a whole 4-bit block and, for a nested
    state, a whole block of the absmax's own quantization; None when a row is not a whole number of
    4-bit blocks (the whole matrix is then one chunk)."""
    if in_features % quant_state.blocksize or in_features % 2:
        return None
    values = quant_state.blocksize * (quant_state.state2.blocksize if quant_state.nested else 1)
    return values // math.gcd(values, in_features)


def nf4_rows(packed: torch.Tensor, quant_state, rows: slice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows ``rows`` of the dequantized weight, (len(rows), in) in ``dtype``: bitsandbytes' CPU
    ``gemm_4bit`` expansion (nested absmax, then the 4-bit codes) on the slice."""
    out_features, in_features = quant_state.shape
    start, stop = rows.start, min(rows.stop, out_features)
    blocksize = quant_state.blocksize
    first, last = start * in_features // blocksize, stop * in_features // blocksize
    absmax = quant_state.absmax[first:last]
    if quant_state.nested:
        state2 = quant_state.state2
        scales = state2.absmax[first // state2.blocksize:-(-last // state2.blocksize)]
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax, scales, state2.code, state2.blocksize,
                                                                     torch.float32) + quant_state.offset
    codes = packed.reshape(-1)[start * in_features // 2:stop * in_features // 2]
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(codes, absmax, blocksize, quant_state.quant_type,
                                                            (stop - start, in_features), dtype)
    return weight.to(device)


class Nf4Linear(bnb.nn.Linear4bit):
    """``bnb.nn.Linear4bit`` (so PEFT wraps it as one, and it saves and loads as one) whose CPU
    forward and backward expand the weight in output-row chunks (:func:`nf4_rows`) instead of whole.
    Other devices keep bitsandbytes' kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in x's dtype (computed in ``compute_dtype`` when set)."""
        state = self.weight.quant_state
        multiple = row_multiple(state, self.in_features)
        if x.device.type != "cpu" or multiple is None or len(state.shape) != 2:
            return super().forward(x)
        bnb.nn.modules.fix_4bit_weight_quant_state_from_module(self)
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = partial(nf4_rows, self.weight.data, state)
        return chunked_linear(x, rows, self.out_features, self.in_features, bias, row_multiple=multiple).to(inp_dtype)
