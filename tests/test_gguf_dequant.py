"""Torch dequantization and our quantizers, checked against gguf-py's numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from krea2_diffusers.quantization.gguf.dequant import dequantize
from krea2_diffusers.quantization.gguf.quantizer import quantize

Q = GGMLQuantizationType
PACKED = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of fp16 fields in each block (random bytes there could be NaN/inf).
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
               Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_blocks(qtype, n_blocks, seed=0) -> np.ndarray:
    """Random bytes with finite fp16 scale fields: exercises every bit of the layout."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(-0.01, 0.01, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_torch_dequant_matches_gguf_reference(qtype, device):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 512 // block_size
    raw = random_blocks(qtype, rows * blocks_per_row).reshape(rows, -1)
    expected = gguf_quants.dequantize(raw, qtype)  # (rows, 512) numpy reference
    got = dequantize(torch.from_numpy(raw).to(device), qtype, (rows, 512)).cpu().numpy()
    assert got.shape == expected.shape == (rows, 512)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_dequant_is_the_reference_rounded_once(qtype, monkeypatch):
    """float32: gguf-py's values to the bit; bf16: those values rounded once. A small chunk size
    puts chunk boundaries inside the tensor (and a last, shorter chunk)."""
    from krea2_diffusers.quantization.gguf import dequant

    monkeypatch.setattr(dequant, "CHUNK_VALUES", 3 * 256)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 5 * 1024 // block_size, seed=7).reshape(5, -1)
    expected = torch.from_numpy(gguf_quants.dequantize(raw, qtype))
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, (5, 1024)), expected)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, (5, 1024), torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequant_in_bfloat16_is_close_to_float32(qtype):
    raw = torch.from_numpy(random_blocks(qtype, 8))
    full = dequantize(raw, qtype, (8, GGML_QUANT_SIZES[qtype][0]))
    half = dequantize(raw, qtype, full.shape, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert float((half.float() - full).abs().max() / full.abs().max()) < 2e-2  # bf16 has 8 mantissa bits


def test_dequant_rejects_wrong_sizes():
    raw = torch.zeros(2, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shape"):
        dequantize(raw, Q.Q8_0, (2, 33))
    with pytest.raises(ValueError, match="whole number"):
        dequantize(torch.zeros(35, dtype=torch.uint8), Q.Q8_0, (32,))


# Relative RMS error of a uniform quantizer on Gaussian rows: about step / sqrt(12) / sigma with
# step ~ range / levels; bounds leave ~1.5x margin over that estimate.
QUANT_ERROR_BOUND = {Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_K: 0.06, Q.Q4_K: 0.12, Q.Q4_0: 0.12}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR_BOUND), ids=lambda q: q.name)
def test_quantizer_output_decodes_with_gguf_reference(qtype):
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((32, 1024)) * 0.02).astype(np.float32)
    packed = quantize(values, qtype)
    _, type_size = GGML_QUANT_SIZES[qtype]
    assert packed.dtype == np.uint8 and packed.shape == (32, 1024 // GGML_QUANT_SIZES[qtype][0] * type_size)
    decoded = gguf_quants.dequantize(packed, qtype)
    err = np.linalg.norm(decoded - values) / np.linalg.norm(values)
    assert err < QUANT_ERROR_BOUND[qtype], f"{qtype.name}: relative error {err:.4f}"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quantizer_edge_rows(qtype):
    """All-zero, constant, one-spike and all-positive rows stay finite and close."""
    rows = np.zeros((4, 256), dtype=np.float32)
    rows[1] = 0.5
    rows[2, 7] = -3.0
    rows[3] = np.linspace(1.0, 2.0, 256)
    decoded = gguf_quants.dequantize(quantize(rows, qtype), qtype)
    assert np.isfinite(decoded).all()
    np.testing.assert_array_equal(decoded[0], 0.0)
    levels = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 31}[qtype]
    # one step of a sub-block spanning the row's range, plus fp16 rounding of the scales
    tolerance = np.abs(rows).max(axis=1) / levels + 1e-3
    assert (np.abs(decoded - rows).max(axis=1) <= tolerance).all()


def test_quantizer_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 300), np.float32), Q.Q4_K)
    bad = np.zeros((1, 256), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize(bad, Q.Q6_K)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_bench_dequant_comparisons_decode_the_reference(qtype):
    """bench/bench_dequant.py's "before" and "comfy-style" dequantizers are only a fair comparison
    if they decode the same blocks: in float32 every product is exact, so they equal gguf-py's
    values; in bf16 each stays within bf16's rounding of them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_dequant import before_dequantize, comfy_style_dequantize

    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4 * 512 // block_size, seed=11).reshape(4, -1)
    expected = torch.from_numpy(gguf_quants.dequantize(raw, qtype))
    for fn in (before_dequantize, comfy_style_dequantize):
        assert torch.equal(fn(torch.from_numpy(raw), qtype, (4, 512), torch.float32), expected), fn.__name__
        half = fn(torch.from_numpy(raw), qtype, (4, 512), torch.bfloat16)
        assert half.dtype == torch.bfloat16
        assert float((half.float() - expected).abs().max() / expected.abs().max()) < 2e-2, fn.__name__
