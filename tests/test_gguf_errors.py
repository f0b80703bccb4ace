"""Bad GGUF input: each failure names the file, and the tensor where there is one."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_support import make_model, write_with_gguf_writer

from krea2_diffusers.quantization.gguf import GGUFFormatError, load_gguf_transformer
from krea2_diffusers.models.transformer import Krea2Transformer2DModel

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def q8_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0)
    return path


def load(path):
    return load_gguf_transformer(Krea2Transformer2DModel, path, torch_dtype=torch.float32)


def test_other_architecture_is_refused(tmp_path):
    path = tmp_path / "flux-dev-Q8_0.gguf"
    writer = GGUFWriter(str(path), arch="flux")
    writer.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((96, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFormatError, match=r"flux-dev-Q8_0\.gguf.*'flux' model, not Krea 2"):
        load(path)


def test_krea2_label_on_foreign_tensors_is_refused(tmp_path):
    path = tmp_path / "mislabelled.gguf"
    writer = GGUFWriter(str(path), arch="krea2")
    writer.add_tensor("joint_blocks.0.x_block.attn.qkv.weight", np.zeros((96, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFormatError, match=r"mislabelled\.gguf: not a Krea 2 transformer.*first\.weight"):
        load(path)


def test_truncated_file_names_file_and_tensor(q8_file, tmp_path):
    data = q8_file.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(GGUFFormatError, match=r"cut\.gguf: truncated file: tensor '[a-z_.0-9]+'"):
        load(path)


def test_truncated_header_names_file(q8_file, tmp_path):
    path = tmp_path / "header-only.gguf"
    path.write_bytes(q8_file.read_bytes()[:200])
    with pytest.raises(GGUFFormatError, match=r"header-only\.gguf"):
        load(path)


def _retype_first_tensor(src, dst, new_type: int) -> str:
    """Copy ``src`` with the GGML type id of its first tensor replaced; returns that tensor's name."""
    from gguf import GGUFReader

    reader = GGUFReader(src)
    first = reader.tensors[0]
    type_part = first.field.parts[4]  # name length, name, n_dims, dims, type, offset
    offset = first.field.offset + sum(p.nbytes for p in first.field.parts[:4])
    assert int(type_part[0]) == int(first.tensor_type)
    data = bytearray(src.read_bytes())
    data[offset : offset + 4] = struct.pack("<I", new_type)
    dst.write_bytes(bytes(data))
    return first.name


def test_type_id_unknown_to_gguf_names_file_and_tensor(q8_file, tmp_path):
    path = tmp_path / "weird-type.gguf"
    name = _retype_first_tensor(q8_file, path, 250)
    with pytest.raises(GGUFFormatError, match=rf"weird-type\.gguf: tensor '{name}' has unknown type id 250"):
        load(path)


def test_unsupported_quant_type_names_file_and_tensor(model, tmp_path):
    """IQ4_NL is a valid GGML type we have no dequantizer for: refused by name, not crashed on."""
    path = tmp_path / "iq4.gguf"
    # gguf-py has no IQ4_NL quantizer, so the bytes are zeros: the loader must refuse before decoding
    writer = GGUFWriter(str(path), arch="krea2")
    block_bytes = np.zeros((256, 256 // 32 * 18), np.uint8)  # IQ4_NL: 18 bytes per 32 values
    writer.add_tensor("blocks.0.attn.wq.weight", block_bytes, raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFormatError, match=r"iq4\.gguf: tensor 'blocks\.0\.attn\.wq\.weight' is stored as IQ4_NL"):
        load(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file" * 10)
    with pytest.raises(GGUFFormatError, match=r"model\.gguf: not a readable GGUF file"):
        load(path)
    with pytest.raises(FileNotFoundError, match="nothere.gguf"):
        load(tmp_path / "nothere.gguf")


def test_missing_tensor_is_named(model, tmp_path):
    path = tmp_path / "incomplete.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0, drop=("blocks.2.attn.wv.weight",))
    with pytest.raises(GGUFFormatError, match=r"incomplete\.gguf: missing tensors.*transformer_blocks\.2\.attn\.to_v\.weight"):
        load(path)


def test_shape_that_does_not_fit_the_config_is_named(q8_file):
    from gguf_support import TINY_GGUF_CONFIG

    config = dict(TINY_GGUF_CONFIG, intermediate_size=512)
    with pytest.raises(GGUFFormatError, match=r"good\.gguf: tensor 'blocks\.0\.mlp\.(gate|up|down)\.weight' has shape"):
        load_gguf_transformer(Krea2Transformer2DModel, q8_file, config=config)


def test_unknown_original_tensor_is_named(model, tmp_path):
    path = tmp_path / "extra.gguf"
    write_with_gguf_writer(model, path, Q.Q8_0, extra={"blocks.0.attn.lora_A.weight": np.zeros((4, 256), np.float32)})
    with pytest.raises(GGUFFormatError, match=r"extra\.gguf: tensor 'blocks\.0\.attn\.lora_A\.weight' is not part of"):
        load(path)
