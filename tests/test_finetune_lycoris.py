"""LoKr and LoHa adapters (``lora.type: lokr | loha``) end to end, on the tiny transformer that
ComfyUI's native loader can build (2 blocks of one 128-wide head).

One short run per type (LoHa over an fp8-stored base) trains through ``krea2 train``'s engine and
exports the three files. Each file loads back in our loader with PEFT's trained weight deltas
(float64), lowers a plain pipeline's loss on fixed noise (measured outside the trainer), and loads
in a real ComfyUI's ``LoraLoaderModelOnly`` with no key left over and its patched weights equal to
base + our delta. LoKr at rank 8 over these widths stores ``w2`` whole in the square attention
layers (ComfyUI's scale 1) and decomposed in the feed-forward ones (ComfyUI's alpha / rank), so both
of ComfyUI's scale rules are met by one run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from finetune.config import ConfigError, LoRAConfig, build_config
from finetune.dryrun import build_plan
from finetune.methods import add_lora
from finetune.posttrain.config import PosttrainConfig
from finetune.trainer import Trainer
from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.loaders.convert import diffusers_module_to_original
from krea2_diffusers.loaders.lora import (LoraFormatError, load_lora_into_transformer, parse_lora_state_dict,
                                          set_lora_strength)
from krea2_diffusers.models.tiny import save_random_original_file, tiny_transformer_config
from lora_checks import COMFY_TEXT_WIDTH, comfy_model_config, comfy_patched, fixed_batch_loss, save_comfy_text_encoder

KINDS = ("lokr", "loha")
# alpha = 2 x rank: PEFT's scale (2) folds into the exported factor without rounding, so our
# deltas and PEFT's agree in float64 to the last bits.
ADAPTERS = {"lokr": {"type": "lokr", "rank": 8, "alpha": 16, "factor": -1},
            "loha": {"type": "loha", "rank": 4, "alpha": 8}}
BASES = {"lokr": ("float32", "none"), "loha": ("bfloat16", "fp8")}
ROLE_PREFIX = {"lokr": "lokr_", "loha": "hada_"}
STEPS = 6
pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(root: Path, model: Path, kind: str) -> dict:
    """The trainer's default targets (the blocks and the text-fusion blocks) over a text encoder as
    wide as ComfyUI's text fusion (``root/text_encoder``, written by the ``runs`` fixture)."""
    dtype, quantize = BASES[kind]
    return {
        "output_dir": str(root / kind),
        "model": {"pretrained_model_name_or_path": str(model), "text_encoder": str(root / "text_encoder"), "vae": "tiny-random",
                  "dtype": dtype, "quantize": quantize},
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 "cache_dir": str(root / "cache"), "num_workers": 0},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 2, "seed": 3},
        "lora": ADAPTERS[kind],
        "optimizer": {"learning_rate": 5e-2},  # a zero-started Kronecker/Hadamard factor moves slowly at LoRA rates
        "checkpointing": {"every_n_steps": STEPS, "keep_last": 1},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(kind)`` -> (trainer, result) of that type's run, trained on first use."""
    root = tmp_path_factory.mktemp("lycoris")
    model = root / "krea2_tiny_comfy.safetensors"
    save_random_original_file(model, comfy_model_config(COMFY_TEXT_WIDTH), seed=0)
    save_comfy_text_encoder(root / "text_encoder", seed=0)
    cache = {}

    def get(kind: str):
        if kind not in cache:
            trainer = Trainer(build_config(run_config(root, model, kind)))
            cache[kind] = (trainer, trainer.train())
        return cache[kind]

    get.model, get.text_encoder = model, root / "text_encoder"
    return get


@pytest.fixture(scope="module")
def plain_pipe(runs):
    from krea2_diffusers import Krea2Pipeline

    return Krea2Pipeline.from_single_file(str(runs.model), text_encoder=str(runs.text_encoder), vae="tiny-random",
                                          torch_dtype=torch.float32)


