"""PackedLinear: forward equals a plain linear on the dequantized weight, dtype/device moves keep
the bytes packed, and PEFT LoRA adapters wrap it (inference and training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from gguf_support import make_inputs, make_model, relative_error, run_model, write_with_gguf_writer

from krea2_diffusers.quantization.gguf import PackedLinear, load_gguf_transformer
from krea2_diffusers.models.transformer import Krea2Transformer2DModel

Q = GGMLQuantizationType
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.gate", "ff.up", "ff.down"]


def packed_layer(qtype=Q.Q8_0, out_features=64, in_features=256, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    packed = torch.from_numpy(gguf_quants.quantize(weight, qtype))
    b = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32)) if bias else None
    reference = torch.from_numpy(gguf_quants.dequantize(packed.numpy(), qtype))  # gguf-py's decoding
    return PackedLinear(in_features, out_features, qtype, packed, bias=b), reference, b


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_1], ids=lambda q: q.name)
def test_forward_equals_linear_on_reference_weight(qtype):
    layer, weight, bias = packed_layer(qtype)
    x = torch.randn(3, 7, 256)
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.uint8
    assert not layer.weight.requires_grad


def test_bad_packed_shape_is_refused():
    with pytest.raises(ValueError, match=r"uint8 \(4, 68\)"):
        PackedLinear(64, 4, Q.Q8_0, torch.zeros(4, 60, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot hold F16"):
        PackedLinear(64, 4, Q.F16, torch.zeros(4, 128, dtype=torch.uint8))


def test_model_dtype_cast_keeps_bytes_packed(tmp_path):
    model = make_model()
    path = tmp_path / "q8.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0)
    loaded = load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)
    before = loaded.transformer_blocks[1].ff.up.weight.clone()
    loaded.to(torch.bfloat16)
    after = loaded.transformer_blocks[1].ff.up.weight
    assert after.dtype == torch.uint8 and torch.equal(before, after)
    assert loaded.img_in.weight.dtype == torch.bfloat16
    inputs = make_inputs()
    assert relative_error(run_model(loaded, inputs), run_model(model, inputs)) < 5e-2


@pytest.fixture()
def q8_model(tmp_path):
    model = make_model()
    path = tmp_path / "q8.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0)
    return load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)


def test_peft_lora_wraps_packed_linear_and_adds_exact_delta(q8_model):
    from peft import LoraConfig

    base = q8_model.transformer_blocks[0].attn.to_q
    x = torch.randn(2, 5, base.in_features)
    with torch.no_grad():
        base_out = base(x)
    rank, alpha = 4, 8
    q8_model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS, init_lora_weights=False))
    wrapped = q8_model.transformer_blocks[0].attn.to_q
    assert wrapped.base_layer is base and isinstance(wrapped.base_layer, PackedLinear)
    a = wrapped.lora_A["default"].weight
    b = wrapped.lora_B["default"].weight
    assert a.dtype == torch.float32  # PEFT must not have cast the adapter to the packed uint8 dtype
    with torch.no_grad():
        expected = base_out + (alpha / rank) * (x @ a.T @ b.T)
        torch.testing.assert_close(wrapped(x), expected, rtol=1e-5, atol=1e-5)
    n_wrapped = sum(hasattr(m, "lora_A") and isinstance(m.base_layer, PackedLinear) for m in q8_model.modules())
    assert n_wrapped == 8 * 6  # every packed matrix of the 4 blocks and 2 text blocks


def test_lora_trains_on_packed_base(q8_model):
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, target_modules=LORA_TARGETS), q8_model)
    inputs = make_inputs()
    zero_init = run_model(q8_model, inputs)  # lora_B starts at zero: adapters are a no-op
    q8_model.train()
    lora_params = [p for n, p in q8_model.named_parameters() if "lora_" in n]
    for p in q8_model.parameters():
        p.requires_grad_(False)
    for p in lora_params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(lora_params, lr=1e-2)
    loss = q8_model(**inputs).sample.square().mean()
    loss.backward()
    assert all(p.grad is not None for p in lora_params)
    optimizer.step()
    q8_model.eval()
    assert relative_error(run_model(q8_model, inputs), zero_init) > 1e-4  # the step changed the output
    packed = [m for m in q8_model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.weight.grad is None and m.weight.dtype == torch.uint8 for m in packed)


def test_community_lora_file_applies_on_gguf_model(q8_model):
    """A native/ComfyUI-format LoRA through the package's LoRA loader lands on the packed layers,
    and its effect on a layer is exactly B @ A @ x (alpha = rank)."""
    from krea2_diffusers.loaders.lora import load_lora_into_transformer

    g = torch.Generator().manual_seed(5)
    rank = 4
    state = {}
    for block in range(2):
        for orig in ("attn.wq", "mlp.down"):
            module = q8_model.get_submodule(f"transformer_blocks.{block}.{'attn.to_q' if orig == 'attn.wq' else 'ff.down'}")
            state[f"diffusion_model.blocks.{block}.{orig}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.1
            state[f"diffusion_model.blocks.{block}.{orig}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.1
    base = q8_model.transformer_blocks[1].ff.down
    x = torch.randn(3, base.in_features)
    with torch.no_grad():
        base_out = base(x)
    load_lora_into_transformer(q8_model, state, adapter_name="style")
    wrapped = q8_model.transformer_blocks[1].ff.down
    assert isinstance(wrapped.base_layer, PackedLinear)
    a = state["diffusion_model.blocks.1.mlp.down.lora_A.weight"]
    b = state["diffusion_model.blocks.1.mlp.down.lora_B.weight"]
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), base_out + x @ a.T @ b.T, rtol=1e-4, atol=1e-5)


def test_dequantizes_on_the_inputs_device(monkeypatch):
    """Packed bytes kept on the CPU (offload) travel to the input's device and are expanded there
    (on CUDA in real use; ``meta`` stands in for it here), never expanded on the CPU per call."""
    from krea2_diffusers.quantization.gguf import packed as packed_module

    layer, _, _ = packed_layer(Q.Q8_0)
    seen = []
    real = packed_module.dequantize
    monkeypatch.setattr(packed_module, "dequantize", lambda raw, *a: seen.append(raw.device) or real(raw, *a))
    layer(torch.randn(2, 256))
    assert seen == [torch.device("cpu")] and layer.packed_on(torch.device("cpu")) is layer.weight  # CPU path unchanged
    out = layer(torch.randn(2, 256, device="meta"))
    assert seen[-1] == torch.device("meta") and out.device == torch.device("meta")
    assert layer.weight.device == torch.device("cpu")  # the stored bytes stay where they were
