"""The speed knobs where users are: ``krea2 generate --cache NAME --cache-threshold X --compile
--guidance-interval LO HI``, the ComfyUI ``Krea 2 Cache`` node and the Sampler's guidance interval
(driven as ComfyUI drives nodes, and in a real ComfyUI when the harness is there), and the app's
Speed controls (its Demo logic and the /generate API)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import krea2_diffusers.caching.apply
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.caching.forwards import ForwardCounter
from krea2_diffusers.cli import main
from krea2_diffusers.limits import Limits, Request
from krea2_diffusers.metadata import read_settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from app import Demo  # noqa: E402

from comfyui_harness import HARNESS, NO_HARNESS  # noqa: E402
from test_comfy_nodes import TINY, declared_inputs, run_node  # noqa: E402  (ComfyUI's validation, without ComfyUI)


def pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


# ----------------------------------------------------------------------------- krea2 generate
def test_generate_with_cache_compile_and_guidance_interval(tmp_path, monkeypatch, capsys):
    """--cache at threshold 0 gives the uncached image; the settings record the knobs; --compile compiles
    the pipeline's transformer (recorded here: the compiled blocks have their own test); bad values are refused."""
    compiled = []
    monkeypatch.setattr(krea2_diffusers.caching.apply, "compile_blocks", compiled.append)
    common = ["--model", "tiny-random", "--raw", "--steps", "3", "--width", "32", "--height", "32", "--guidance-interval", "0.3", "0.9"]
    assert main(["generate", "a fox", *common, "--output", str(tmp_path / "plain.png")]) == 0
    assert main(["generate", "a fox", *common, "--cache", "fbcache", "--cache-threshold", "0", "--compile",
                 "--output", str(tmp_path / "cached.png")]) == 0
    assert len(compiled) == 1 and type(compiled[0]).__name__ == "Krea2Transformer2DModel"
    assert np.array_equal(pixels(tmp_path / "plain.png"), pixels(tmp_path / "cached.png"))
    settings = read_settings(tmp_path / "cached.png")
    assert settings["cache"] == "fbcache" and settings["cache_threshold"] == 0.0 and settings["compiled_blocks"] is True
    assert settings["guidance_interval"] == [0.3, 0.9] and read_settings(tmp_path / "plain.png")["guidance_interval"] == [0.3, 0.9]
    assert main(["generate", "a fox", *common, "--cache", "dbcache", "--output", str(tmp_path / "db.png")]) == 0
    for argv, message in ((["--cache-threshold", "0.1"], "needs --cache"), (["--guidance-interval", "0.9", "0.1"], "guidance_interval"),
                          (["--cache", "taylorseer", "--cache-threshold", "2.5"], "whole number")):
        assert main(["generate", "a fox", "--width", "32", "--height", "32", *argv, "--output", str(tmp_path / "x.png")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- ComfyUI
def test_comfyui_cache_node_and_guidance_interval():
    from comfy_nodes import nodes
    from krea2_diffusers.presets import CACHE_METHODS

    assert nodes.CACHE_METHODS == CACHE_METHODS and declared_inputs(nodes.Krea2Cache)["cache"][0] == list(CACHE_METHODS)
    (model,) = run_node("Krea2ModelLoader", **dict(TINY, variant="raw"))
    pipe = model.pipeline()
    pipe.set_progress_bar_config(disable=True)
    sampler = dict(prompt="a red fox", negative_prompt="", width=32, height=32, steps=6, guidance=3.0, seed=1, batch_size=1,
                   guidance_interval_low=0.2, guidance_interval_high=0.9)

    def sample(pipeline):
        with ForwardCounter(pipe.transformer) as counter:
            image, _ = run_node("Krea2Sampler", pipeline=pipeline, **sampler)
        return image, counter.forwards

    plain, plain_forwards = sample(model)
    (never,) = run_node("Krea2Cache", pipeline=model, cache="fbcache", threshold=0.0)
    (often,) = run_node("Krea2Cache", pipeline=model, cache="fbcache", threshold=50.0)
    assert never.pipeline() is pipe and never.cache == ("fbcache", 0.0)
    same, forwards = sample(never)
    assert torch.equal(same, plain) and forwards == plain_forwards < 2 * 6  # the interval skipped uncond rows
    assert sample(often)[1] < plain_forwards
    assert not pipe.transformer.is_cache_enabled  # the cache applied to that Sampler run only
    (preset,) = run_node("Krea2Cache", pipeline=model, cache="magcache", threshold=-1.0)
    assert preset.cache == ("magcache", None) and sample(preset)[0].shape == plain.shape


@pytest.mark.skipif(not HARNESS, reason=NO_HARNESS)
def test_cache_node_in_a_real_comfyui(comfyui):
    """Loader -> Krea 2 Cache (threshold 0) -> Sampler with a guidance interval gives the uncached Sampler's image."""
    loader = {"class_type": "Krea2ModelLoader", "inputs": dict(TINY, variant="raw", text_encoder="tiny-random",
                                                               vae="tiny-random", memory="high")}
    sampler = lambda pipeline: {"class_type": "Krea2Sampler", "inputs": {
        "pipeline": pipeline, "prompt": "a red fox", "negative_prompt": "", "width": 32, "height": 32, "steps": 3,
        "guidance": 3.0, "seed": 2, "batch_size": 1, "guidance_interval_low": 0.2, "guidance_interval_high": 0.9}}
    save = lambda images, prefix: {"class_type": "SaveImage", "inputs": {"images": images, "filename_prefix": prefix}}
    graph = {"1": loader, "2": {"class_type": "Krea2Cache", "inputs": {"pipeline": ["1", 0], "cache": "fbcache", "threshold": 0.0}},
             "3": sampler(["2", 0]), "4": sampler(["1", 0]), "5": save(["3", 0], "cached"), "6": save(["4", 0], "plain")}
    entry = comfyui.run(graph)
    (cached,), (plain,) = comfyui.images(entry, "5"), comfyui.images(entry, "6")
    assert plain.std() > 0 and np.array_equal(cached, plain)


# ----------------------------------------------------------------------------- the app
@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_pipe):
    transformer = copy.deepcopy(tiny_pipe.transformer)  # the caches hook it, not the session's

    def load(model, is_distilled):
        pipe = Krea2Pipeline(**{**tiny_pipe.components, "transformer": transformer}, is_distilled=is_distilled)
        pipe.label = tiny_pipe.label
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return Demo(Demo.variants_for("tiny-random"), load, tmp_path_factory.mktemp("png"), Limits(), keep_files=5)


def test_app_speed_controls(demo, app_server, tmp_path):
    """The Demo: a cache at threshold 0 and the guidance interval as the UI sends them, recorded in the PNG;
    bad values refused. The /generate API takes the Speed controls by name."""
    from gradio_client import Client

    from krea2_diffusers.limits import InputError

    base = dict(prompt="a red fox", variant="RAW", size="test · 64×64", steps=3, guidance=3.0, seed=4, guidance_interval=(0.2, 0.9))
    plain = demo.generate(Request(**base))
    cached = demo.generate(Request(**base, cache="fbcache", cache_threshold=0.0))
    assert np.array_equal(np.asarray(plain.image), np.asarray(cached.image))
    assert cached.settings["cache"] == "fbcache" and cached.settings["guidance_interval"] == [0.2, 0.9]
    assert not demo.pipeline("RAW").transformer.is_cache_enabled
    for bad in (dict(cache="warp"), dict(guidance_interval=(0.8, 0.1)), dict(cache="fbcache", cache_threshold=-2)):
        with pytest.raises(InputError):
            demo.generate(Request(**{**base, **bad}))
    client = Client(app_server.url, verbose=False, download_files=str(tmp_path))
    names = [p["parameter_name"] for p in client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]]
    assert {"cache", "cache_threshold", "guidance_low", "guidance_high"} <= set(names)
    _, _, settings, _, _ = client.predict("a red fox", model="RAW", size="test · 64×64", steps=2, seed=5, randomize_seed=False,
                                          cache="taylorseer", guidance_low=0.1, guidance_high=0.8, api_name="/generate")
    assert settings["cache"] == "taylorseer" and settings["guidance_interval"] == [0.1, 0.8]
