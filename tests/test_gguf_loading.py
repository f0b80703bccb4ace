"""Loading GGUF files written with the gguf package's own GGUFWriter (community conventions)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_support import TINY_GGUF_CONFIG, make_inputs, make_model, relative_error, run_model, write_with_gguf_writer

from krea2_diffusers.quantization.gguf import PackedLinear, load_gguf_transformer, resident_bytes
from krea2_diffusers.models.transformer import Krea2Transformer2DModel

Q = GGMLQuantizationType

# Output error bounds vs the fp32 model. Weight error per type (test_gguf_dequant) times the
# tiny model's sensitivity (~2.5x: 1% weight noise moves its output ~2.5%), with margin.
OUTPUT_ERROR_BOUND = {
    Q.Q8_0: 3e-2, Q.Q6_K: 8e-2, Q.Q5_K: 0.15, Q.Q5_0: 0.15, Q.Q5_1: 0.15,
    Q.Q4_K: 0.3, Q.Q4_0: 0.3, Q.Q4_1: 0.3,
}
# Quantization must visibly change the output, or the weights were not really quantized.
MIN_VISIBLE_ERROR = 1e-4


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    inputs = make_inputs()
    return model, inputs, run_model(model, inputs), resident_bytes(model)


@pytest.fixture(scope="module")
def errors():
    return {}


@pytest.mark.parametrize("qtype", list(OUTPUT_ERROR_BOUND), ids=lambda q: q.name)
def test_each_type_loads_packed_and_is_accurate(qtype, reference, errors, tmp_path):
    model, inputs, ref, _ = reference
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_with_gguf_writer(model, path, qtype)
    loaded = Krea2Transformer2DModel.from_single_file(path, torch_dtype=torch.float32)
    assert not loaded.training
    packed = [m for m in loaded.modules() if isinstance(m, PackedLinear)]
    # every attention (q, k, v, gate, out) and MLP (gate, up, down) matrix of the 4 blocks and 2 text blocks
    assert len(packed) == 8 * (TINY_GGUF_CONFIG["num_layers"] + 2)
    assert all(m.weight.dtype == torch.uint8 and m.qtype == qtype for m in packed)
    err = relative_error(run_model(loaded, inputs), ref)
    errors[qtype] = err
    assert MIN_VISIBLE_ERROR < err < OUTPUT_ERROR_BOUND[qtype], f"{qtype.name}: relative output error {err:.4f}"


def test_error_grows_as_bits_shrink(errors):
    if len(errors) < len(OUTPUT_ERROR_BOUND):
        pytest.skip("needs the per-type tests of this module")
    assert errors[Q.Q8_0] < errors[Q.Q6_K] < errors[Q.Q5_K] < errors[Q.Q4_K]
    assert errors[Q.Q8_0] < errors[Q.Q5_0] < errors[Q.Q4_0]


def test_q8_0_resident_size_and_bf16_default(reference, tmp_path):
    model, inputs, ref, fp32_bytes = reference
    path = tmp_path / "tiny-q8.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0)
    loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    ratio = resident_bytes(loaded) / fp32_bytes
    assert ratio < 0.4, f"Q8_0 resident bytes are {ratio:.3f} of fp32"
    default = load_gguf_transformer(Krea2Transformer2DModel, path)  # no torch_dtype: bf16 compute
    assert default.img_in.weight.dtype == torch.bfloat16
    assert default.transformer_blocks[0].norm1.weight.dtype == torch.float32  # norm scales stay fp32
    assert resident_bytes(default) < resident_bytes(loaded)
    assert relative_error(run_model(default, inputs), ref) < 5e-2  # Q8_0 error plus bf16 compute


def test_prefixed_names_dormant_tensors_and_orig_shape(reference, tmp_path):
    """ComfyUI-style prefix, the two unused ``last.up/down`` tensors, and a tensor stored reshaped
    with its real shape in ``comfy.gguf.orig_shape``."""
    model, inputs, ref, _ = reference
    path = tmp_path / "community.gguf"
    extra = {"last.up.weight": np.ones((64, 256), np.float32), "last.down.weight": np.ones((256, 64), np.float32)}
    flat = "blocks.0.mlp.down.weight"
    write_with_gguf_writer(model, path, Q.Q8_0, prefix="model.diffusion_model.", extra=extra, flatten=(flat,))
    with pytest.warns(UserWarning, match="last.up.weight"):
        loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    down = loaded.transformer_blocks[0].ff.down
    assert isinstance(down, PackedLinear) and (down.out_features, down.in_features) == (256, 768)
    assert relative_error(run_model(loaded, inputs), ref) < OUTPUT_ERROR_BOUND[Q.Q8_0]


def test_unlabelled_krea2_layout_loads_with_warning(reference, tmp_path):
    model, inputs, ref, _ = reference
    path = tmp_path / "unlabelled.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0, arch="pig")
    with pytest.warns(UserWarning, match="'pig'"):
        loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    assert relative_error(run_model(loaded, inputs), ref) < OUTPUT_ERROR_BOUND[Q.Q8_0]


def test_float_only_file_matches_exactly(reference, tmp_path):
    """An all-F32 GGUF is lossless: loading must reproduce the model bit for bit."""
    model, inputs, ref, _ = reference
    path = tmp_path / "f32.gguf"
    write_with_gguf_writer(model, path, Q.F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    assert not any(isinstance(m, PackedLinear) for m in loaded.modules())
    torch.testing.assert_close(run_model(loaded, inputs), ref, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_packed_model_runs_on_gpu(reference, tmp_path):
    model, inputs, ref, _ = reference
    path = tmp_path / "gpu.gguf"
    write_with_gguf_writer(model, path, Q.Q4_K)
    loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32).to("cuda")
    assert loaded.transformer_blocks[0].attn.to_q.weight.device.type == "cuda"
    cpu = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    out = run_model(loaded, {k: v.to("cuda") for k, v in inputs.items()}).cpu()
    torch.testing.assert_close(out, run_model(cpu, inputs), rtol=1e-3, atol=1e-3)
