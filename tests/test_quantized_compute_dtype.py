"""Quantized layers compute in the input's dtype: a bf16 input gives a bf16 output computed from
weights dequantized straight into bf16 (fp8 and int8 row chunks, GGUF blocks, NF4), with no float32
copy of the matrix (or, for the row-chunked layers, of a row chunk)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from torch.utils._python_dispatch import TorchDispatchMode

from krea2_diffusers.quantization import bnb_packing
from krea2_diffusers.quantization.fp8 import Fp8Linear, dequantize_weight
from krea2_diffusers.quantization.gguf import PackedLinear, quantize

Q = GGMLQuantizationType
U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)
OUT, IN, CHUNK_ROWS = 45, 512, 4  # 12 row chunks of 4 x 512 weights (a short last one)


class WideTensors(TorchDispatchMode):
    """Records the element count of every float32 / float64 tensor an op returns (the matrix-sized
    temporaries a layer would make; kernel-internal scratch is not seen)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64):
                self.sizes.append(t.numel())
        return out


def check_bf16_forward(layer, exact_weight: torch.Tensor, bias: torch.Tensor | None, largest_wide: int,
                       requires_grad: bool = False) -> torch.Tensor:
    """``layer(x_bf16)`` is bf16, within the bf16 bound of ``F.linear(x, exact_weight.to(bf16), bias)``,
    and makes no float32/float64 tensor of ``largest_wide`` elements or more. Returns the output.

    Bound, per output element, with M = |x| @ |W|.T + |b| (float64): the layer's weights are the
    exact ones after at most 3 bf16 roundings of the dequantization arithmetic, the reference's
    after 1 (<= 4u|W| apart); each side rounds its output once (<= u M each); the float32 sums
    differ by at most K 2^-24 M = 2^-15 M for K = 512. Total <= 6u M + 2^-15 M < 7u M."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, IN, generator=generator).to(torch.bfloat16).requires_grad_(requires_grad)
    with WideTensors() as wide:
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, OUT)
    assert max(wide.sizes) < largest_wide, (max(wide.sizes), largest_wide)
    bias64 = torch.zeros(OUT, dtype=torch.float64) if bias is None else bias.to(torch.bfloat16).double()
    reference = x.detach().double() @ exact_weight.to(torch.bfloat16).double().T + bias64
    magnitude = x.detach().double().abs() @ exact_weight.double().abs().T + bias64.abs()
    assert ((out.detach().double() - reference).abs() <= 7 * U * magnitude).all()
    return out


def test_fp8_dequantizes_row_chunks_straight_into_bf16(monkeypatch):
    """Each weight is fp8 value x scale rounded once to bf16, with no float32 row chunk (the
    layer made one per chunk before: (4, 512) float32 products)."""
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", CHUNK_ROWS * IN)
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(IN, OUT))
    exact = (layer.fp8_weight.float() * layer.weight_scale).double()  # float32 products, as ComfyUI's
    check_bf16_forward(layer, exact, layer.bias, CHUNK_ROWS * IN)
    # and the one-rounding claim, element by element: the float32 products rounded to bf16
    assert torch.equal(dequantize_weight(layer.fp8_weight, layer.weight_scale, torch.bfloat16), exact.to(torch.bfloat16))
    per_tensor = dequantize_weight(layer.fp8_weight, torch.tensor(0.0123), torch.bfloat16)
    assert torch.equal(per_tensor, (layer.fp8_weight.float() * torch.tensor(0.0123)).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_gguf_dequantizes_into_bf16(qtype, monkeypatch):
    """The packed weight is expanded into bf16 through a float32 scratch of a few blocks (the values
    are gguf-py's float32 decoding, rounded once): no float32 tensor of the matrix's size."""
    from krea2_diffusers.quantization.gguf import dequant

    monkeypatch.setattr(dequant, "CHUNK_VALUES", 4 * 256)
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((OUT, IN)) * 0.05).astype(np.float32)
    packed = torch.from_numpy(np.ascontiguousarray(quantize(weight, qtype)))  # gguf-py quantizes no K-type
    exact = torch.from_numpy(gguf_quants.dequantize(packed.numpy(), qtype)).double()
    bias = torch.from_numpy(rng.standard_normal(OUT).astype(np.float32))
    layer = PackedLinear(IN, OUT, qtype, packed, bias=bias)
    check_bf16_forward(layer, exact, bias, OUT * IN // 2)


def test_int8_training_rows_dequantize_into_bf16(monkeypatch):
    """An int8 LoRA base training on the CPU: bf16 activations, bf16 row chunks (codes x SCB / 127),
    no float32 chunk, and a bf16 input gradient."""
    pytest.importorskip("bitsandbytes")
    from krea2_diffusers.quantization.bnb import quantize_linears_

    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", CHUNK_ROWS * IN)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    quantize_linears_(model, "int8", compute_dtype=torch.bfloat16)
    layer = model[0].train()
    exact = layer.weight.CB.double() * layer.weight.SCB.double().unsqueeze(1) / 127
    out = check_bf16_forward(layer, exact, layer.bias, CHUNK_ROWS * IN, requires_grad=True)
    out.float().square().sum().backward()
    assert layer.weight.grad is None


def test_nf4_computes_in_bf16():
    """bitsandbytes' NF4 layer computes in its ``compute_dtype`` (ours: the load's torch_dtype), here
    bf16: its CPU dequantization writes bf16 directly."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_functional

    from krea2_diffusers.quantization.bnb import quantize_linears_

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    quantize_linears_(model, "nf4", compute_dtype=torch.bfloat16)
    layer = model[0].eval()
    exact = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).double()  # float32 decoding
    with torch.no_grad():
        check_bf16_forward(layer, exact, layer.bias, OUT * IN // 2)
