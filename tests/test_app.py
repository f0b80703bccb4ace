"""The Gradio demo: its logic (app.Demo, krea2_diffusers.limits), its /generate API through gradio_client, and a
real browser (Debian chromium driven by Playwright) generating an image on tiny-random.

The server is ``python app.py --model tiny-random --runs-dir RUNS`` on 127.0.0.1, as a user would start it
(conftest's ``app_server``, shared with tests/test_app_train.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.limits import MAX_SEED, InputError, Limits, Request, check
from krea2_diffusers.metadata import read_settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # app.py sits at the top level, next to the package
from app import Demo, parse_lora  # noqa: E402  (the demo's loading and generation live with its UI)

from conftest import CHROMIUM, CHROMIUM_ARGS  # noqa: E402

TEST_SIZE = "test · 64×64"


# ----------------------------------------------------------------------------- demo logic
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    base = Krea2Pipeline.from_pretrained("tiny-random")

    def load(model, is_distilled):  # Turbo and RAW share one set of tiny components
        assert model == "tiny-random"
        pipe = Krea2Pipeline(**base.components, is_distilled=is_distilled)
        pipe.label = base.label
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return Demo(Demo.variants_for("tiny-random"), load, tmp_path_factory.mktemp("png"), Limits(max_expansion_tokens=4), keep_files=3)


def test_generate_records_its_settings_in_the_png(demo):
    steps_seen = []
    result = demo.generate(Request("a red fox", variant="RAW", size=TEST_SIZE, steps=2, guidance=1.5, seed=7),
                           progress=lambda step, total: steps_seen.append((step, total)))
    assert steps_seen == [(1, 2), (2, 2)]
    assert result.image.size == (64, 64)
    settings = read_settings(result.png_path)
    assert settings == result.settings
    assert settings["steps"] == 2 and settings["guidance_scale"] == 1.5 and settings["seed"] == 7
    assert settings["variant"] == "RAW" and "RANDOM WEIGHTS" in settings["model"]
    assert np.array_equal(np.asarray(Image.open(result.png_path).convert("RGB")), np.asarray(result.image))


def test_turbo_and_raw_use_their_presets(demo):
    turbo = demo.generate(Request("x", variant="Turbo", size=TEST_SIZE))
    assert (turbo.settings["steps"], turbo.settings["guidance_scale"]) == (8, 0.0)
    assert demo.pipeline("Turbo").is_distilled and not demo.pipeline("RAW").is_distilled
    assert (demo.preset("RAW").num_inference_steps, demo.preset("RAW").guidance_scale) == (52, 3.5)


def test_same_seed_same_image_and_old_pngs_are_pruned(demo):
    first = demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=11))
    again = demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=11))
    other = demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=12))
    assert np.array_equal(np.asarray(first.image), np.asarray(again.image))
    assert not np.array_equal(np.asarray(first.image), np.asarray(other.image))
    demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=13))
    assert len(list(demo.output_dir.glob("krea2-*.png"))) == 3


def test_creativity_expands_the_prompt_and_records_it(demo):
    result = demo.generate(Request("a fox", size=TEST_SIZE, steps=1, seed=9, creativity="medium"))
    expected = demo.pipeline("Turbo").expand_prompt("a fox", creativity="medium", seed=9, max_new_tokens=4)
    assert result.expanded_prompt == expected != "a fox"
    assert read_settings(result.png_path)["expanded_prompt"] == expected
    assert result.settings["creativity"] == "medium" and result.settings["prompt"] == "a fox"


def test_style_references_reach_the_pipeline(demo):
    red = Image.new("RGB", (32, 32), (255, 0, 0))
    plain = demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=3))
    styled = demo.generate(Request("x", size=TEST_SIZE, steps=1, seed=3, style_images=[red], style_strengths=[1.0],
                                   style_mode="reference"))
    assert not np.array_equal(np.asarray(plain.image), np.asarray(styled.image))
    assert styled.settings["style_strengths"] == [1.0] and styled.settings["style_mode"] == "reference"


def test_a_trained_lora_used_in_generate_changes_the_image_and_is_recorded(demo, tmp_path):
    from krea2_diffusers.loaders.lora import LoraLayer, save_lora_file

    linear = dict(demo.pipeline("RAW").transformer.named_modules())
    shapes = {m: (getattr(linear[m], "base_layer", linear[m]).in_features, getattr(linear[m], "base_layer", linear[m]).out_features)
              for m in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.down")}

    def lora_file(name: str, seed: int) -> Path:
        generator = torch.Generator().manual_seed(seed)
        layers = {m: LoraLayer(torch.randn(2, i, generator=generator), torch.randn(o, 2, generator=generator))
                  for m, (i, o) in shapes.items()}
        return save_lora_file(tmp_path / name, layers, "diffusers", {"format": "pt"})

    request = Request("a fox", variant="RAW", size=TEST_SIZE, steps=1, seed=4)
    plain = demo.generate(request)
    demo.use_lora(lora_file("first.safetensors", 0))
    first = demo.generate(request)
    demo.use_lora(lora_file("second.safetensors", 1))  # replaces the first: one trained adapter at a time
    second = demo.generate(request)
    assert list(demo.pipeline("RAW").transformer.peft_config) == [Demo.TRAINED_ADAPTER]
    images = [np.asarray(r.image) for r in (plain, first, second)]
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])
    assert read_settings(second.png_path)["loras"] == [{"file": str(tmp_path / "second.safetensors"), "strength": 1.0}]


@pytest.mark.parametrize("change, message", [
    (dict(prompt="   "), "Please enter a prompt"),
    (dict(prompt="x" * 2001), "limit is 2000"),
    (dict(size="1:1 · 2048×2048"), "too large"),
    (dict(size="999x999"), "Unknown size"),
    (dict(variant="Lightning"), "not loaded"),
    (dict(steps=0), "Steps must be between 1 and 100"),
    (dict(guidance=-1.0), "Guidance must be between 0"),
    (dict(seed=MAX_SEED + 1), "seed must be between"),
    (dict(creativity="wild"), "Creativity must be one of"),
    (dict(style_images=[Image.new("RGB", (8, 8))] * 5, style_strengths=[1.0] * 5), "At most 4 style references"),
    (dict(style_images=[Image.new("RGB", (8, 8))], style_strengths=[1.0], style_mode="copy"), "Style mode must be"),
    (dict(style_images=[Image.new("RGB", (8, 8))], style_strengths=[]), "exactly one strength"),
])
def test_bad_input_gets_a_friendly_message(change, message, tmp_path):
    request = Request("a fox", size="1:1 · 1024×1024")
    for key, value in change.items():
        setattr(request, key, value)
    with pytest.raises(InputError, match=message):
        check(request, Limits(max_side=1536), Demo(Demo.variants_for("tiny-random"), None, tmp_path).sizes,
              {"Turbo": "tiny-random"})


def test_reference_count_and_strength_limits():
    sizes = {"s": (64, 64)}
    images = [Image.new("RGB", (8, 8))] * 3
    with pytest.raises(InputError, match="At most 2 style references"):
        check(Request("x", size="s", style_images=images, style_strengths=[1.0] * 3), Limits(max_references=2), sizes, {"Turbo": 0})
    with pytest.raises(InputError, match="0 or more"):
        check(Request("x", size="s", style_images=images[:1], style_strengths=[-0.5]), Limits(), sizes, {"Turbo": 0})
    assert check(Request("x", size="s", style_images=images, style_strengths=[0.2, 0, 2]), Limits(), sizes, {"Turbo": 0}) == (64, 64)


def test_lora_argument():
    assert parse_lora("loras/style.safetensors") == ("loras/style.safetensors", 1.0)
    assert parse_lora("loras/style.safetensors:0.6") == ("loras/style.safetensors", 0.6)
    assert parse_lora(r"C:\loras\style.safetensors") == (r"C:\loras\style.safetensors", 1.0)


def test_model_choices():
    assert Demo.variants_for("tiny-random") == {"Turbo": "tiny-random", "RAW": "tiny-random"}
    assert Demo.variants_for("models/krea-2-turbo.safetensors", "models/krea-2-raw.safetensors") == {
        "Turbo": "models/krea-2-turbo.safetensors", "RAW": "models/krea-2-raw.safetensors"}
    assert Demo.variants_for("models/krea2.gguf") == {"RAW": "models/krea2.gguf"}
    assert Demo.variants_for("models/krea2.gguf", is_distilled=True) == {"Turbo": "models/krea2.gguf"}
    assert Demo.variants_for("models/fast.gguf", "models/base.gguf") == {"Turbo": "models/fast.gguf", "RAW": "models/base.gguf"}


# ----------------------------------------------------------------------------- the running app
@pytest.fixture(scope="module")
def app_url(app_server):
    return app_server.url


def test_generate_endpoint_with_gradio_client(app_url, tmp_path):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(app_url, verbose=False, download_files=str(tmp_path))
    assert [p["parameter_name"] for p in client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]][:2] == ["prompt", "negative_prompt"]
    image, png, settings, expanded, seed = client.predict("a red fox in snow", size=TEST_SIZE, seed=5, randomize_seed=False,
                                                          steps=2, api_name="/generate")
    assert seed == 5 and settings["seed"] == 5 and settings["steps"] == 2 and settings["prompt"] == "a red fox in snow"
    assert Image.open(image).size == (64, 64)
    assert read_settings(image) == settings == read_settings(png)  # the shown image itself carries its settings
    with pytest.raises(AppError, match="Please enter a prompt"):
        client.predict("", api_name="/generate")
    with pytest.raises(AppError, match="500 is greater than maximum value 100|Steps must be between"):
        client.predict("a fox", steps=500, api_name="/generate")


def test_browser_generates_an_image(app_url, tmp_path):
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/install_browser.sh")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(app_url, wait_until="domcontentloaded")
            page.locator("#prompt textarea").fill("a red fox asleep in fresh snow")
            page.locator("#generate").click()
            result = page.locator("#result img")
            result.wait_for(state="visible", timeout=60_000)
            src = result.get_attribute("src")
            assert src and src.endswith(".png")
            page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
            # The image shown is the PNG with settings: fetch it back through the browser.
            response = page.request.get(src)
            assert response.ok
            (tmp_path / "shown.png").write_bytes(response.body())
            assert read_settings(tmp_path / "shown.png")["prompt"] == "a red fox asleep in fresh snow"
            assert "RANDOM WEIGHTS" in page.content()
        finally:
            browser.close()


def test_demo_logic_lives_with_the_app_not_in_the_library():
    import krea2_diffusers

    assert not (Path(krea2_diffusers.__file__).parent / "demo.py").exists()
    assert Demo.__module__ == "app" and Request.__module__ == "krea2_diffusers.limits"
