"""``krea2 quantize``: its files load back (ours and gguf-py's reader), follow the community
rules, and bad requests fail without touching anything."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf_support import community_type, make_inputs, make_model, relative_error, run_model
from test_gguf_loading import OUTPUT_ERROR_BOUND

from krea2_diffusers.cli import main
from krea2_diffusers.loaders.convert import convert_diffusers_to_original
from krea2_diffusers.files import save_safetensors
from krea2_diffusers.quantization.gguf import PackedLinear
from krea2_diffusers.models.transformer import Krea2Transformer2DModel

Q = GGMLQuantizationType
CLI_TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model saved in the original layout, bf16 like the release, with the
    ComfyUI prefix and the two dormant tensors some files carry."""
    model = make_model()
    folder = tmp_path_factory.mktemp("ckpt")
    state = {f"model.diffusion_model.{k}": v.to(torch.bfloat16) for k, v in convert_diffusers_to_original(model.state_dict()).items()}
    state["model.diffusion_model.last.up.weight"] = torch.zeros(64, 256, dtype=torch.bfloat16)
    path = folder / "krea2-tiny.safetensors"
    save_safetensors(state, path)
    reference = run_model(model.to(torch.bfloat16).float(), make_inputs())  # the bf16-rounded weights
    return path, reference


@pytest.mark.parametrize("qtype", CLI_TYPES)
def test_quantize_output_loads_back(qtype, checkpoint, tmp_path, capsys):
    src, reference = checkpoint
    out = tmp_path / f"tiny-{qtype}.gguf"
    assert main(["quantize", str(src), str(out), "--type", qtype]) == 0
    assert "wrote" in capsys.readouterr().out
    # gguf-py's reader sees the community conventions
    reader = GGUFReader(out)
    assert bytes(reader.get_field("general.architecture").parts[-1]).decode() == "krea2"
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert not any(n.startswith(("model.", "last.up")) for n in types)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        expected = community_type(t.name, shape, Q[qtype])
        if t.name.endswith((".mod.lin", "last.modulation.lin")):
            # ComfyUI-GGUF copies modulation tables raw into plain parameters: F32 whatever the source
            assert types[t.name] == Q.F32, t.name
        elif expected == Q.F32 and len(shape) >= 2 and t.n_elements > 1024:
            assert types[t.name] == Q.BF16, t.name  # unquantized matrices keep the source's bf16
        else:
            assert types[t.name] == expected, t.name
        if types[t.name] == Q[qtype]:
            field = reader.get_field(f"comfy.gguf.orig_shape.{t.name}")
            assert [int(field.parts[i][0]) for i in field.data] == list(shape)
    loaded = Krea2Transformer2DModel.from_single_file(out, torch_dtype=torch.float32)
    assert isinstance(loaded.transformer_blocks[0].ff.down, PackedLinear)
    err = relative_error(run_model(loaded, make_inputs()), reference)
    assert 1e-4 < err < OUTPUT_ERROR_BOUND[Q[qtype]], f"{qtype}: {err:.4f}"


def test_diffusers_layout_input_gives_the_same_file(checkpoint, tmp_path):
    src, _ = checkpoint
    diffusers_src = tmp_path / "diffusers-layout.safetensors"
    original = Krea2Transformer2DModel.from_single_file(src)
    save_safetensors(original.state_dict(), diffusers_src)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main(["quantize", str(src), str(a), "--type", "Q6_K"]) == 0
    assert main(["quantize", str(diffusers_src), str(b), "--type", "Q6_K"]) == 0
    ra, rb = GGUFReader(a), GGUFReader(b)
    assert sorted(t.name for t in ra.tensors) == sorted(t.name for t in rb.tensors)
    by_name = {t.name: t for t in rb.tensors}
    for t in ra.tensors:
        other = by_name[t.name]
        assert t.tensor_type == other.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(other.data)), t.name


def test_refuses_to_overwrite_input_or_existing_output(checkpoint, tmp_path, capsys):
    src, _ = checkpoint
    before = src.read_bytes()
    assert main(["quantize", str(src), str(src), "--type", "Q8_0", "--force"]) == 2
    assert "must end in .gguf" in capsys.readouterr().err
    existing = tmp_path / "taken.gguf"
    existing.write_bytes(b"keep me")
    assert main(["quantize", str(src), str(existing)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert existing.read_bytes() == b"keep me" and src.read_bytes() == before
    assert main(["quantize", str(src), str(existing), "--force"]) == 0
    assert existing.read_bytes()[:4] == b"GGUF"


def test_bad_inputs_fail_cleanly(checkpoint, tmp_path, capsys):
    src, _ = checkpoint
    out = tmp_path / "x.gguf"
    with pytest.raises(SystemExit):  # argparse rejects the choice
        main(["quantize", str(src), str(out), "--type", "Q3_K"])
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"\x80\x04not really")
    assert main(["quantize", str(pickle), str(out)]) == 2
    assert "never unpickled" in capsys.readouterr().err
    nan = tmp_path / "nan.safetensors"
    state = convert_diffusers_to_original(make_model().state_dict())
    state["blocks.1.mlp.up.weight"][3, 5] = float("nan")
    save_safetensors(state, nan)
    assert main(["quantize", str(nan), str(out)]) == 2
    assert "nan.safetensors: tensor 'blocks.1.mlp.up.weight'" in capsys.readouterr().err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no partial file left


def test_k_quant_falls_back_for_narrow_rows(tmp_path):
    """Rows that are not whole 256-blocks (the 64-wide tiny-random model) get a 32-block type of
    similar size, as the community converters do, and the file still loads."""
    from krea2_diffusers.models.tiny import tiny_transformer_config

    model = Krea2Transformer2DModel(**tiny_transformer_config()).eval()
    src, out = tmp_path / "tiny-random.safetensors", tmp_path / "tiny-random-Q4_K.gguf"
    save_safetensors(convert_diffusers_to_original(model.state_dict()), src)
    assert main(["quantize", str(src), str(out), "--type", "Q4_K"]) == 0
    types = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    assert types["blocks.0.attn.wq.weight"] == Q.Q4_0  # 64 values per row
    assert Q.Q4_K not in types.values()
    loaded = Krea2Transformer2DModel.from_single_file(out, torch_dtype=torch.float32)
    assert loaded.transformer_blocks[0].attn.to_q.qtype == Q.Q4_0
