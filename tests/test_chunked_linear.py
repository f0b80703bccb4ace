"""The row-chunked matmul over a packed weight (quantization.chunked_linear), on its own: the
numerics of the chunk sums in bf16 at the released model's largest shape."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from krea2_diffusers.quantization.chunked_linear import chunked_linear, row_chunks

# The released 12.8B model's MLP down projection: (out, in) = (6144, 16384).
OUT_FEATURES, IN_FEATURES = 6144, 16384


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


def test_bf16_input_gradient_is_summed_over_the_chunks_in_float32():
    """In bf16 at the released shape (48 row chunks on the CPU), the chunked backward's input
    gradient is as close to float64 as one ``F.linear`` backward's.

    Bound: F.linear's GEMM accumulates in float32 and rounds each gradient entry once to bf16
    (relative rms ~ u/sqrt(3), u = 2^-8). The chunked sum rounds each of its 48 terms once (the
    terms have random signs: their rounding errors add up to the same ~u/sqrt(3) of the sum) and
    the float32 total once more: ~sqrt(2) x F.linear's error, so 2x bounds it with room. Summed
    in bf16, every one of the 47 additions rounded the running sum: ~5x F.linear's (0.87% vs
    0.17% measured), so the bound fails on that code. Norms over 8 x 16384 entries: the ratio
    of two such errors varies by well under 1% between random draws (8 x 16384 entries: under 2%,
    against the 2x margin; 8 rows instead of 32 keep the emulated bf16 products of CPUs without
    AVX512-BF16 cheap)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator, dtype=torch.bfloat16)
    assert len(row_chunks(OUT_FEATURES, IN_FEATURES, torch.device("cpu"))) == 48

    def weight_rows(rows: slice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return weight[rows].to(device=device, dtype=dtype)  # a stand-in packed weight: only the sums are tested

    x = torch.randn(8, IN_FEATURES, generator=generator, dtype=torch.bfloat16).requires_grad_(True)
    bias = torch.randn(OUT_FEATURES, generator=generator, dtype=torch.bfloat16)
    grad = torch.randn(8, OUT_FEATURES, generator=generator, dtype=torch.bfloat16)
    out = chunked_linear(x, weight_rows, OUT_FEATURES, IN_FEATURES, bias)
    out.backward(grad)
    one_piece_x = x.detach().clone().requires_grad_(True)
    one_piece = F.linear(one_piece_x, weight, bias)
    one_piece.backward(grad)
    assert out.dtype == x.grad.dtype == torch.bfloat16

    # float64 references, a row chunk at a time (a float64 copy of the whole weight is 0.8 GB)
    reference_out = torch.empty(8, OUT_FEATURES, dtype=torch.float64)
    reference_grad = torch.zeros(8, IN_FEATURES, dtype=torch.float64)
    for start in range(0, OUT_FEATURES, 1024):
        part = weight[start:start + 1024].double()
        reference_out[:, start:start + 1024] = x.detach().double() @ part.T + bias[start:start + 1024].double()
        reference_grad += grad[:, start:start + 1024].double() @ part

    grad_error, one_piece_grad_error = relative_error(x.grad, reference_grad), relative_error(one_piece_x.grad, reference_grad)
    assert one_piece_grad_error < 2 ** -8  # F.linear's own bf16 error: one rounding of each entry
    assert grad_error <= 2 * one_piece_grad_error, (grad_error, one_piece_grad_error)
    # the forward: each output chunk is one F.linear (bias included), the same sums as in one piece
    assert relative_error(out, reference_out) <= 2 * relative_error(one_piece, reference_out)


def test_float64_input_gradient_stays_float64(monkeypatch):
    """The accumulator is float64 for float64 inputs: 12 chunks match one product to float64
    rounding (a float32 sum would be ~1e-7 off)."""
    from krea2_diffusers.quantization import bnb_packing

    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 16 * 4)  # 4 rows a chunk, a short last one
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(45, 16, generator=generator, dtype=torch.float64)
    x = torch.randn(3, 5, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    assert len(row_chunks(45, 16, x.device)) == 12
    grad = torch.randn(3, 5, 45, generator=generator, dtype=torch.float64)
    chunked_linear(x, lambda rows, dtype, device: weight[rows].to(dtype), 45, 16).backward(grad)
    assert x.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad, grad @ weight, rtol=1e-13, atol=1e-13)


def test_checkpointed_blocks_keep_the_recomputes_expanded_weights_for_their_backward(monkeypatch):
    """Training blocks under activation checkpointing (finetune.engine.parallel) expand each quantized
    weight twice a step (the forward, the recompute) instead of three times (also the backward): the
    recompute's chunks are saved for that block's backward (issue 42). The gradients are the same to
    the bit, since the saved chunks are the values the backward would expand again; and without
    checkpointing (``expanded_weights_kept`` not entered) nothing is kept."""
    from functools import partial

    from finetune.engine.parallel import apply_activation_checkpointing
    from krea2_diffusers.quantization import bnb_packing

    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 16 * 3)  # 3 rows a chunk: several chunks a layer
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(16, 16, generator=generator, dtype=torch.float64) for _ in range(4)]
    calls = []

    def weight_rows(n: int, rows: slice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls.append(n)
        return weights[n][rows].to(device=device, dtype=dtype)

    class Block(torch.nn.Module):
        def __init__(self, first: int):
            super().__init__()
            self.first = first
            self.lora = torch.nn.Linear(16, 16, dtype=torch.float64)  # a trained part, so inputs need gradients

        def forward(self, x):
            x = self.lora(x)
            for n in (self.first, self.first + 1):
                x = torch.tanh(chunked_linear(x, partial(weight_rows, n), 16, 16))
            return x

    def step(checkpointed: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        blocks = [Block(0), Block(2)]
        if checkpointed:
            apply_activation_checkpointing(blocks, "full")
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        for block in blocks:
            x = block(x)
        calls.clear()
        x.square().sum().backward()
        return tuple(p.grad for block in blocks for p in block.parameters())

    import contextlib

    from krea2_diffusers.quantization import chunked_linear as module

    chunks = len(row_chunks(16, 16, torch.device("cpu")))
    assert chunks == 6
    plain = step(checkpointed=False)
    assert len(calls) == 4 * chunks  # no recompute; the backward expands every chunk again
    kept = step(checkpointed=True)
    assert len(calls) == 4 * chunks  # the recompute expands once and keeps; the backward expands nothing
    with monkeypatch.context() as patch:
        patch.setattr(module, "expanded_weights_kept", contextlib.nullcontext)
        recomputed = step(checkpointed=True)
    assert len(calls) == 8 * chunks  # the recompute and the backward each expand
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, kept, recomputed))
