"""``x @ W.T + bias`` over a frozen packed weight that is dequantized a slice of output rows at a
time on the CPU: the one matmul of the fp8, GGUF and NF4 layers and of the int8 layers while training on the CPU.

A whole dequantized matrix is a fresh ~0.56-0.75 GiB float32 mmap per call for the 12.8B model's
MLP matrices, beyond the host plan, and the kernel zeroing those pages took more CPU time than the
matmuls at 128 px. Chunks of ~``CHUNK_WEIGHTS`` weights (a few MiB) are reused from the heap. On a
GPU the whole matrix is one chunk (its plan counts it). Backward expands the packed weight again
(through ``weight_rows``), except inside :func:`expanded_weights_kept` on the CPU, where the
forward's expanded chunks are saved for it: checkpointed training blocks (finetune.engine.parallel)
keep one block's expanded weights from its recompute to its backward instead of expanding every
weight a third time in a step (a full-size fp8 LoRA step spent ~45 s per expansion pass).

Numerics: weights are dequantized into the input's dtype (bf16 activations compute in bf16). Each
output chunk is one ``F.linear``, so the forward is the one-piece ``F.linear``'s; backward's input
gradient sums one term per chunk, in float32 (float64 for float64) rounded once at the end.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

WeightRows = Callable[[slice, torch.dtype, torch.device], torch.Tensor]
"""``weight_rows(rows, dtype, device)``: rows ``rows`` of the dequantized weight, (len(rows), in)."""


def row_chunks(out_features: int, in_features: int, device: torch.device, row_multiple: int = 1) -> list[slice]:
    """Output-row slices of ~``CHUNK_WEIGHTS`` weights on the CPU (each a multiple of
    ``row_multiple`` rows but the last), else one slice."""
    from .bnb_packing import CHUNK_WEIGHTS

    step = max(1, CHUNK_WEIGHTS // max(1, in_features)) // row_multiple * row_multiple
    step = out_features if device.type != "cpu" else max(row_multiple, step)
    return [slice(start, start + step) for start in range(0, out_features, step)]


_KEEP_EXPANDED = contextvars.ContextVar("krea2_keep_expanded_weights", default=False)


@contextlib.contextmanager
def expanded_weights_kept() -> Iterator[None]:
    """Inside: a CPU forward whose input needs a gradient saves its expanded weight chunks for the
    backward, which then does not expand them again. Meant for activation-checkpointed blocks only:
    their first forward's saved tensors are dropped by the checkpoint, and the recompute's live
    until that block's backward, one block at a time. Elsewhere every layer of the model would hold
    its expanded weight until the backward."""
    token = _KEEP_EXPANDED.set(True)
    try:
        yield
    finally:
        _KEEP_EXPANDED.reset(token)


class _ChunkedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, weight_rows, out_features, in_features, row_multiple):
        ctx.weight_rows, ctx.shape, ctx.row_multiple = weight_rows, (out_features, in_features), row_multiple
        bias = None if bias is None else bias.to(device=x.device, dtype=x.dtype)
        keep = _KEEP_EXPANDED.get() and x.device.type == "cpu" and ctx.needs_input_grad[0]
        parts, kept = [], []
        for rows in row_chunks(out_features, in_features, x.device, row_multiple):
            weight = weight_rows(rows, x.dtype, x.device)
            parts.append(F.linear(x, weight, None if bias is None else bias[rows]))
            if keep:
                kept.append(weight)
        ctx.save_for_backward(*kept)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            # grad_x = grad_out @ W, summed over the row chunks of W (one term off the CPU). The sum
            # is kept in float32 (float64 stays float64) and rounded once: added up in bf16, the
            # ~48 terms of a 16384-wide matrix each rounded the running sum, and the gradient was
            # 0.87% off one F.linear's (itself 0.17% off float64); now ~1.4x that F.linear's error.
            chunks = row_chunks(*ctx.shape, grad_out.device, ctx.row_multiple)
            kept = ctx.saved_tensors
            wide = torch.promote_types(grad_out.dtype, torch.float32)
            for n, rows in enumerate(chunks):
                weight = kept[n] if kept else ctx.weight_rows(rows, grad_out.dtype, grad_out.device)
                term = grad_out[..., rows] @ weight.to(grad_out.dtype)
                if len(chunks) == 1:
                    grad_x = term
                elif grad_x is None:
                    grad_x = term.to(wide, copy=True)
                else:
                    grad_x.add_(term)
            grad_x = grad_x.to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None, None, None


def chunked_linear(x: torch.Tensor, weight_rows: WeightRows, out_features: int, in_features: int,
                   bias: torch.Tensor | None = None, row_multiple: int = 1) -> torch.Tensor:
    """x (..., in) -> (..., out) in x's dtype: ``x @ W.T + bias`` with W given by ``weight_rows``,
    asked for in slices of a multiple of ``row_multiple`` rows (the packing's blocks)."""
    return _ChunkedMatmul.apply(x, bias, weight_rows, out_features, in_features, row_multiple)
