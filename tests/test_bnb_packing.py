"""NF4 / int8 storage computed on CPU chunk by chunk (krea2_diffusers.quantization.bnb_packing)
gives bitsandbytes' own bytes: the oracle is bitsandbytes' public quantizers on the same matrix."""

import pytest
import torch

import bitsandbytes as bnb  # noqa: E402  (a test dependency: pyproject [test])
import bitsandbytes.functional as F  # noqa: E402

from krea2_diffusers.quantization import bnb_packing  # noqa: E402
from krea2_diffusers.quantization.bnb import quantize_linears_  # noqa: E402


def _awkward_matrix(dtype: torch.dtype) -> torch.Tensor:
    """(96, 320): random rows plus the cases that decide a code: values exactly on the NF4
    midpoints (block absmax 1), an all-zero block, +-absmax, subnormal-sized and huge rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 320, generator=g)
    code = F.get_4bit_type("nf4", device="cpu")
    w[0, :15] = (code[:-1] + code[1:]) / 2
    w[0, 15:64] = 0.0
    w[0, 63] = -1.0
    w[1, :64] = 0.0
    w[2] *= 1e-30
    w[3] *= 1e4
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nf4_bytes_equal_bitsandbytes(dtype, monkeypatch):
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 64 * 37)  # several chunks and a short last one
    w = _awkward_matrix(dtype)
    want, want_state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    got, state = bnb_packing.quantize_nf4(w)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for name in ("absmax", "offset", "code"):
        assert torch.equal(getattr(state, name), getattr(want_state, name)), name
    assert torch.equal(state.state2.absmax, want_state.state2.absmax)
    assert state.shape == want_state.shape and state.dtype == want_state.dtype
    assert torch.equal(F.dequantize_4bit(got, state), F.dequantize_4bit(want, want_state))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_bytes_equal_bitsandbytes(dtype, monkeypatch):
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 320 * 7)  # 7 rows a chunk, a short last one
    w = _awkward_matrix(dtype)
    want, want_scales, _ = F.int8_vectorwise_quant(w.to(torch.float16))
    got, scales = bnb_packing.quantize_int8(w)
    assert torch.equal(got, want) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_layers_compute_as_bitsandbytes_quantized_them(mode):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(320, 192)).to(torch.bfloat16)
    theirs = ours[0]
    quantize_linears_(ours, mode)
    if mode == "nf4":
        layer = bnb.nn.Linear4bit(320, 192, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(theirs.weight.data, requires_grad=False, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(320, 192, has_fp16_weights=False, device="meta")
        layer.weight = bnb.nn.Int8Params(theirs.weight.data, requires_grad=False, has_fp16_weights=False)
    layer.bias = torch.nn.Parameter(theirs.bias.data, requires_grad=False)
    layer = layer.to("cpu")  # bitsandbytes quantizes here, the whole matrix at once
    x = torch.randn(4, 320, dtype=torch.bfloat16)
    assert torch.equal(ours[0].weight.data, layer.weight.data)
    with torch.no_grad():
        assert torch.equal(ours(x), layer(x))


def test_int8_training_on_the_cpu_computes_in_row_chunks_as_bitsandbytes_whole_matrix(monkeypatch):
    """A training forward on the CPU goes through row chunks (12 here, a short last one), not
    bitsandbytes' whole-matrix float32 dequantization; output, input gradient and the LoRA-style
    use (grad through a frozen base) equal bitsandbytes' own training path (MatMul8bitFp) in
    float64 to rounding (every weight element is the same expression; only the sums are split)."""
    from bitsandbytes.autograd import _functions as bnb_autograd

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 45))
    quantize_linears_(model, "int8")
    layer = model[0].train()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_(True)
    reference = bnb.nn.Linear8bitLt.forward(layer, reference_x)  # bitsandbytes' path, whole matrix
    grad = torch.randn_like(reference)
    reference.backward(grad)

    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 16 * 4)  # 4 rows a chunk
    whole = []
    monkeypatch.setattr(bnb_autograd.MatMul8bitFp, "forward", lambda *a, **k: whole.append(1))
    out = layer(x)
    out.backward(grad)
    assert not whole  # bitsandbytes' whole-matrix path did not run
    torch.testing.assert_close(out, reference, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-13, atol=1e-13)
    assert layer.weight.grad is None
    with torch.no_grad():  # inference keeps bitsandbytes' kernels
        layer.eval()
        torch.testing.assert_close(layer(x.detach().float()), bnb.nn.Linear8bitLt.forward(layer, x.detach().float()),
                                   rtol=0, atol=0)


def test_nf4_on_the_cpu_computes_in_row_chunks_as_bitsandbytes_whole_matrix(monkeypatch):
    """NF4 layers on the CPU expand their weight in output-row chunks (issue 42: bitsandbytes'
    whole-matrix expansion faulted in ~70 GB of fresh pages per full-size LoRA step). The chunks start
    on the nested absmax's 256-block boundaries: with 1024 inputs a chunk is a multiple of 16 rows,
    and with ~3 chunks and a short last one every boundary case is crossed. Every expanded weight is
    bitsandbytes' own (its dequantization of the whole matrix, bit for bit); the forward and the
    input gradient equal bitsandbytes' training path (MatMul4Bit) in float32 to the rounding of the
    split sums; bitsandbytes' whole-matrix path does not run."""
    from functools import partial

    from bitsandbytes.autograd import _functions as bnb_autograd

    from krea2_diffusers.quantization import bnb_nf4

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 72))
    quantize_linears_(model, "nf4", compute_dtype=torch.float32)
    layer = model[0].train()
    state = layer.weight.quant_state
    assert type(layer).__name__ == "Nf4Linear" and state.nested and bnb_nf4.row_multiple(state, 1024) == 16
    monkeypatch.setattr(bnb_packing, "CHUNK_WEIGHTS", 1024 * 31)  # 16 rows a chunk: 16, 16, 16, 16, 8
    from krea2_diffusers.quantization.chunked_linear import row_chunks

    chunks = row_chunks(72, 1024, torch.device("cpu"), 16)
    assert [c.stop - c.start if c.stop <= 72 else 72 - c.start for c in chunks] == [16, 16, 16, 16, 8]
    rows = partial(bnb_nf4.nf4_rows, layer.weight.data, state)
    whole = F.dequantize_4bit(layer.weight.data, state).float()
    assert torch.equal(torch.cat([rows(c, torch.float32, torch.device("cpu")) for c in chunks]), whole)

    x = torch.randn(3, 5, 1024, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_(True)
    reference = bnb.nn.Linear4bit.forward(layer, reference_x)  # bitsandbytes' path, whole matrix
    grad = torch.randn_like(reference)
    reference.backward(grad)
    calls = []
    monkeypatch.setattr(bnb_autograd.MatMul4Bit, "forward", lambda *a, **k: calls.append(1))
    out = layer(x)
    out.backward(grad)
    assert not calls
    # float32 sums of 1024 (forward) and 72 (gradient) products, split differently: a few ulps of the sum's scale
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None
