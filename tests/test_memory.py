"""Memory presets: the plan chosen for the full-size model at each budget, and each mechanism
applied to the tiny pipeline (on CPU, where offload moves are no-ops but the hooks still run)."""

from __future__ import annotations

import sys

import pytest
import torch

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.pipelines.memory import (
    GIB,
    MEMORY_PRESETS,
    MemoryPlan,
    _budget,
    apply_memory_preset,
    apply_plan,
    plan_memory,
    release_text_encoder,
)

# Full-size Krea 2 in bf16 (ARCHITECTURE.md: 12.82B transformer; Qwen3-VL-4B ~4.44B with vision).
TRANSFORMER = int(12.82e9 * 2)
TEXT_ENCODER = int(4.44e9 * 2)
VAE = int(0.127e9 * 2)
Q4_GGUF_TRANSFORMER = int(7.4e9)  # a Q4_K_M file's packed size
CPU = torch.device("cpu")


def plan_for(preset, bnb=True, transformer=TRANSFORMER, compact=False):
    return plan_memory(transformer, TEXT_ENCODER, VAE, _budget(preset, torch.device("cuda")),
                       bnb_available=bnb, transformer_compact=compact)


def test_bad_preset_lists_valid_ones(tiny_pipe):
    with pytest.raises(ValueError, match="auto, high, 24gb, 16gb, 12gb, 8gb"):
        apply_memory_preset(tiny_pipe, "4gb")


@pytest.mark.parametrize(
    "preset, bnb, expected",
    [
        ("high", True, ("none", None, None)),
        ("24gb", True, ("model", "fp8", None)),
        ("16gb", True, ("model", "nf4", None)),
        ("16gb", False, ("group", "fp8", None)),
        ("12gb", True, ("model", "nf4", "nf4")),
        ("8gb", True, ("group", "fp8", None)),
    ],
)
def test_full_size_plans(preset, bnb, expected):
    plan = plan_for(preset, bnb)
    assert (plan.offload, plan.transformer_storage, plan.text_encoder_storage) == expected
    if not bnb:
        assert any("bitsandbytes" in note for note in plan.notes)  # says why NF4 was not used


def test_gguf_transformer_is_not_quantized_again():
    plan = plan_for("16gb", transformer=Q4_GGUF_TRANSFORMER, compact=True)
    assert (plan.offload, plan.transformer_storage) == ("model", None)


@pytest.fixture(scope="module")
def base_pipe():
    """This module's own untouched pipeline for the references: the session's tiny_pipe is shared with
    every other test file in the worker, and the comparisons below are exact."""
    return fresh_pipe()


@pytest.fixture(scope="module")
def prompt_embeds(base_pipe):
    embeds, mask = base_pipe.encode_prompt(["a red cube", ""], device=CPU)
    return embeds, mask


