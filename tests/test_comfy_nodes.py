"""The ComfyUI node pack, driven the way ComfyUI drives it (schema -> validated inputs -> function),
without ComfyUI installed; plus a fake ComfyUI runtime for the progress bar, interrupt and unload hooks,
and validation of the example workflows against the node schemas."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import comfy_nodes
from comfy_nodes import comfy_bridge, models, nodes

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "examples" / "comfyui"
WIDGET_TYPES = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool}
# Core nodes the example workflows use, with the schemas ComfyUI declares for them.
CORE = {
    "LoadImage": ({"required": {"image": (["style_ref_1.png", "style_ref_2.png"], {"image_upload": True})}}, ("IMAGE", "MASK"), False),
    "SaveImage": ({"required": {"images": ("IMAGE", {}), "filename_prefix": ("STRING", {"default": "ComfyUI"})}}, (), True),
}
TINY = dict(model="tiny-random", variant="turbo", text_encoder=models.HUB_TEXT_ENCODER, vae=models.HUB_VAE,
            dtype="float32", memory="auto")


# ----------------------------------------------------------------------------- ComfyUI's side
def declared_inputs(node_class) -> dict:
    spec = node_class.INPUT_TYPES()
    return {**spec["required"], **spec.get("optional", {})}


def is_widget(spec) -> bool:
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES


def check_widget(node, name, spec, value):
    """ComfyUI's validation of a widget value."""
    kind, options = spec
    if isinstance(kind, list):
        assert value in kind, f"{node}.{name}: {value!r} is not one of {kind}"
        return
    assert isinstance(value, WIDGET_TYPES[kind]) and not (kind != "BOOLEAN" and isinstance(value, bool)), f"{node}.{name}: {value!r}"
    if kind in ("INT", "FLOAT"):
        assert options.get("min", -np.inf) <= value <= options.get("max", np.inf), f"{node}.{name}={value} out of range"
    if kind == "INT" and options.get("step", 1) > 1:
        assert (value - options.get("min", 0)) % options["step"] == 0, f"{node}.{name}={value} not on its step"


def run_node(class_type: str, **inputs):
    """Validate ``inputs`` against the node's schema, call its FUNCTION as ComfyUI's executor does, check the outputs' arity."""
    node_class = comfy_nodes.NODE_CLASS_MAPPINGS[class_type]
    spec = node_class.INPUT_TYPES()
    assert set(spec["required"]) <= set(inputs), f"missing {set(spec['required']) - set(inputs)}"
    declared = declared_inputs(node_class)
    assert set(inputs) <= set(declared), f"unknown {set(inputs) - set(declared)}"
    for name, value in inputs.items():
        if is_widget(declared[name]):
            check_widget(class_type, name, declared[name], value)
    with torch.inference_mode():  # ComfyUI executes every node under inference mode
        outputs = getattr(node_class(), node_class.FUNCTION)(**inputs)
    assert isinstance(outputs, tuple) and len(outputs) == len(node_class.RETURN_TYPES)
    return outputs


