"""The node pack inside a REAL ComfyUI server (0.29.0, CPU), driven over HTTP as a user's browser does.

The server is the session's ``comfyui`` fixture (``comfyui_harness``: built by ``.ci/run``, named
by ``$KREA2_COMFYUI_DIR``). Without it (a plain clone) the module is skipped, saying so.

Models are tiny and random, written as the single files ComfyUI users hold: the Qwen3-VL text
encoder in Hugging Face layout in ``models/text_encoders`` and the Qwen-Image VAE in Wan 2.1 layout
in ``models/vae`` (loaded by both our loader and ComfyUI's native VAELoader).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from comfyui_harness import HARNESS, NO_HARNESS, REPO

pytestmark = pytest.mark.skipif(not HARNESS, reason=NO_HARNESS)

EXAMPLES = REPO / "examples" / "comfyui"
TE_FILE, VAE_FILE = "qwen3vl_4b_tiny.safetensors", "qwen_image_vae_tiny.safetensors"
SIZE, STEPS = 64, 2
# One 8-bit level: our IMAGE and native VAEDecode's run the same weights through two implementations.
PIXEL_TOLERANCE = 1


def _write_models(base: Path) -> None:
    """Tiny-random text encoder, a ComfyUI-shaped VAE (dim_mult 1,2,4,4; 2 res blocks, as its VAELoader
    builds), two LoRAs and two input images."""
    from diffusers import AutoencoderKLQwenImage

    from krea2_diffusers.files import save_safetensors
    from krea2_diffusers.loaders.text_encoder import text_encoder_state_dict
    from krea2_diffusers.loaders.vae import save_wan_vae
    from krea2_diffusers.models.tiny import TEXT_HIDDEN, randomize_, tiny_components, tiny_transformer_config

    parts = tiny_components(seed=5)
    save_safetensors(text_encoder_state_dict(parts["text_encoder"]), base / "models" / "text_encoders" / TE_FILE)
    torch.manual_seed(5)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    randomize_(vae, torch.Generator().manual_seed(5))
    save_wan_vae(vae, base / "models" / "vae" / VAE_FILE)
    config = tiny_transformer_config()
    dim = config["attention_head_dim"] * config["num_attention_heads"]
    assert config["text_hidden_dim"] == TEXT_HIDDEN
    for name in ("krea2-style-lora.safetensors", "krea2_style_reference.safetensors"):
        generator = torch.Generator().manual_seed(len(name))
        save_safetensors({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, dim, generator=generator) * 0.1,
                          "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(dim, 4, generator=generator) * 0.1},
                         base / "models" / "loras" / name)
    (base / "input").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("style_ref_1.png", "style_ref_2.png", "photo.png"):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE + 32, 3), dtype=np.uint8)).save(base / "input" / name)


@pytest.fixture(scope="module")
def server(comfyui):
    """The session's ComfyUI with this module's models; the node list read again to show them."""
    _write_models(comfyui.base)
    comfyui.object_info = comfyui.get("/object_info")
    return comfyui


def tiny_loader(**overrides) -> dict:
    inputs = {"model": "tiny-random", "variant": "turbo", "text_encoder": TE_FILE, "vae": VAE_FILE,
              "dtype": "float32", "memory": "high", **overrides}
    return {"class_type": "Krea2ModelLoader", "inputs": inputs}


def sampler(pipeline, **overrides) -> dict:
    inputs = {"pipeline": pipeline, "prompt": "a red fox", "negative_prompt": "", "width": SIZE, "height": SIZE,
              "steps": STEPS, "guidance": 0.0, "seed": 3, "batch_size": 1, **overrides}
    return {"class_type": "Krea2Sampler", "inputs": inputs}


def save(images, prefix) -> dict:
    return {"class_type": "SaveImage", "inputs": {"images": images, "filename_prefix": prefix}}


def test_pack_imports_and_offers_comfyuis_single_files(server):
    info = server.object_info
    assert {"Krea2ModelLoader", "Krea2LoraLoader", "Krea2PromptExpander", "Krea2StyleReference", "Krea2Sampler"} <= set(info)
    assert "IMPORT FAILED" not in server.tail()
    required = info["Krea2ModelLoader"]["input"]["required"]
    assert TE_FILE in required["text_encoder"][0] and required["text_encoder"][1]["default"] == TE_FILE
    assert VAE_FILE in required["vae"][0] and required["vae"][1]["default"] == VAE_FILE
    optional = info["Krea2Sampler"]["input"]["optional"]
    assert optional["latent"][0] == "LATENT" and optional["mask"][0] == "MASK"
    assert (optional["denoise"][1]["min"], optional["denoise"][1]["max"]) == (0.0, 1.0)


@pytest.mark.parametrize("name", sorted(p.name.removesuffix(".api.json") for p in EXAMPLES.glob("*.api.json")))
def test_example_workflow_runs(server, name):
    """Every shipped API workflow, patched to the tiny model, small sizes and few steps."""
    graph = json.loads((EXAMPLES / f"{name}.api.json").read_text())
    for node in graph.values():
        inputs = node["inputs"]
        if node["class_type"] == "Krea2ModelLoader":
            inputs.update(tiny_loader()["inputs"])
        elif node["class_type"] == "Krea2Sampler":
            inputs.update(width=SIZE, height=SIZE, steps=STEPS)
        elif node["class_type"] == "Krea2PromptExpander":
            inputs.update(max_new_tokens=4)
    saves = [node_id for node_id, node in graph.items() if node["class_type"] == "SaveImage"]
    entry = server.run(graph)
    for node_id in saves:
        (image,) = server.images(entry, node_id)
        assert image.shape == (SIZE, SIZE, 3) and image.std() > 0


def test_native_vae_nodes_around_the_sampler(server):
    """Our LATENT through native VAEDecode is our IMAGE; native LoadImage -> VAEEncode feeds img2img."""
    graph = {
        "1": tiny_loader(),
        "2": sampler(["1", 0]),
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 1], "vae": ["3", 0]}},
        "5": save(["2", 0], "ours"),
        "6": save(["4", 0], "native_decode"),
        "7": {"class_type": "LoadImage", "inputs": {"image": "photo.png"}},
        "8": {"class_type": "VAEEncode", "inputs": {"pixels": ["7", 0], "vae": ["3", 0]}},
        "9": sampler(["1", 0], latent=["8", 0], denoise=0.5),
        "10": save(["9", 0], "img2img"),
        "11": sampler(["1", 0], latent=["8", 0], denoise=0.0),
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "13": save(["11", 0], "denoise0"),
        "14": save(["12", 0], "native_roundtrip"),
        "15": sampler(["1", 0], latent=["8", 0], denoise=1.0),
        "16": save(["15", 0], "img2img_full"),
    }
    entry = server.run(graph)
    (ours,), (native,) = server.images(entry, "5"), server.images(entry, "6")
    assert ours.std() > 0 and np.abs(ours - native).max() <= PIXEL_TOLERANCE
    # img2img takes its size from the encoded image (64 x 96), not from width/height
    (half,), (full,) = server.images(entry, "10"), server.images(entry, "16")
    assert half.shape == full.shape == (SIZE, SIZE + 32, 3)
    assert np.abs(half - full).mean() > 1  # denoise changes how much of the image is kept
    # denoise 0 returns the encoded image itself: what native VAEDecode makes of it
    (kept,), (roundtrip,) = server.images(entry, "13"), server.images(entry, "14")
    assert np.abs(kept - roundtrip).max() <= PIXEL_TOLERANCE
