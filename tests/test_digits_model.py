"""``krea2-digits``, the packaged trained model (issue 39): it loads by name offline, its rebuilt text
encoder is the one it was trained with, its files fit the repository's budget and are tracked, and the
README's command draws a 64 px image with the model's own defaults. Whether the digits are right is
the bench's job (``bench/bench_digits_model.py``: the proving ground's judge on 20 seeds per digit)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.files import read_safetensors_header
from krea2_diffusers.models.digits import FOLDER, KREA2_DIGITS, SIZE_BUDGET, is_digits, parameter_digest, recorded_text_encoder
from krea2_diffusers.presets import DIGITS

SEVEN = "a handwritten digit seven"  # the proving ground's caption (bench/proving/digits.py: caption(7))
# Its token ids under the tokenizer the model was trained with (the proving ground base's tokenizer.json).
SEVEN_IDS = [64, 98389, 15723, 8094]


@pytest.fixture(scope="module")
def digits_pipe() -> Krea2Pipeline:
    """Loaded by name with every network connection refused: nothing may be downloaded."""
    def no_network(*args, **kwargs):
        raise AssertionError("krea2-digits tried to reach the network")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", no_network)
        return Krea2Pipeline.from_pretrained(KREA2_DIGITS)


def test_loads_by_name_offline_with_its_own_defaults(digits_pipe):
    assert digits_pipe.preset == DIGITS and not digits_pipe.is_distilled
    assert (DIGITS.resolution, DIGITS.num_inference_steps, DIGITS.guidance_scale) == (64, 16, 3.0)
    assert digits_pipe.transformer.dtype == torch.float32 and digits_pipe.vae.dtype == torch.float32
    assert digits_pipe.transformer.config.num_layers == 6
    assert is_digits(FOLDER) and is_digits(str(FOLDER)) and not is_digits("tiny-random")
    # The folder itself (as the ComfyUI loader lists it) loads the same way.
    assert Krea2Pipeline.from_pretrained(str(FOLDER), text_encoder=digits_pipe.text_encoder).preset == DIGITS


def test_the_rebuilt_text_encoder_and_tokenizer_are_the_trained_ones(digits_pipe):
    record = recorded_text_encoder()
    assert record["source"] == "tiny-random"
    assert parameter_digest(digits_pipe.text_encoder) == record["parameter_digest"]
    assert digits_pipe.tokenizer(SEVEN).input_ids == SEVEN_IDS


def test_the_folder_fits_the_budget_in_16_bit_and_is_tracked():
    files = sorted(p for p in FOLDER.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    assert total <= SIZE_BUDGET, f"{FOLDER}: {total:,} bytes, over the {SIZE_BUDGET:,} committed to git"
    for part in ("transformer", "vae"):
        entries, metadata, _ = read_safetensors_header(FOLDER / part / "diffusion_pytorch_model.safetensors")
        assert {entry["dtype"] for entry in entries.values()} <= {"F16", "BF16"}, part
    assert json.loads((FOLDER / "model_index.json").read_text())["sampler_preset"] == "digits"
    assert (FOLDER / "MODEL_CARD.md").is_file()
    git = shutil.which("git")
    if git is None or subprocess.run([git, "rev-parse"], cwd=FOLDER, capture_output=True).returncode != 0:
        return  # an installed copy: nothing to track
    ignored = subprocess.run([git, "check-ignore", *map(str, files)], cwd=FOLDER, capture_output=True, text=True).stdout
    assert not ignored, f"git ignores files of the packaged model:\n{ignored}"


def test_cli_generates_a_64px_image_with_the_model_defaults(tmp_path):
    from krea2_diffusers.cli import main

    out = tmp_path / "seven.png"
    assert main(["generate", SEVEN, "--model", KREA2_DIGITS, "--output", str(out)]) == 0
    image = Image.open(out)
    assert image.size == (64, 64)
    settings = json.loads(image.info["krea2"])
    assert (settings["steps"], settings["guidance_scale"], settings["model"]) == (16, 3.0, KREA2_DIGITS)
    gray = np.asarray(image.convert("L"), dtype=np.float32) / 255
    # Dark ink on white paper, as the scans: mostly paper, some ink (a random model draws noise).
    assert (gray > 0.8).mean() > 0.5 and (gray < 0.3).mean() > 0.05
