"""The one fp8 linear layer for both uses: quantized from a float layer (per-row, a LoRA base) and
built from stored fp8 + scale (ComfyUI's per-tensor files); the backward saves only the packed bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from krea2_diffusers.quantization.fp8 import FP8_MAX, Fp8Linear, dequantize_weight, quantize_transformer_fp8_
from krea2_diffusers.models.tiny import tiny_components


def linear(out=6, inp=5, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out)
    with torch.no_grad():
        layer.weight[0] *= 100  # one large row: a per-tensor scale would flush the others
        layer.weight[1] *= 1e-3
    return layer


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_every_fp8_code_dequantizes_as_torchs_own_cast(fp8_dtype):
    """The CPU expansion (each row's 256 possible values, looked up) against torch's own fp8 cast,
    the oracle any faster expansion must match: all 256 codes (zeros, subnormals, the largest,
    e5m2's infinities, NaNs) in every row, times per-row scales from tiny to large and a scalar,
    in bf16, fp16 and float32, against the cast times the scale in float32 rounded once, to the
    bit (NaN where it is NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    rows = torch.stack([codes.roll(r) for r in range(7)]).view(fp8_dtype)  # (7, 256): each code in each row
    scales = torch.tensor([1.0, 3e-3, 0.0123, 7.7, 1e-30, 2.0 ** -126, 1e4])
    for scale in (scales, scales.reshape(-1, 1), torch.tensor(0.0123)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = dequantize_weight(rows, scale, dtype)
            want = (rows.float() * scale.reshape(-1, 1)).to(dtype)
            assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan()), (dtype, scale.shape)
            assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (dtype, scale.shape)


@pytest.mark.parametrize("per_row", [True, False])
def test_from_linear_matches_its_dequantized_weight(per_row):
    dense = linear()
    layer = Fp8Linear.from_linear(dense, torch.float32, per_row=per_row)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.shape == ((6, 1) if per_row else ())
    # fp8 values times scale (in float32, as ComfyUI dequantizes), computed here independently of the layer's helpers
    expected = (layer.weight.view(torch.float8_e4m3fn).float() * layer.weight_scale).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, expected, dense.bias.double()))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each row's (or the tensor's) largest value
    amax = dense.weight.abs().amax(1, keepdim=True) if per_row else dense.weight.abs().amax()
    assert ((expected.float() - dense.weight).abs() <= amax / 16 + 1e-12).all()
    if per_row:  # the small row keeps its precision only with a per-row scale
        assert (expected[1].float() - dense.weight[1]).abs().max() <= dense.weight[1].abs().max() / 16


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_quantizer_gives_the_whole_matrix_bytes(monkeypatch, per_row, dtype):
    """Row chunks (several, a short last one) give the bytes of the one-piece expression."""
    from krea2_diffusers.quantization import bnb_packing
    from krea2_diffusers.quantization.fp8 import quantize_weight

    torch.manual_seed(1)
    weight = (torch.randn(45, 96) * torch.logspace(-4, 3, 45).unsqueeze(1)).to(dtype)
    weight[7] = 0  # an all-zero row keeps the tiny scale
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax()
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    expected = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 96 * 4)  # 4 rows a chunk, 12 chunks
    before = weight.clone()
    values, got_scale = quantize_weight(weight, per_row=per_row)
    assert torch.equal(weight, before)  # the float32 input is not divided in place
    assert torch.equal(got_scale, scale)
    assert torch.equal(values.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("per_row", [True, False])
def test_cpu_row_chunks_give_the_one_piece_forward_and_backward(monkeypatch, per_row):
    """On the CPU the layer computes in output-row chunks (several, a short last one): the output
    and both gradients equal the dense float64 computation to float64 rounding."""
    from krea2_diffusers.quantization import bnb_packing

    torch.manual_seed(2)
    dense = nn.Linear(16, 45)
    layer = Fp8Linear.from_linear(dense, torch.float64, per_row=per_row)
    weight = layer.dequantized_weight(torch.float64).detach()  # one piece (float32 products, as the layer)
    bias = layer.bias.detach().double().requires_grad_(True)
    layer.bias = nn.Parameter(bias.detach().clone())
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 16 * 4)  # 4 rows a chunk: 12 chunks
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    reference_x = x.detach().clone().requires_grad_(True)
    reference = F.linear(reference_x, weight, bias)
    torch.testing.assert_close(out, reference, rtol=1e-13, atol=1e-13)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(layer.bias.grad, bias.grad, rtol=1e-13, atol=1e-13)


def test_stored_fp8_and_scale_per_row_or_per_tensor():
    weight = (torch.randn(4, 3) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    for scale in (torch.tensor(0.5), torch.rand(4) + 0.1, torch.rand(4, 1) + 0.1):
        layer = Fp8Linear(weight, scale)
        x = torch.randn(2, 3, dtype=torch.float64)
        torch.testing.assert_close(layer(x), x @ (weight.float() * scale.reshape(-1, 1)).double().T)
    with pytest.raises(ValueError, match="one value per output row"):
        Fp8Linear(weight, torch.ones(3))


def test_backward_saves_only_the_packed_weight_and_gives_the_dense_gradient():
    dense = linear()
    layer = Fp8Linear.from_linear(dense, torch.float32)
    x = torch.randn(7, 5, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert not [t for t in saved if t.is_floating_point() and t.shape == (6, 5)]  # no expanded weight kept
    y.square().sum().backward()
    reference = x.detach().clone().requires_grad_(True)
    F.linear(reference, layer.dequantized_weight(torch.float32), layer.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)
    assert layer.weight.grad is None


def test_dtype_casts_leave_the_fp8_bytes_alone():
    layer = Fp8Linear.from_linear(linear(), torch.bfloat16)
    before = layer.weight.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.weight, before) and layer.bias.dtype == torch.bfloat16
    assert layer(torch.randn(2, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_transformer_blocks_quantized_precision_sensitive_layers_kept():
    transformer = tiny_components()["transformer"]
    replaced = quantize_transformer_fp8_(transformer, torch.float32)
    assert replaced > 0
    assert isinstance(transformer.transformer_blocks[0].ff.up, Fp8Linear)
    assert type(transformer.img_in) is nn.Linear


def test_lora_trains_on_an_fp8_base():
    """finetune's ``model.quantize: fp8`` path: PEFT wraps the fp8 layers, only the LoRA gets gradients."""
    from finetune.config import LoRAConfig
    from finetune.methods import add_lora, quantize_base

    transformer = tiny_components()["transformer"]
    assert quantize_base(transformer, "fp8", torch.float32) > 0
    params = add_lora(transformer, LoRAConfig(rank=4, alpha=4))
    layer = transformer.transformer_blocks[0].ff.up
    assert isinstance(layer.base_layer, Fp8Linear) and layer.base_layer.weight.dtype == torch.uint8
    assert all(p.dtype == torch.float32 for p in params)  # LoRA weights in fp32 over the fp8 base
    x = torch.randn(2, 3, layer.in_features)
    with torch.no_grad():  # B starts at 0: the adapted layer equals its fp8 base
        torch.testing.assert_close(layer(x), layer.base_layer(x))
    layer(x).square().sum().backward()
    lora_b = [p for n, p in layer.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    assert layer.base_layer.weight.grad is None and not layer.base_layer.weight.requires_grad
