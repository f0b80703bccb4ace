"""Issue 38 through the served app, started as its docstring shows it (relative paths):
``python app.py --model tiny-random --raw-model models/raw.safetensors ...`` inside a folder of its own.
A Train-tab start (``/train_start``) on relative image and regularisation folders trains the RAW file
and exports: every path reaches ``train.yaml`` absolute, and the regularisation share set with
``prior_share`` is what the trainer draws. The app's upload folder is its own: Gradio's shared
``<temp>/gradio`` is no data root.

Its own server (not conftest's ``app_server``): the point is the working directory it starts in.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import OFFLINE, free_port, running_app
from test_app_train import make_images

RUN_TIMEOUT_S = 600  # a busy 2-core machine: the krea2 train subprocess takes ~10-60 s


@pytest.fixture
def site(tmp_path):
    """An app started in ``tmp_path`` with relative paths; (folder, log, url)."""
    from krea2_diffusers.models.tiny import save_random_original_file, tiny_transformer_config

    (tmp_path / "models").mkdir()
    save_random_original_file(tmp_path / "models" / "raw.safetensors", tiny_transformer_config())
    port, log = free_port(), tmp_path / "app.log"
    env = {k: v for k, v in {**os.environ, **OFFLINE}.items() if k != "GRADIO_TEMP_DIR"}
    with running_app(["--model", "tiny-random", "--raw-model", "models/raw.safetensors", "--text-encoder", "tiny-random",
                      "--vae", "tiny-random", "--runs-dir", "runs", "--port", str(port), "--train-gpu-memory", "16"],
                     tmp_path, log, env):
        yield tmp_path, log, f"http://127.0.0.1:{port}"


def test_a_relative_raw_model_trains_from_the_train_tab_with_its_prior_share(site):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    folder, log, url = site
    make_images(folder / "images")
    make_images(folder / "reg", 4)
    for path in (folder / "reg").glob("*.png"):
        path.with_suffix(".txt").write_text("a photo of a thing")
    client = Client(url, verbose=False)

    # The roots: the runs folder's parent and a private upload folder, never Gradio's shared one.
    roots = re.search(r"Train tab data roots: (.*)", log.read_text())[1].split(", ")
    shared = Path(tempfile.gettempdir()).resolve() / "gradio"
    assert roots[0] == str(folder.resolve()) and len(roots) == 2 and Path(roots[1]).name.startswith("krea2-app-uploads-")
    planted = shared / f"krea2-test-{uuid.uuid4().hex}" / "upload.png"
    make_images(planted.parent, 1)
    try:
        with pytest.raises(AppError, match="The image of row 1 is outside the allowed data roots"):
            client.predict("", "48gb+", "", {"headers": ["image", "caption"], "data": [[str(planted.parent / "picture_0.png"), "c"]]},
                           api_name="/train_plan")
    finally:
        (planted.parent / "picture_0.png").unlink()
        planted.parent.rmdir()

    plan = json.loads(client.predict(images_folder="images", preset="48gb+", base_model="", regularization_folder="reg",
                                      prior_share=0.25, api_name="/train_plan"))
    assert plan["fits"], plan["plan"]
    assert "dataset images (8): 75.0% of samples" in plan["plan"]
    assert "dataset regularisation (4 images): 25.0% of samples" in plan["plan"]

    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    for endpoint in ("/train_plan", "/train_start"):  # the UI's slider, 0.5 unless moved
        assert {p["parameter_name"]: p for p in endpoints[endpoint]["parameters"]}["prior_share"]["parameter_default"] == 0.5
    # Out of range: Gradio's slider (0.05-0.95) refuses it before the tab's own check (0 < share < 1) runs.
    with pytest.raises(AppError, match="1.0 is greater than maximum value 0.95"):
        client.predict(images_folder="images", preset="48gb+", base_model="", trigger_word="acme", regularization_folder="reg",
                       prior_share=1.0, api_name="/train_start")
    run_id = client.predict(images_folder="images", preset="48gb+", base_model="", trigger_word="acme", steps=2,
                            sample_every=2, captions="trigger", regularization_folder="reg", prior_share=0.25,
                            api_name="/train_start")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (status := client.predict(run_id, api_name="/train_status"))["state"] == "running":
        assert time.monotonic() < deadline, (folder / "runs" / run_id / "train.log").read_text()[-3000:]
        time.sleep(1)
    run = folder / "runs" / run_id
    assert status["state"] == "done", (run / "train.log").read_text()[-3000:]
    assert sorted(Path(p).name for p in status["exports"]) == ["lora_comfyui.safetensors", "lora_diffusers.safetensors",
                                                              "lora_kohya.safetensors"]
    config = yaml.safe_load((run / "train.yaml").read_text())
    assert config["model"]["pretrained_model_name_or_path"] == str(folder / "models" / "raw.safetensors")
    assert (config["model"]["text_encoder"], config["model"]["vae"]) == ("tiny-random", "tiny-random")
    assert [d["weight"] for d in config["data"]["datasets"]] == [0.75, 0.25]
    assert all(Path(d["path"]).is_absolute() for d in config["data"]["datasets"])
    # What the trainer drew over an epoch: 8 subject images 1.5 times each, 4 regularisation images once.
    mix = json.loads((run / "dataset_mix.json").read_text())
    assert [(m["images"], m["samples_per_epoch"], m["share"]) for m in mix] == [(8, 12, 0.75), (4, 4, 0.25)]