def generate(pipe, prompt_embeds):
    """The comparisons below are exact (atol 0): every generation, the module-scoped reference too, runs
    on one thread, so no test depends on the thread count an earlier test (or file) left behind."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return generate_here(pipe, prompt_embeds)
    finally:
        torch.set_num_threads(threads)


def generate_here(pipe, prompt_embeds):
    embeds, mask = prompt_embeds
    return pipe(prompt_embeds=embeds[:1], prompt_embeds_mask=mask[:1], negative_prompt_embeds=embeds[1:],
                negative_prompt_embeds_mask=mask[1:], height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(0), output_type="latent").images.float()


@pytest.fixture(scope="module")
def reference(base_pipe, prompt_embeds):
    return generate(base_pipe, prompt_embeds)


def fresh_pipe():
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_model_offload_is_exact(prompt_embeds, reference):
    pipe = fresh_pipe()
    apply_plan(pipe, MemoryPlan(offload="model"), CPU)
    from accelerate.hooks import CpuOffload

    assert isinstance(getattr(pipe.transformer, "_hf_hook", None), CpuOffload)
    assert len(pipe._all_hooks) == 3  # text encoder, transformer, VAE
    torch.testing.assert_close(generate(pipe, prompt_embeds), reference, rtol=0, atol=0)


def test_fp8_storage_with_group_offload(prompt_embeds, reference):
    pipe = fresh_pipe()
    apply_plan(pipe, MemoryPlan(offload="group", transformer_storage="fp8"), CPU)
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    assert _is_group_offload_enabled(pipe.transformer) and _is_group_offload_enabled(pipe.text_encoder)
    from krea2_diffusers.quantization.fp8 import Fp8Linear

    block = pipe.transformer.transformer_blocks[0]
    assert isinstance(block.ff.up, Fp8Linear) and block.ff.up.fp8_weight.dtype == torch.float8_e4m3fn
    assert block.norm1.weight.dtype == torch.float32  # norm scales stay float32
    out = generate(pipe, prompt_embeds)
    error = rel(out, reference)
    assert 1e-5 < error < 5e-2  # fp8 e4m3 has 3 mantissa bits: visible but small
    # Side by side with diffusers' unscaled fp8 storage (layerwise casting) of the same weights:
    # the per-row scale keeps small rows out of e4m3's subnormal range.
    from krea2_diffusers.pipelines.memory import _cast_for_compute

    unscaled = fresh_pipe()
    _cast_for_compute(unscaled.transformer, torch.bfloat16)  # as the scaled path: norm scales stay float32
    unscaled.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    unscaled_error = rel(generate(unscaled, prompt_embeds), reference)
    print(f"fp8 relative error: per-row scaled {error:.4f}, unscaled layerwise casting {unscaled_error:.4f}")
    assert error < unscaled_error


def test_nf4_transformer_and_text_encoder(prompt_embeds, reference):
    bnb = pytest.importorskip("bitsandbytes")
    pipe = fresh_pipe()
    apply_plan(pipe, MemoryPlan(offload="model", transformer_storage="nf4", text_encoder_storage="nf4"), CPU)
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, bnb.nn.Linear4bit)
    assert not isinstance(pipe.transformer.img_in, bnb.nn.Linear4bit)  # kept in full precision
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in pipe.text_encoder.modules()) > 0
    embeds, mask = pipe.encode_prompt(["a red cube", ""], device=CPU)  # the NF4 text encoder runs
    assert torch.isfinite(embeds).all()
    out = generate(pipe, prompt_embeds)
    assert 1e-4 < rel(out, reference) < 0.5


def test_preset_description_and_auto_on_cpu(prompt_embeds, reference):
    pipe = fresh_pipe()
    text = apply_memory_preset(pipe, "auto", device="cpu")
    # On a CPU there is no accelerator and no budget: the line says so, with no accelerator estimate.
    assert text == "memory='auto' on cpu: all components on the CPU (no accelerator: nothing to offload)"
    torch.testing.assert_close(generate(pipe, prompt_embeds), reference, rtol=0, atol=0)


def test_bitsandbytes_missing_is_a_clear_error(monkeypatch):
    from krea2_diffusers.quantization.bnb import BitsAndBytesUnavailable, quantize_transformer_

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(BitsAndBytesUnavailable, match="bitsandbytes needs to be installed"):
        quantize_transformer_(model, "nf4")
    assert type(model[0]) is torch.nn.Linear  # nothing was changed
    with pytest.raises(ValueError, match="nf4', 'int8"):
        from krea2_diffusers.quantization.bnb import quantize_linears_

        quantize_linears_(model, "fp4")


def test_release_text_encoder(prompt_embeds, reference):
    pipe = fresh_pipe()
    release_text_encoder(pipe)
    assert pipe.text_encoder is None
    torch.testing.assert_close(generate(pipe, prompt_embeds), reference, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"released \(memory.release_text_encoder\); pass prompt_embeds"):
        pipe("a red cube", height=32, width=32, num_inference_steps=1)


def test_presets_say_where_the_text_encoder_is_and_keep_it():
    """A preset never drops the text encoder (it offloads it), and its description says where it is."""
    pipe = fresh_pipe()
    text = apply_memory_preset(pipe, "auto", device="cpu")
    assert "all components on the CPU" in text and pipe.text_encoder is not None
    pipe.encode_prompt("a red cube", device=CPU)
    pipe = fresh_pipe()
    apply_plan(pipe, MemoryPlan(offload="model"), CPU)
    assert pipe.text_encoder is not None and "release" not in Krea2Pipeline.enable_memory_preset.__doc__.split("To drop")[0]


# The proportioned model of bench/bench_pipeline.py (1/16 width of the release); its text encoder's
# embedding table (151936 x 160) is the largest tensor.
PROPORTIONED = dict(
    in_channels=64, num_layers=8, attention_head_dim=32, num_attention_heads=12, num_key_value_heads=3,
    intermediate_size=1024, timestep_embed_dim=256, text_hidden_dim=160, num_text_layers=12,
    text_num_attention_heads=5, text_num_key_value_heads=5, text_intermediate_size=432,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(8, 12, 12),
)
MEASURE = """
import json, os, sys, torch
from krea2_diffusers.pipelines.memory import ACTIVATION_HEADROOM, component_bytes, plan_memory
from krea2_diffusers.models.tiny import tiny_text_encoder_config, tiny_vae_config
from krea2_diffusers.models.transformer import Krea2Transformer2DModel
from diffusers import AutoencoderKLQwenImage
from transformers import Qwen3VLForConditionalGeneration

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

