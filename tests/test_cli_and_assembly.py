"""The krea2 command line and the ways of assembling a pipeline from files."""

import json
import subprocess

import pytest
import torch
from PIL import Image

from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel, convert_diffusers_to_original
from krea2_diffusers.cli import main
from krea2_diffusers.files import read_safetensors, save_safetensors
from krea2_diffusers.metadata import read_settings


def test_generate_writes_pngs_with_settings(tmp_path, capsys, caplog):
    out = tmp_path / "fox.png"
    code = main(["generate", "a fox", "--model", "tiny-random", "--steps", "2", "--guidance", "1.5", "--seed", "7",
                 "--width", "48", "--height", "32", "--num-images", "2", "--negative", "blurry", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr()
    notices = (printed.out + printed.err).count("RANDOM WEIGHTS") + sum("RANDOM WEIGHTS" in r.getMessage() for r in caplog.records)
    assert notices == 1  # the loader's warning; the command does not repeat it
    for i in range(2):
        path = tmp_path / f"fox-{i}.png"
        settings = read_settings(path)
        assert settings["seed"] == 7 + i and settings["steps"] == 2 and settings["guidance_scale"] == 1.5
        assert settings["prompt"] == "a fox" and settings["negative_prompt"] == "blurry"
        assert (settings["width"], settings["height"]) == (48, 32)
        assert "RANDOM WEIGHTS" in settings["model"]
        with Image.open(path) as image:
            assert image.size == (48, 32)
            assert "CFG scale: 2.5" in image.text["parameters"]  # standard convention = krea + 1
            assert image.text["prompt"] == "a fox"


def test_generate_seed_plus_i_matches_single_runs(tmp_path):
    """Image i of a batch equals a single run with seed + i."""
    args = ["--model", "tiny-random", "--steps", "2", "--width", "32", "--height", "32"]
    main(["generate", "a", *args, "--seed", "3", "--num-images", "2", "--output", str(tmp_path / "b.png")])
    main(["generate", "a", *args, "--seed", "4", "--output", str(tmp_path / "s.png")])
    with Image.open(tmp_path / "b-1.png") as batch, Image.open(tmp_path / "s.png") as single:
        diff = (torch.tensor(list(batch.getdata())).float() - torch.tensor(list(single.getdata())).float()).abs().max()
    assert diff <= 1  # rounding of the last bit at most


def test_generate_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "keep.png"
    out.write_bytes(b"user data")
    code = main(["generate", "a", "--steps", "1", "--width", "32", "--height", "32", "--output", str(out)])
    assert code == 2 and out.read_bytes() == b"user data"
    assert "overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "num_inference_steps"),
    (["--guidance", "-2"], "guidance_scale"),
    (["--output", "x.jpg"], "png"),
])
def test_generate_bad_values(tmp_path, capsys, argv, match):
    code = main(["generate", "a", "--width", "32", "--height", "32", *argv] + ([] if "--output" in argv else ["--output", str(tmp_path / "o.png")]))
    assert code == 2 and match in capsys.readouterr().err


def test_convert_both_ways(tmp_path, tiny_pipe):
    state = tiny_pipe.transformer.state_dict()
    original = convert_diffusers_to_original(state)
    save_safetensors(original, tmp_path / "orig.safetensors")
    assert main(["convert", str(tmp_path / "orig.safetensors"), str(tmp_path / "diffusers")]) == 0
    folder_model = Krea2Transformer2DModel.from_pretrained(tmp_path / "diffusers")
    assert all(torch.equal(folder_model.state_dict()[k], v) for k, v in state.items())
    assert main(["convert", str(tmp_path / "diffusers"), str(tmp_path / "back.safetensors")]) == 0
    back = read_safetensors(tmp_path / "back.safetensors")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    # the output is never overwritten
    assert main(["convert", str(tmp_path / "diffusers"), str(tmp_path / "back.safetensors")]) == 2