@pytest.fixture()
def models_dir(tmp_path, monkeypatch):
    """A ComfyUI-like models folder (read through $KREA2_MODELS_DIR when ComfyUI is absent)."""
    monkeypatch.setenv(comfy_bridge.MODELS_DIR_ENV, str(tmp_path))
    for name in ("diffusion_models/krea2_turbo_bf16.safetensors", "diffusion_models/krea2_raw_bf16.safetensors",
                 "diffusion_models/gguf/krea-2-turbo-Q4_0.gguf", "diffusion_models/notes.txt",
                 "loras/krea2-style-lora.safetensors", "loras/krea2_style_reference.safetensors", "vae/qwen_image_vae.safetensors",
                 "text_encoders/qwen3vl_4b_bf16.safetensors", "text_encoders/qwen3vl_4b_fp8_scaled.safetensors", "diffusers/Krea-2-Turbo/model_index.json",
                 "diffusers/Krea-2-Turbo/transformer/config.json", "text_encoders/Qwen3-VL-4B-Instruct/config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    return tmp_path


@pytest.fixture()
def tiny_model():
    (model,) = run_node("Krea2ModelLoader", **TINY)
    model.pipeline().set_progress_bar_config(disable=True)
    return model


# ----------------------------------------------------------------------------- schemas
def test_every_node_has_a_complete_v1_schema():
    assert set(comfy_nodes.NODE_CLASS_MAPPINGS) == set(comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS) == {
        "Krea2ModelLoader", "Krea2LoraLoader", "Krea2PromptExpander", "Krea2StyleReference", "Krea2Sampler",
        "Krea2ReferenceImage", "Krea2TextEncode", "Krea2Cache"}
    for name, node_class in comfy_nodes.NODE_CLASS_MAPPINGS.items():
        assert node_class.CATEGORY == "Krea2" and node_class.DESCRIPTION
        assert callable(getattr(node_class, node_class.FUNCTION))
        assert len(node_class.RETURN_TYPES) == len(node_class.RETURN_NAMES) == len(node_class.OUTPUT_TOOLTIPS)
        for input_name, spec in declared_inputs(node_class).items():
            assert isinstance(spec, tuple) and isinstance(spec[1], dict), (name, input_name)
            assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
            if is_widget(spec) and "default" in spec[1]:
                check_widget(name, input_name, spec, spec[1]["default"])
    guidance = declared_inputs(nodes.Krea2Sampler)["guidance"][1]
    assert "0 = off" in guidance["display_name"] and "cfg" in guidance["tooltip"]


def test_model_lists_come_from_the_model_folders(models_dir):
    assert list(models.transformer_choices()) == [
        "tiny-random", "diffusers/Krea-2-Turbo", "gguf/krea-2-turbo-Q4_0.gguf", "krea2_raw_bf16.safetensors",
        "krea2_turbo_bf16.safetensors"]
    loader = declared_inputs(nodes.Krea2ModelLoader)
    assert loader["text_encoder"][0] == ["tiny-random", models.HUB_TEXT_ENCODER, "Qwen3-VL-4B-Instruct",
                                         "qwen3vl_4b_bf16.safetensors", "qwen3vl_4b_fp8_scaled.safetensors"]
    assert loader["text_encoder"][1]["default"] == "qwen3vl_4b_bf16.safetensors"  # bf16 before fp8
    # ComfyUI's single-file VAE is offered, and is the default when its usual name is present
    assert loader["vae"][0] == ["tiny-random", models.HUB_VAE, "qwen_image_vae.safetensors"]
    assert loader["vae"][1]["default"] == "qwen_image_vae.safetensors"
    assert declared_inputs(nodes.Krea2LoraLoader)["lora_name"][0] == ["krea2-style-lora.safetensors", "krea2_style_reference.safetensors"]


def test_missing_model_gives_a_friendly_error(models_dir):
    with pytest.raises(FileNotFoundError, match="not in .*diffusion_models.*Refresh"):
        models.load_pipeline(models.LoadSpec("gone.safetensors"))


def load_like_comfyui(pack: Path, cwd: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """ComfyUI imports custom_nodes/<folder>/__init__.py by file path, from its own working directory."""
    script = prelude + (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('krea2', r'{pack / '__init__.py'}', submodule_search_locations=[r'{pack}'])\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['krea2'] = module; spec.loader.exec_module(module)\n"
        "print(sorted(module.NODE_CLASS_MAPPINGS))\n"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_pack_loads_like_comfyui_loads_it(tmp_path):
    (tmp_path / "custom_nodes").mkdir()
    linked = tmp_path / "custom_nodes" / "krea2"
    linked.symlink_to(ROOT / "comfy_nodes")
    done = load_like_comfyui(linked, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Krea2Sampler" in done.stdout
    # A copy without the library says what to do (simulated: the library made unimportable).
    copied = tmp_path / "copy" / "krea2"
    shutil.copytree(ROOT / "comfy_nodes", copied, ignore=shutil.ignore_patterns("__pycache__"))
    done = load_like_comfyui(copied, tmp_path, prelude="import sys; sys.modules['krea2_diffusers'] = None\n")
    assert done.returncode != 0 and "pip install -e /path/to/krea2-diffusers" in done.stderr


# ----------------------------------------------------------------------------- running the nodes
def test_loader_to_sampler_on_tiny_random(tiny_model):
    assert models.PIPELINES.loaded == models.LoadSpec(**TINY)
    image, latent = run_node("Krea2Sampler", pipeline=tiny_model, prompt="a red fox", negative_prompt="", width=64, height=48,
                             steps=2, guidance=-1.0, seed=3, batch_size=2)
    assert image.dtype == torch.float32 and image.shape == (2, 48, 64, 3)
    assert 0 <= image.min() and image.max() <= 1 and image.std() > 0
    assert latent["samples"].shape == (2, 16, 1, 6, 8)  # ComfyUI's 5-D layout for the Qwen-Image VAE
    # Image i of a batch uses seed + i.
    (second,), _ = run_node("Krea2Sampler", pipeline=tiny_model, prompt="a red fox", negative_prompt="", width=64, height=48,
                            steps=2, guidance=-1.0, seed=4, batch_size=1)
    torch.testing.assert_close(second, image[1], atol=1e-5, rtol=0)
    # The LATENT is in the VAE's own space: decoding it the way ComfyUI's VAE Decode does gives the IMAGE.
    vae = tiny_model.pipeline().vae
    with torch.no_grad():
        decoded = vae.decode(latent["samples"], return_dict=False)[0][:, :, 0]
    torch.testing.assert_close(((decoded.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1), image, atol=1e-5, rtol=0)


def test_loader_reads_diffusers_folders_and_single_files(models_dir, tiny_model):
    """The tiny pipeline saved the ways users keep Krea 2 in ComfyUI's folders loads back to the same images."""
    from krea2_diffusers import convert_diffusers_to_original
    from krea2_diffusers.files import save_safetensors

    tiny = tiny_model.pipeline()
    tiny.save_pretrained(models_dir / "diffusers" / "tiny-krea2")
    tiny.text_encoder.save_pretrained(models_dir / "text_encoders" / "tiny-qwen3-vl")
    tiny.vae.save_pretrained(models_dir / "vae" / "tiny-qwen-image-vae")
    save_safetensors(convert_diffusers_to_original(tiny.transformer.state_dict()), models_dir / "diffusion_models" / "tiny-turbo.safetensors")

    def sample(model):
        return run_node("Krea2Sampler", pipeline=model, prompt="a fox", negative_prompt="", width=32, height=32,
                        steps=2, guidance=0.0, seed=1, batch_size=1)[0]

    expected = sample(tiny_model)
    (folder,) = run_node("Krea2ModelLoader", **{**TINY, "model": "diffusers/tiny-krea2"})
    torch.testing.assert_close(sample(folder), expected, atol=1e-5, rtol=0)
    (single,) = run_node("Krea2ModelLoader", **{**TINY, "model": "tiny-turbo.safetensors", "variant": "auto",
                                               "text_encoder": "tiny-qwen3-vl", "vae": "tiny-qwen-image-vae"})
    assert single.pipeline().is_distilled  # auto: the file name says turbo
    torch.testing.assert_close(sample(single), expected, atol=1e-5, rtol=0)


def test_loaded_pipeline_is_cached_and_freed_on_request(tiny_model):
    pipe = tiny_model.pipeline()
    (again,) = run_node("Krea2ModelLoader", **TINY)
    assert again.pipeline() is pipe  # a second queue run does not reload
    models.PIPELINES.free()
    assert models.PIPELINES.loaded is None
    reloaded = again.pipeline()  # a node output cached by ComfyUI reloads what was freed
    assert reloaded is not pipe and models.PIPELINES.loaded == again.spec


def test_style_references_chain():
    red = torch.zeros(2, 8, 8, 3)
    red[..., 0] = 1
    (refs,) = run_node("Krea2StyleReference", image=red, strength=0.8)
    (refs,) = run_node("Krea2StyleReference", image=torch.ones(1, 8, 8, 1), strength=0.3, style_refs=refs)
    assert [strength for _, strength in refs] == [0.8, 0.8, 0.3]
    assert refs[0][0].mode == "RGB" and refs[0][0].getpixel((0, 0)) == (255, 0, 0)
    assert refs[2][0].getpixel((7, 7)) == (255, 255, 255)


def test_sampler_with_style_references(tiny_model):
    red = torch.zeros(1, 32, 32, 3)
    red[..., 0] = 1
    noise = torch.rand(1, 40, 48, 3, generator=torch.Generator().manual_seed(0))

    def sample(style_refs=()):
        optional = {"style_refs": style_refs, "style_mode": "reference"} if style_refs else {}
        return run_node("Krea2Sampler", pipeline=tiny_model, prompt="a fox", negative_prompt="", width=32, height=32,
                        steps=2, guidance=0.0, seed=0, batch_size=1, **optional)[0]

    (refs,) = run_node("Krea2StyleReference", image=red, strength=1.0)
    (refs,) = run_node("Krea2StyleReference", image=noise, strength=0.5, style_refs=refs)
    (off,) = run_node("Krea2StyleReference", image=red, strength=0.0)
    plain = sample()
    assert (sample(refs) - plain).abs().max() > 1e-4  # the references steer the image
    torch.testing.assert_close(sample(off), plain, atol=0, rtol=0)  # strength 0 removes a reference exactly


def test_sampler_with_reference_images_is_the_pipelines(tiny_model):
    """Native IMAGEs -> Krea 2 Reference Image -> Sampler: the pipeline's reference_images, both methods."""
    pixels = torch.rand(1, 48, 80, 3, generator=torch.Generator().manual_seed(0))
    (refs,) = run_node("Krea2ReferenceImage", image=pixels, strength=1.0)
    (refs,) = run_node("Krea2ReferenceImage", image=pixels[:, :32, :32], strength=0.5, references=refs)
    pipe = tiny_model.pipeline()
    args = dict(pipeline=tiny_model, prompt="make it red", negative_prompt="", width=32, height=32, steps=2, guidance=0.0,
                seed=0, batch_size=1)
    images = comfy_bridge.comfy_to_pil(pixels) + comfy_bridge.comfy_to_pil(pixels[:, :32, :32])
    for method in ("index_timestep_zero", "index"):
        (image, _) = run_node("Krea2Sampler", references=refs, reference_method=method, **args)
        with torch.inference_mode():
            expected = pipe("make it red", height=32, width=32, num_inference_steps=2, guidance_scale=0.0, output_type="np",
                            generator=[torch.Generator().manual_seed(0)], reference_images=images,
                            reference_strengths=[1.0, 0.5], reference_method=method).images
        torch.testing.assert_close(image, torch.from_numpy(expected), atol=0, rtol=0)
    assert (image - run_node("Krea2Sampler", **args)[0]).abs().max() > 1e-4


def test_lora_loader_stacks_without_touching_the_pipeline(models_dir, tiny_model):
    (one,) = run_node("Krea2LoraLoader", pipeline=tiny_model, lora_name="krea2-style-lora.safetensors", strength=0.7)
    (two,) = run_node("Krea2LoraLoader", pipeline=one, lora_name="krea2-style-lora.safetensors", strength=0.5)
    (same,) = run_node("Krea2LoraLoader", pipeline=two, lora_name="krea2-style-lora.safetensors", strength=0.0)
    path = str(models_dir / "loras" / "krea2-style-lora.safetensors")
    assert same == two and two.loras == ((path, 0.7), (path, 0.5)) and tiny_model.loras == ()
    assert two.spec == tiny_model.spec


def write_lora(path: Path, transformer, seed: int, modules=("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.down")):
    """A small diffusers-format LoRA for the tiny transformer."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in modules:
        out_features, in_features = transformer.get_submodule(name).weight.shape
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(4, in_features, generator=generator) * 0.5
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(out_features, 4, generator=generator) * 0.5
    save_file(tensors, str(path))


def test_lora_nodes_change_the_image_and_come_off_again(models_dir, tiny_model):
    transformer = tiny_model.pipeline().transformer
    write_lora(models_dir / "loras" / "a.safetensors", transformer, seed=1)
    write_lora(models_dir / "loras" / "b.safetensors", transformer, seed=2)

    def sample(model):
        return run_node("Krea2Sampler", pipeline=model, prompt="a fox", negative_prompt="", width=32, height=32,
                        steps=2, guidance=0.0, seed=0, batch_size=1)[0]

    plain = sample(tiny_model)
    (with_a,) = run_node("Krea2LoraLoader", pipeline=tiny_model, lora_name="a.safetensors", strength=1.0)
    (with_ab,) = run_node("Krea2LoraLoader", pipeline=with_a, lora_name="b.safetensors", strength=0.5)
    (with_a_half,) = run_node("Krea2LoraLoader", pipeline=tiny_model, lora_name="a.safetensors", strength=0.5)
    images = {name: sample(model) for name, model in [("a", with_a), ("ab", with_ab), ("a_half", with_a_half)]}
    for name, image in images.items():
        assert (image - plain).abs().max() > 1e-3, f"LoRA {name} changed nothing"
    assert (images["a"] - images["ab"]).abs().max() > 1e-3 and (images["a"] - images["a_half"]).abs().max() > 1e-3
    torch.testing.assert_close(sample(tiny_model), plain, atol=1e-6, rtol=0)  # the LoRAs come off again


def test_choices_match_the_library():
    from krea2_diffusers.conditioning.expander import CREATIVITY_LEVELS
    from krea2_diffusers.pipelines.memory import MEMORY_PRESETS
    from krea2_diffusers.conditioning.style import STYLE_MODES
    from krea2_diffusers.presets import REFERENCE_METHODS

    assert nodes.CREATIVITY == list(CREATIVITY_LEVELS) and nodes.STYLE_MODES == tuple(STYLE_MODES)
    assert nodes.REFERENCE_METHODS == REFERENCE_METHODS
    assert declared_inputs(nodes.Krea2ModelLoader)["memory"][0] == list(MEMORY_PRESETS)


def test_prompt_expander_node(tiny_model):
    (same,) = run_node("Krea2PromptExpander", pipeline=tiny_model, prompt="a fox", creativity="raw", seed=0, max_new_tokens=4)
    assert same == "a fox"
    (expanded,) = run_node("Krea2PromptExpander", pipeline=tiny_model, prompt="a fox", creativity="medium", seed=5, max_new_tokens=4)
    with torch.inference_mode():
        direct = tiny_model.pipeline().expand_prompt("a fox", creativity="medium", seed=5, max_new_tokens=4)
    assert isinstance(expanded, str) and expanded == direct and expanded != "a fox"


# ----------------------------------------------------------------------------- inside ComfyUI (faked runtime)
class Interrupted(Exception):
    pass


@pytest.fixture()
def fake_comfyui(monkeypatch, tmp_path):
    """Minimal stand-ins for ComfyUI's folder_paths, comfy.utils and comfy.model_management."""
    state = types.SimpleNamespace(progress=[], interrupt_after=None, steps_seen=0, unloaded=0)

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None, preview=None):
            state.progress.append((value, total or self.total))

    def throw_exception_if_processing_interrupted():
        state.steps_seen += 1
        if state.interrupt_after is not None and state.steps_seen > state.interrupt_after:
            raise Interrupted()

    def unload_all_models():
        state.unloaded += 1

    folder_paths = types.SimpleNamespace(models_dir=str(tmp_path), get_folder_paths=lambda kind: [str(tmp_path / "comfy" / kind)])
    management = types.SimpleNamespace(get_torch_device=lambda: torch.device("cpu"), unload_all_models=unload_all_models,
                                       soft_empty_cache=lambda: None,
                                       throw_exception_if_processing_interrupted=throw_exception_if_processing_interrupted)
    comfy = types.ModuleType("comfy")
    comfy.utils, comfy.model_management = types.SimpleNamespace(ProgressBar=ProgressBar), management
    for name, module in {"folder_paths": folder_paths, "comfy": comfy, "comfy.utils": comfy.utils,
                         "comfy.model_management": management}.items():
        monkeypatch.setitem(sys.modules, name, module)
    importlib.reload(comfy_bridge)
    comfy_bridge.on_unload_models(models.PIPELINES.free)
    state.management = management
    yield state
    monkeypatch.undo()
    importlib.reload(comfy_bridge)


def test_comfyui_progress_bar_advances_per_step(fake_comfyui, tiny_model):
    run_node("Krea2Sampler", pipeline=tiny_model, prompt="x", negative_prompt="", width=32, height=32,
             steps=0, guidance=0.0, seed=0, batch_size=1)
    assert fake_comfyui.progress == [(i, 8) for i in range(1, 9)]  # steps=0: the Turbo preset's 8 steps


def test_comfyui_interrupt_stops_sampling(fake_comfyui, tiny_model):
    fake_comfyui.interrupt_after = 2
    with pytest.raises(Interrupted):
        run_node("Krea2Sampler", pipeline=tiny_model, prompt="x", negative_prompt="", width=32, height=32,
                 steps=6, guidance=0.0, seed=0, batch_size=1)
    assert fake_comfyui.progress == [(1, 6), (2, 6)]


def test_comfyui_unload_models_button_frees_the_pipeline(fake_comfyui, tiny_model):
    tiny_model.pipeline()
    fake_comfyui.management.unload_all_models()
    assert fake_comfyui.unloaded == 1 and models.PIPELINES.loaded is None
    tiny_model.pipeline()  # loading Krea 2 asks ComfyUI to unload its own models first
    assert fake_comfyui.unloaded == 2 and models.PIPELINES.loaded == tiny_model.spec


def test_comfyui_model_folders_are_used(fake_comfyui, tmp_path):
    lora = tmp_path / "comfy" / "loras" / "styles" / "ink.safetensors"
    lora.parent.mkdir(parents=True)
    lora.write_bytes(b"")
    assert models.list_files("loras") == {"styles/ink.safetensors": lora}


# ----------------------------------------------------------------------------- example workflows
def node_schema(class_type):
    if class_type in CORE:
        inputs, outputs, is_output = CORE[class_type]
        return inputs, outputs, is_output
    node_class = comfy_nodes.NODE_CLASS_MAPPINGS[class_type]
    return node_class.INPUT_TYPES(), node_class.RETURN_TYPES, getattr(node_class, "OUTPUT_NODE", False)


def validate_api_workflow(workflow: dict):
    """What ComfyUI's /prompt checks: known nodes, complete inputs, typed links, valid widget values, an output."""
    outputs = []
    for node_id, node in workflow.items():
        spec, _, is_output = node_schema(node["class_type"])
        declared = {**spec["required"], **spec.get("optional", {})}
        assert set(spec["required"]) <= set(node["inputs"]) <= set(declared), (node_id, node["inputs"].keys())
        for name, value in node["inputs"].items():
            if isinstance(value, list):  # a link: [source node id, output slot]
                source = workflow[value[0]]
                source_type = node_schema(source["class_type"])[1][value[1]]
                expected = "STRING" if declared[name][0] == "STRING" else declared[name][0]
                assert source_type == expected, f"node {node_id}.{name}: {source_type} into {expected}"
            else:
                assert is_widget(declared[name]), f"node {node_id}.{name} must be connected"
                check_widget(node["class_type"], name, declared[name], value)
        outputs += [node_id] if is_output else []
    assert outputs, "no output node"
    seen, order = set(), []  # acyclic

    def visit(node_id, path=()):
        assert node_id not in path, f"cycle through {node_id}"
        if node_id not in seen:
            for value in workflow[node_id]["inputs"].values():
                if isinstance(value, list):
                    visit(value[0], path + (node_id,))
            seen.add(node_id)
            order.append(node_id)

    for node_id in outputs:
        visit(node_id)


def ui_to_api(workflow: dict) -> dict:
    """Convert a saved (UI format) workflow the way the ComfyUI frontend queues it."""
    links = {row[0]: row for row in workflow["links"]}
    for link_id, source, source_slot, target, target_slot, kind in workflow["links"]:
        nodes_by_id = {n["id"]: n for n in workflow["nodes"]}
        assert link_id in nodes_by_id[source]["outputs"][source_slot]["links"]
        assert nodes_by_id[target]["inputs"][target_slot]["link"] == link_id
        assert nodes_by_id[source]["outputs"][source_slot]["type"] == kind
    api = {}
    for node in workflow["nodes"]:
        spec, _, _ = node_schema(node["type"])
        declared = {**spec["required"], **spec.get("optional", {})}
        values = iter(node["widgets_values"])
        inputs = {}
        for name, input_spec in declared.items():
            if is_widget(input_spec):
                inputs[name] = next(values)
                if input_spec[1].get("control_after_generate"):
                    assert next(values) in ("fixed", "increment", "decrement", "randomize")
                if input_spec[1].get("image_upload"):
                    next(values)
        assert next(values, None) is None, f"node {node['id']}: too many widget values"
        for slot in node["inputs"]:
            if slot["link"] is not None:
                row = links[slot["link"]]
                inputs[slot["name"]] = [str(row[1]), row[2]]
            else:
                assert slot["name"] in spec.get("optional", {}), f"node {node['id']}: {slot['name']} is not connected"
        api[str(node["id"])] = {"inputs": inputs, "class_type": node["type"]}
    return api


@pytest.mark.parametrize("name", ["krea2_turbo_text_to_image", "krea2_raw_lora", "krea2_style_references", "krea2_prompt_expander"])
def test_example_workflow_is_valid(models_dir, name):
    api = json.loads((WORKFLOWS / f"{name}.api.json").read_text())
    validate_api_workflow(api)
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    assert ui_to_api(ui) == {k: {"inputs": v["inputs"], "class_type": v["class_type"]} for k, v in api.items()}


def test_validator_rejects_a_broken_workflow(models_dir):
    api = json.loads((WORKFLOWS / "krea2_style_references.api.json").read_text())
    api["6"]["inputs"]["style_refs"] = ["2", 0]  # an IMAGE where style references belong
    with pytest.raises(AssertionError, match="IMAGE into KREA2_STYLE_REFS"):
        validate_api_workflow(api)
    api = json.loads((WORKFLOWS / "krea2_turbo_text_to_image.api.json").read_text())
    api["2"]["inputs"]["width"] = 1000  # not a multiple of 16
    with pytest.raises(AssertionError, match="not on its step"):
        validate_api_workflow(api)


def test_sampler_latent_input_4d_or_5d_mask_and_bad_latents(tiny_model):
    """Native VAEEncode gives 5-D latents, older graphs 4-D: the same image; a SetLatentNoiseMask-style
    ``noise_mask`` works like the mask input; other channel counts are refused naming the shape."""
    raw = torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(0))

    def sample(latent, **kwargs):
        return run_node("Krea2Sampler", pipeline=tiny_model, prompt="a fox", negative_prompt="", width=512, height=512,
                        steps=2, guidance=0.0, seed=1, batch_size=1, latent=latent, **kwargs)

    five, latent_out = sample({"samples": raw}, denoise=0.5)
    four, _ = sample({"samples": raw[:, :, 0]}, denoise=0.5)
    assert five.shape == (1, 32, 48, 3) and latent_out["samples"].shape == (1, 16, 1, 4, 6)
    torch.testing.assert_close(four, five, rtol=0, atol=0)
    mask = torch.zeros(1, 32, 48)
    mask[:, :, 24:] = 1
    masked, _ = sample({"samples": raw}, denoise=0.5, mask=mask)
    noise_masked, _ = sample({"samples": raw, "noise_mask": mask})
    assert (masked - five).abs().max() > 1e-3
    assert noise_masked.shape == masked.shape
    with pytest.raises(ValueError, match=r"latent input: shape \(1, 4, 4, 6\) is not \(B, 16"):
        sample({"samples": torch.zeros(1, 4, 4, 6)})