def _delta64(module: torch.nn.Module, adapter_name: str) -> torch.Tensor:
    """PEFT's own weight delta (out, in) of a LoKr/LoHa layer, computed in float64 on a copy."""
    return copy.deepcopy(module).double().get_delta_weight(adapter_name)


def _adapted(transformer: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Module]:
    """The PEFT layers holding adapter ``adapter_name``, by module name."""
    return {name: module for name, module in transformer.named_modules()
            if hasattr(module, "get_delta_weight") and adapter_name in getattr(module, "r", {})}


@pytest.mark.parametrize("kind", KINDS)
def test_trains_exports_and_loads_back_with_the_trained_weights(runs, plain_pipe, kind):
    trainer, result = runs(kind)
    assert result.final_step == STEPS
    trained = _adapted(trainer.pipe.transformer, "default")
    assert len(trained) == 48  # 8 projections x (2 blocks + 4 text-fusion blocks: krea2 train adapts them by default)
    if kind == "loha":
        assert "Fp8Linear" in {type(m.get_base_layer()).__name__ for m in trained.values()}
    else:  # both of ComfyUI's LoKr scale rules occur: w2 whole (attention) and decomposed (feed-forward)
        blocks = {name: m for name, m in trained.items() if name.startswith("transformer_blocks.")}
        whole = {name for name, m in blocks.items() if "default" in m.lokr_w2}
        assert whole and whole != set(blocks) and all(".attn." in n for n in whole)

    assert sorted(p.name for p in result.exported) == ["lora_comfyui.safetensors", "lora_diffusers.safetensors",
                                                        "lora_kohya.safetensors"]
    first = {"lokr": ("lora_unet_blocks_0_attn_wq.lokr_w1", "lora_unet_blocks_0_mlp_up.lokr_w2_a"),
             "loha": ("lora_unet_blocks_0_attn_wq.hada_w1_a", "lora_unet_blocks_0_mlp_up.alpha")}[kind]
    kohya = load_file(str(result.output_dir / "lora_kohya.safetensors"))
    assert set(first) <= set(kohya)
    assert all(k.split(".")[-1].startswith(ROLE_PREFIX[kind]) or k.endswith(".alpha") for k in kohya)
    with safe_open(str(result.output_dir / "lora_kohya.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["krea2.adapter_type"] == kind and meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"])["algo"] == kind and meta["krea2.steps"] == str(STEPS)

    # Each file through our loader: PEFT's trained deltas, in float64; strengths scale them.
    for path in result.exported:
        model = Krea2Transformer2DModel(**comfy_model_config(COMFY_TEXT_WIDTH))
        name = load_lora_into_transformer(model, path)
        for module_name, module in trained.items():
            torch.testing.assert_close(_delta64(model.get_submodule(module_name), name), _delta64(module, "default"),
                                       rtol=1e-12, atol=1e-12, msg=lambda m: f"{path.name} {module_name}: {m}")
        set_lora_strength(model, name, 0.5)
        module = model.get_submodule("transformer_blocks.1.ff.down")
        torch.testing.assert_close(_delta64(module, name), 0.5 * _delta64(trained["transformer_blocks.1.ff.down"], "default"),
                                   rtol=1e-12, atol=1e-12)

    # Learning, measured outside the trainer: a plain float32 pipeline's loss on fixed noise.
    before = fixed_batch_loss(plain_pipe, trainer, None)
    after = {path.name: fixed_batch_loss(plain_pipe, trainer, path) for path in result.exported}
    print(f"{kind}: loss without the adapter {before:.4f}, with {after}")
    assert max(after.values()) - min(after.values()) < 1e-5 * before  # the three files are one adapter
    assert max(after.values()) < 0.9 * before, (before, after)