def test_cli_entry_point_installed():
    out = subprocess.run(["krea2", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "convert" in out.stdout


def test_from_pretrained_diffusers_folder_uses_our_class(tmp_path, oracle_pipe, tiny_pipe):
    oracle_pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "Krea2Transformer2DModel"]
    pipe = Krea2Pipeline.from_pretrained(tmp_path / "pipe")
    assert type(pipe.transformer) is Krea2Transformer2DModel
    assert type(pipe) is Krea2Pipeline
    kwargs = dict(height=32, width=32, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                  latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0)))
    assert torch.allclose(pipe("a cat", **kwargs).images, tiny_pipe("a cat", **kwargs).images, atol=1e-6)


def test_from_pretrained_takes_dtype_and_its_older_name_without_deprecation_warnings(tmp_path, tiny_pipe):
    """diffusers 0.42 renamed ``torch_dtype`` to ``dtype`` and warns on the old name: ours takes both and
    hands diffusers ``dtype``, so neither spelling warns from inside our loader; both at once is an error."""
    import warnings

    tiny_pipe.save_pretrained(tmp_path / "pipe")
    for name in ("dtype", "torch_dtype"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = Krea2Pipeline.from_pretrained(tmp_path / "pipe", **{name: torch.bfloat16})
        assert pipe.transformer.img_in.weight.dtype == torch.bfloat16, name
        assert not [w for w in caught if "torch_dtype" in str(w.message)], (name, [str(w.message) for w in caught])
    with pytest.raises(ValueError, match="dtype or torch_dtype, not both"):
        Krea2Pipeline.from_pretrained(tmp_path / "pipe", dtype=torch.bfloat16, torch_dtype=torch.float32)
    # The transformer's single-file loader takes the same two names.
    save_safetensors(convert_diffusers_to_original(tiny_pipe.transformer.state_dict()), tmp_path / "krea2.safetensors")
    single = Krea2Transformer2DModel.from_single_file(tmp_path / "krea2.safetensors", dtype=torch.bfloat16)
    assert single.img_in.weight.dtype == torch.bfloat16


def test_from_single_file_with_local_encoder_and_vae(tmp_path, tiny_pipe):
    tiny_pipe.text_encoder.save_pretrained(tmp_path / "te")
    tiny_pipe.tokenizer.save_pretrained(tmp_path / "te")
    tiny_pipe.vae.save_pretrained(tmp_path / "qwen-image" / "vae")
    save_safetensors(convert_diffusers_to_original(tiny_pipe.transformer.state_dict()), tmp_path / "krea2-turbo.safetensors")
    pipe = Krea2Pipeline.from_single_file(tmp_path / "krea2-turbo.safetensors", text_encoder=tmp_path / "te", vae=tmp_path / "qwen-image")
    assert pipe.is_distilled  # from the file name
    kwargs = dict(height=32, width=32, num_inference_steps=2, output_type="latent",
                  latents=torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0)))
    ours = pipe("a cat", **kwargs).images
    tiny_pipe.register_to_config(is_distilled=True)
    try:
        expected = tiny_pipe("a cat", **kwargs).images
    finally:
        tiny_pipe.register_to_config(is_distilled=False)
    assert torch.allclose(ours, expected, atol=1e-6)
    raw = Krea2Pipeline.from_single_file(tmp_path / "krea2-turbo.safetensors", text_encoder=tmp_path / "te", vae=tmp_path / "qwen-image", is_distilled=False)
    assert not raw.is_distilled


def test_folders_saved_under_an_older_module_path_still_load(tmp_path, tiny_pipe):
    """A folder saved when our transformer class lived in ``krea2_diffusers.transformer`` (before the
    modules were grouped into subpackages) still loads, with the same weights."""
    tiny_pipe.save_pretrained(tmp_path / "pipe")
    index_path = tmp_path / "pipe" / "model_index.json"
    index = json.loads(index_path.read_text())
    assert index["transformer"] == ["krea2_diffusers.models.transformer", "Krea2Transformer2DModel"]
    index["transformer"] = ["krea2_diffusers.transformer", "Krea2Transformer2DModel"]
    index_path.write_text(json.dumps(index))
    old = Krea2Pipeline.from_pretrained(tmp_path / "pipe")
    assert type(old.transformer) is Krea2Transformer2DModel
    assert all(torch.equal(a, b) for a, b in zip(old.transformer.state_dict().values(), tiny_pipe.transformer.state_dict().values()))