te_config = tiny_text_encoder_config()
te_config.text_config.hidden_size = 160
te_config.text_config.intermediate_size = 432
te_config.vision_config.out_hidden_size = 160
with torch.device("meta"):
    parts = [Krea2Transformer2DModel(**json.loads(sys.argv[1])), Qwen3VLForConditionalGeneration(te_config),
             AutoencoderKLQwenImage(**tiny_vae_config())]
estimate = plan_memory(*(component_bytes(p) for p in parts), None, bnb_available=False).estimated_peak - ACTIVATION_HEADROOM
before = rss()
for part in parts:  # bf16 weights allocated directly on the CPU, every page written
    part.to(torch.bfloat16).to_empty(device="cpu")
    if hasattr(part, "tie_weights"):
        part.tie_weights()  # to_empty unties the LM head from the embeddings; loading ties them
    for tensor in list(part.parameters()) + list(part.buffers()):
        tensor.data.fill_(1)
print(json.dumps({"estimate": estimate, "measured": rss() - before}))
"""


def test_estimate_matches_measured_resident_memory():
    """The planner's weight estimate against the resident memory the same components take (CPU
    RSS of a fresh process, proportioned model, bf16)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(PROPORTIONED)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sizes["estimate"] > 50e6  # tens of MB: well above allocator noise
    assert abs(sizes["measured"] - sizes["estimate"]) / sizes["estimate"] < 0.1, sizes


def test_presets_constant_is_the_documented_list():
    assert MEMORY_PRESETS == ("auto", "high", "24gb", "16gb", "12gb", "8gb")
    assert _budget("8gb", CPU) < 8 * GIB


def test_nf4_leaves_loaded_lora_matrices_alone():
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig

    from krea2_diffusers.quantization.bnb import quantize_transformer_
    from krea2_diffusers.models.tiny import tiny_transformer_config

    from krea2_diffusers.models.transformer import Krea2Transformer2DModel

    transformer = Krea2Transformer2DModel(**tiny_transformer_config()).eval()
    transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"], init_lora_weights=False))
    quantize_transformer_(transformer, "nf4", compute_dtype=torch.float32)
    wrapped = transformer.transformer_blocks[0].attn.to_q
    assert type(wrapped.lora_A["default"]) is torch.nn.Linear and wrapped.lora_A["default"].weight.dtype == torch.float32
    assert type(wrapped.base_layer).__name__ == "Nf4Linear"