@pytest.mark.parametrize("kind", KINDS)
def test_exports_load_in_real_comfyuis_native_lora_loader_with_our_weights(runs, comfyui, kind, tmp_path):
    """Our three files, and one as another trainer writes it (alpha not equal to the rank: a
    quarter of it where a factor is decomposed, so the scale is 1/4; an alpha of 3 beside LoKr's
    whole factors, which ComfyUI and LyCORIS ignore there): ComfyUI's weights are ours."""
    _, result = runs(kind)
    exported = load_file(str(result.output_dir / "lora_kohya.safetensors"))
    rescaled = dict(exported)
    for module in {key.rsplit(".", 1)[0] for key in exported}:
        alpha = exported.get(f"{module}.alpha")
        rescaled[f"{module}.alpha"] = torch.tensor(3.0) if alpha is None else alpha / 4
    save_file(rescaled, str(tmp_path / "lora_rescaled.safetensors"))
    files = [*result.exported, tmp_path / "lora_rescaled.safetensors"]
    base, patched_files = comfy_patched(comfyui, files, kind)
    deltas = {}
    for path, patched in patched_files.items():
        ours = Krea2Transformer2DModel(**comfy_model_config(COMFY_TEXT_WIDTH))
        name = load_lora_into_transformer(ours, path)
        modules = _adapted(ours, name)
        changed = {k for k in base if not torch.equal(patched[k], base[k])}
        assert changed == {diffusers_module_to_original(m) + ".weight" for m in modules}, path.name
        for module_name, module in modules.items():
            key = diffusers_module_to_original(module_name) + ".weight"
            deltas[path.name, module_name] = delta = _delta64(module, name)
            # float32 weights: ComfyUI adds its float32 delta to the float32 weight (one rounding each)
            torch.testing.assert_close(patched[key].double(), base[key].double() + delta,
                                       rtol=1e-6, atol=1e-6, msg=lambda m: f"{path.name} {key}: {m}")
    for file_name, module_name in [k for k in deltas if k[0] == "lora_rescaled.safetensors"]:
        module = "lora_unet_" + diffusers_module_to_original(module_name).replace(".", "_")
        scale = 0.25 if f"{module}.alpha" in exported else 1.0
        torch.testing.assert_close(deltas[file_name, module_name], scale * deltas["lora_kohya.safetensors", module_name],
                                   rtol=1e-12, atol=1e-12)


def test_adapter_type_and_factor_are_checked_before_any_model_loads(tmp_path):
    config = run_config(tmp_path, tmp_path / "unused.safetensors", "lokr")
    bad = {"lora": {"type": "lokx"}}, {"lora": {"type": "lokr", "factor": 0}}, {"lora": {"type": "loha", "factor": 4}}
    messages = (r"lora\.type: 'lokx' is not one of \['lora', 'lokr', 'loha'\]; did you mean 'lokr'",
                r"lora\.factor must be -1 .* got 0", r"lora\.factor=4 applies to lora\.type lokr only")
    for override, message in zip(bad, messages):
        with pytest.raises(ConfigError, match=message):
            build_config({**config, **override})
    for key, value in (("use_dora", True), ("dropout", 0.1)):
        with pytest.raises(ConfigError, match=rf"lora\.{key}.* applies to lora\.type lora only"):
            build_config({**config, "lora": {"type": "loha", key: value}})
    with pytest.raises(ConfigError, match=r"lora\.type='lokr' cannot train over model\.quantize 'nf4'"):
        build_config({**config, "model": {**config["model"], "quantize": "nf4"}})
    posttrain = {"method": "dpo", "dpo": {"data": "pairs.jsonl"}, "lora": {"type": "loha"}}
    with pytest.raises(ConfigError, match=r"lora\.type='loha': krea2 posttrain trains LoRA adapters only"):
        build_config(posttrain, cls=PosttrainConfig)
    # The dry run plans the LoKr weights.
    plan, what = build_plan(build_config({**config, "model": {"pretrained_model_name_or_path": "tiny-random"}}), 1)
    assert what == "LoKr r8 on a float32 base" and any(label.startswith("LoKr r8 weights") for label, _ in plan.rows)
    # factor reaches PEFT: 128 = 4 x 32 and 384 = 4 x 96 (factor -1 splits them 8 x 16 and 16 x 24)
    model = Krea2Transformer2DModel(**comfy_model_config())
    add_lora(model, LoRAConfig(type="lokr", rank=8, alpha=8, factor=4))
    assert tuple(model.transformer_blocks[0].ff.up.lokr_w1["default"].shape) == (4, 4)


