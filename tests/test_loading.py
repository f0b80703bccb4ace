"""Single-file loading on files with the real layout, conversion round trips, bad files."""

import json
import logging

import pytest
import torch

from krea2_diffusers import CheckpointError, Krea2Transformer2DModel, convert_diffusers_to_original, convert_original_to_diffusers
from krea2_diffusers.files import save_safetensors
from krea2_diffusers.loaders.single_file import infer_config_from_shapes

from conftest import random_state_dict, small_config


@pytest.fixture(scope="module")
def model():
    m = Krea2Transformer2DModel(**small_config())
    m.load_state_dict(random_state_dict(m))
    return m.eval()


def released_dtypes(original: dict) -> dict:
    """bf16 matrices, fp32 norms and tables, as the release stores them."""
    return {k: (v.float() if v.ndim == 1 or k.endswith(("mod.lin", "modulation.lin")) else v.to(torch.bfloat16)) for k, v in original.items()}


def test_round_trip_is_exact(model):
    original = convert_diffusers_to_original(model.state_dict())
    assert "blocks.0.mod.lin" in original and original["blocks.0.mod.lin"].ndim == 1
    back = convert_diffusers_to_original(convert_original_to_diffusers(original))
    assert list(back) == list(original) and all(torch.equal(back[k], original[k]) for k in original)


def test_config_inferred_from_shapes(model):
    original = convert_diffusers_to_original(model.state_dict())
    inferred = infer_config_from_shapes({k: tuple(v.shape) for k, v in original.items()})
    assert inferred == {k: (tuple(v) if isinstance(v, list) else v) for k, v in small_config().items()}


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_keeps_stored_dtypes(tmp_path, model, prefix):
    original = released_dtypes(convert_diffusers_to_original(model.state_dict()))
    save_safetensors({prefix + k: v for k, v in original.items()}, tmp_path / "krea2.safetensors")
    loaded = Krea2Transformer2DModel.from_single_file(tmp_path / "krea2.safetensors")
    state = loaded.state_dict()
    assert state["img_in.weight"].dtype == torch.bfloat16
    assert state["transformer_blocks.0.norm1.weight"].dtype == torch.float32
    assert state["transformer_blocks.0.scale_shift_table"].dtype == torch.float32
    expected = convert_original_to_diffusers(original)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert not any(p.is_meta for p in loaded.parameters())


def test_torch_dtype_casts_matrices_keeps_norms(tmp_path, model):
    save_safetensors(convert_diffusers_to_original(model.state_dict()), tmp_path / "m.safetensors")
    loaded = Krea2Transformer2DModel.from_single_file(tmp_path / "m.safetensors", torch_dtype=torch.bfloat16)
    assert loaded.img_in.weight.dtype == torch.bfloat16
    assert loaded.transformer_blocks[0].attn.norm_q.weight.dtype == torch.float32
    assert loaded.txt_in.norm.weight.dtype == torch.float32


def test_sharded_with_index(tmp_path, model):
    original = convert_diffusers_to_original(model.state_dict())
    names = sorted(original)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_safetensors({k: original[k] for k in keys}, tmp_path / file)
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for source in (tmp_path / "model.safetensors.index.json", tmp_path):
        loaded = Krea2Transformer2DModel.from_single_file(source)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_loaded_model_matches_in_memory_model(tmp_path, model):
    save_safetensors(convert_diffusers_to_original(model.state_dict()), tmp_path / "m.safetensors")
    loaded = Krea2Transformer2DModel.from_single_file(tmp_path / "m.safetensors", config=small_config())
    from test_transformer import inputs

    args = inputs(torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(*args).sample, model(*args).sample)


def test_dormant_extras_are_ignored_with_warning(tmp_path, model, caplog):
    original = convert_diffusers_to_original(model.state_dict())
    original["last.up.weight"] = torch.zeros(4, 4)
    original["last.down.weight"] = torch.zeros(4, 4)
    save_safetensors(original, tmp_path / "extras.safetensors")
    with caplog.at_level(logging.WARNING):
        Krea2Transformer2DModel.from_single_file(tmp_path / "extras.safetensors")
    assert "last.up.weight" in caplog.text


def test_missing_and_misshaped_tensors_are_named(tmp_path, model):
    original = convert_diffusers_to_original(model.state_dict())
    broken = dict(original)
    del broken["blocks.1.attn.wv.weight"]
    save_safetensors(broken, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.safetensors.*transformer_blocks\.1\.attn\.to_v\.weight"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "missing.safetensors")
    broken = dict(original)
    broken["blocks.0.mlp.up.weight"] = torch.zeros(3, 3)
    save_safetensors(broken, tmp_path / "shape.safetensors")
    with pytest.raises(CheckpointError, match=r"mis-shaped.*transformer_blocks\.0\.ff\.up\.weight"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "shape.safetensors")
    broken = dict(original)
    broken["blocks.0.attn.extra.weight"] = torch.zeros(3)
    save_safetensors(broken, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.extra\.weight"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "extra.safetensors")


def test_truncated_and_corrupt_files_name_the_file(tmp_path, model):
    save_safetensors(convert_diffusers_to_original(model.state_dict()), tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"cut.safetensors.*truncated"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match="junk.safetensors"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "junk.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    with pytest.raises(CheckpointError, match="garbage.safetensors.*corrupt"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "garbage.safetensors")


def test_other_architectures_are_named(tmp_path):
    save_safetensors({"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2)}, tmp_path / "flux.safetensors")
    with pytest.raises(CheckpointError, match="Flux checkpoint, not Krea 2"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "flux.safetensors")
    save_safetensors({"joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(2, 2)}, tmp_path / "sd3.safetensors")
    with pytest.raises(CheckpointError, match="SD3"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "sd3.safetensors")
    save_safetensors({"foo": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a Krea 2"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "other.safetensors")


def test_pickle_files_are_refused(tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04anything")
    with pytest.raises(CheckpointError, match="pickle"):
        Krea2Transformer2DModel.from_single_file(tmp_path / "model.ckpt")
