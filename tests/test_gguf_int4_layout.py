"""4-bit GGUF layers on torch's CPU int4 kernel: the layout is torch's own and loses no byte, the
kernel's output is as close to exact as a bf16 matmul of the file's weights, and every other path
(float32, gradients, rows past the limit) gives what it gave before the layout changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from krea2_diffusers.quantization.gguf import PackedLinear
from krea2_diffusers.quantization.gguf import int4_layout
from krea2_diffusers.quantization.gguf.quantizer import quantize

Q = GGMLQuantizationType
OUT, IN = 192, 512  # three 64-row blocks of torch's layout, two Q4_K super-blocks a row


def ggml_bytes(qtype, seed=0):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((OUT, IN)) * 0.02).astype(np.float32)
    weight[5] *= 40  # a row with large scales (and zeros), where bf16 rounding of the table matters most
    raw = quantize(weight, qtype) if qtype == Q.Q4_K else gguf_quants.quantize(weight, qtype)
    exact = torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(OUT, IN)  # gguf-py's decoding
    return torch.from_numpy(raw).reshape(OUT, -1), exact


def integers(packed, qtype):
    """Each value's 4-bit integer, read with gguf-py alone: the bytes decoded with every block's
    scale 1 and offset 0 (Q4_0: d = 1, so q - 8; Q4_1: d = 1, m = 0; Q4_K: d = 1, dmin = 0 and
    every 6-bit sub-block scale 1, min 0)."""
    size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144}[qtype]
    blocks = packed.reshape(-1, size).clone()
    blocks[:, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    if qtype != Q.Q4_0:
        blocks[:, 2:4] = 0
    if qtype == Q.Q4_K:  # scales 0-3 in bytes 4-7, mins 0-3 in 8-11, scales/mins 4-7 as nibbles of 12-15
        blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16] = 1, 0, 0x01
    values = torch.from_numpy(gguf_quants.dequantize(blocks.numpy().reshape(-1), qtype)).reshape(OUT, IN)
    return (values + (8 if qtype == Q.Q4_0 else 0)).round().to(torch.int32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_layout_is_torchs_and_gives_back_every_byte(qtype):
    packed, _ = ggml_bytes(qtype)
    ints = integers(packed, qtype)
    assert int(ints.min()) == 0 and int(ints.max()) == 15
    nibbles, heads = int4_layout.to_int4_layout(packed, qtype, IN)
    assert nibbles.numel() + heads.numel() == packed.numel()  # the same bytes, rearranged
    assert torch.equal(nibbles, torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 2))
    for rows in (slice(0, OUT), slice(64, 128), slice(128, OUT)):
        assert torch.equal(int4_layout.ggml_rows(nibbles, heads, qtype, IN, rows), packed[rows])


def relative_error(out, exact):
    return float((out.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_generation_calls_take_the_kernel_and_other_paths_are_unchanged(qtype, monkeypatch):
    packed, exact = ggml_bytes(qtype)
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(1))
    layer = PackedLinear(IN, OUT, qtype, packed.clone(), bias=bias.clone())
    x = torch.randn(2, 9, IN, generator=torch.Generator().manual_seed(2))
    xb = x.bfloat16()
    monkeypatch.setenv("KREA2_CPU_BF16", "1")  # a CPU with bf16 units: the kernel only up to its row limit
    monkeypatch.setattr(int4_layout, "NATIVE_BF16_MAX_ROWS", 17)
    with torch.no_grad():
        before_f32, before_bf16 = layer(x), layer(xb)  # 18 rows: expanded
    x_grad = x.clone().requires_grad_(True)
    layer(x_grad).square().sum().backward()
    grad_before = x_grad.grad.clone()
    assert not layer.in_int4_layout  # float32, gradient and over-limit calls leave the bytes as stored
    with torch.no_grad():
        kernel = layer(xb[:1])  # 9 rows: the kernel, after re-laying out the bytes
    assert layer.in_int4_layout and layer.weight.shape == (OUT, IN // 2)
    assert "layout=int4" in repr(layer)

    # As exact as bf16 allows: against float64 on the file's weights, within 1.5x of a bf16
    # F.linear on the once-rounded weights (the table's scales and zeros are rounded to bf16 too;
    # a wrong layout or table would be off by O(1)), and the bf16 output rounding bounds both.
    reference = xb[:1].double() @ exact.double().T + bias.double()
    linear = torch.nn.functional.linear(xb[:1], exact.bfloat16(), bias.bfloat16())
    assert relative_error(kernel, reference) <= 1.5 * relative_error(linear, reference)
    assert relative_error(kernel, reference) < 2**-8

    with torch.no_grad():  # every other path reads the bytes back bit for bit
        assert torch.equal(layer(x), before_f32)
        assert torch.equal(layer(xb), before_bf16)
    assert torch.equal(layer.dequantized_weight(), exact)
    x_grad = x.clone().requires_grad_(True)
    layer(x_grad).square().sum().backward()
    assert torch.equal(x_grad.grad, grad_before)


def test_cpus_without_bf16_units_take_the_kernel_at_any_row_count(monkeypatch):
    monkeypatch.setenv("KREA2_CPU_BF16", "0")  # bf16 matmuls emulated: the kernel is faster at every size
    packed, _ = ggml_bytes(Q.Q4_K)
    layer = PackedLinear(IN, OUT, Q.Q4_K, packed)
    with torch.no_grad():
        layer(torch.randn(int4_layout.NATIVE_BF16_MAX_ROWS + 1, IN).bfloat16())
    assert layer.in_int4_layout


def test_a_compiled_call_traces_the_kernel_in_one_graph(monkeypatch):
    """``--compile`` on a 4-bit model: dynamo traces a layer in the int4 layout without a graph break
    (the row limit's /proc/cpuinfo read broke it at every layer) and gives the eager output."""
    monkeypatch.delenv("KREA2_CPU_BF16", raising=False)  # the detection a user's run does (conftest fixes it)
    packed, _ = ggml_bytes(Q.Q4_K)
    layer = PackedLinear(IN, OUT, Q.Q4_K, packed)
    x = torch.randn(9, IN).bfloat16()
    with torch.no_grad():
        layer(x)  # re-lays out the bytes, outside any graph
        assert layer.in_int4_layout
        # inside a block, between other ops (a break at a frame's first line hides as a skipped frame)
        in_block = lambda inputs: layer(inputs * 2) + 1  # noqa: E731
        explained = torch._dynamo.explain(in_block)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
        assert torch.equal(torch.compile(in_block, backend="eager")(x), in_block(x))


def test_a_q4_k_gguf_model_generates_in_bf16_on_the_kernel(tmp_path, monkeypatch):
    """The user's path: a community-written Q4_K file loaded in bf16; every 4-bit layer takes the
    kernel, and the model's output is as close to its float32 output as expanding into bf16 was."""
    from gguf_support import make_inputs, make_model, relative_error, run_model, write_with_gguf_writer

    from krea2_diffusers.models.transformer import Krea2Transformer2DModel
    from krea2_diffusers.quantization.gguf import load_gguf_transformer

    path = tmp_path / "q4k.gguf"
    write_with_gguf_writer(make_model(), path, Q.Q4_K)
    inputs = make_inputs()
    exact = run_model(load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32), inputs)
    bf16_inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inputs.items()}

    monkeypatch.setenv("KREA2_CPU_BF16", "1")
    monkeypatch.setattr(int4_layout, "NATIVE_BF16_MAX_ROWS", 0)  # expanding, as before the kernel
    expanded = run_model(load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.bfloat16), bf16_inputs)
    monkeypatch.setenv("KREA2_CPU_BF16", "0")
    model = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.bfloat16)
    kernel = run_model(model, bf16_inputs)
    four_bit = [m for m in model.modules() if isinstance(m, PackedLinear) and m.qtype == Q.Q4_K]
    assert four_bit and all(m.in_int4_layout for m in four_bit)
    assert relative_error(kernel, exact) <= 1.5 * relative_error(expanded, exact)