def test_lycoris_files_fail_naming_the_layer_and_kinds_stack():
    torch.manual_seed(0)
    model = Krea2Transformer2DModel(**tiny_transformer_config()).eval()
    key = "lora_unet_blocks_0_attn_wq"  # a 64 -> 64 layer
    cases = [
        ({f"{key}.lokr_w1": torch.ones(8, 8)}, r"'transformer_blocks.0.attn.to_q' \(lokr\): lacks its lokr_w2_a tensor"),
        ({f"{key}.lokr_w1": torch.ones(8, 8), f"{key}.lokr_w2": torch.ones(8, 4)},
         r"lokr_w1 \(8, 8\), lokr_w2 \(8, 4\) do not make a 64->64 weight"),
        ({f"{key}.hada_w1_a": torch.ones(64, 2), f"{key}.hada_w1_b": torch.ones(2, 64), f"{key}.lokr_w1": torch.ones(8, 8)},
         r"mixes LoKr/LoHa tensors"),
        ({f"{key}.lokr_w1": torch.ones(8, 8), f"{key}.lokr_w2": torch.full((8, 8), float("nan"))},
         r"the lokr_w2 tensor holds NaN"),
        ({f"{key}.lokr_t2": torch.ones(2, 2, 1, 1)}, r"lokr_t2 is a Tucker factor of a convolution"),
    ]
    for state, message in cases:
        with pytest.raises(LoraFormatError, match=message):
            load_lora_into_transformer(model, state)
    assert not getattr(model, "peft_config", None)  # nothing half-applied

    # A LoRA, a LoKr (alpha 2 on a rank-2 w2: scale 1) and a LoHa (no alpha: scale 1) stack, each at its strength.
    g = torch.Generator().manual_seed(1)
    files = {
        "lora": {f"{key}.lora_down.weight": torch.randn(2, 64, generator=g), f"{key}.lora_up.weight": torch.randn(64, 2, generator=g)},
        "lokr": {f"{key}.lokr_w1": torch.randn(8, 8, generator=g), f"{key}.lokr_w2_a": torch.randn(8, 2, generator=g),
                 f"{key}.lokr_w2_b": torch.randn(2, 8, generator=g), f"{key}.alpha": torch.tensor(2.0)},
        "loha": {f"{key}.hada_w{i}_{ab}": torch.randn(*((64, 2) if ab == "a" else (2, 64)), generator=g)
                 for i in (1, 2) for ab in "ab"},
    }
    base = model.transformer_blocks[0].attn.to_q.weight.detach().double().clone()
    lora = files["lora"]
    expected = base + lora[f"{key}.lora_up.weight"].double() @ lora[f"{key}.lora_down.weight"].double()
    lokr = files["lokr"]
    expected += 0.5 * torch.kron(lokr[f"{key}.lokr_w1"].double(), lokr[f"{key}.lokr_w2_a"].double() @ lokr[f"{key}.lokr_w2_b"].double())
    loha = {k.split(".")[-1]: v.double() for k, v in files["loha"].items()}
    expected += 2.0 * (loha["hada_w1_a"] @ loha["hada_w1_b"]) * (loha["hada_w2_a"] @ loha["hada_w2_b"])
    for kind, strength in (("lora", 1.0), ("lokr", 0.5), ("loha", 2.0)):
        load_lora_into_transformer(model, files[kind], adapter_name=kind, strength=strength)
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        got = model.transformer_blocks[0].attn.to_q(x).double()
    torch.testing.assert_close(got, x.double() @ expected.T, rtol=1e-5, atol=1e-5)
    assert set(parse_lora_state_dict(files["lokr"], model)) == {"transformer_blocks.0.attn.to_q"}
