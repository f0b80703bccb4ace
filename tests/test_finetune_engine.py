"""The engine's parts on their own: DCP checkpoints (atomic, keep-last, refusal of another run's),
the split of a fixed global batch over any number of processes, the streaming safetensors
writer and reading a rank's rows of a file."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from finetune.engine import checkpoint as ckpt
from finetune.engine.loader import GlobalBatch, LayoutError, step_layout
from finetune.engine.weights import FileWeights, load_local_shards_
from krea2_diffusers.files import write_safetensors_streaming
from krea2_diffusers.loaders.single_file import TensorLocation


def _runtime():
    return SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"), barrier=lambda: None)


def _trained_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_dcp_checkpoint_round_trip_is_atomic_keeps_last_k_and_refuses_another_run(tmp_path):
    folder = tmp_path / "checkpoints"
    checkpointer = ckpt.Checkpointer(folder, _runtime(), keep_last=2)
    model, optimizer = _trained_model(0)
    for step in (2, 4, 6):
        torch.manual_seed(step)
        checkpointer.save(step, model, optimizer, trainable_only=False, train_state={"fingerprint": "a", "x": [1, 2]})
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [4, 6]
    saved = folder / "step-6"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "train_state.json"]
    assert not list(folder.glob(".step-*"))
    expected_rng = torch.rand(3)
    # A staging folder from a killed save is never mistaken for a checkpoint, and is cleaned up.
    (folder / ".step-8.abc").mkdir()
    assert ckpt.latest_checkpoint(folder) == saved
    ckpt.clean_staging(folder)
    assert not list(folder.glob(".step-*"))

    other, other_optimizer = _trained_model(1)  # different weights and optimizer moments
    state = checkpointer.load(saved, other, other_optimizer, trainable_only=False, expected={"fingerprint": "a"})
    assert state["step"] == 6 and state["x"] == [1, 2] and state["world_size"] == 1
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), other_optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert torch.equal(torch.rand(3), expected_rng)  # the generator state was saved and restored
    with pytest.raises(ckpt.CheckpointMismatchError, match="fingerprint: checkpoint 'a' vs this run 'b'"):
        checkpointer.load(saved, other, other_optimizer, trainable_only=False, expected={"fingerprint": "b"})


@pytest.mark.parametrize("micro,accumulation,cap", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 3, 2), (6, 2, 3), (4, 2, 4)])
def test_step_layout_covers_the_global_batch_once_with_equal_forward_counts(micro, accumulation, cap):
    batch = GlobalBatch(micro, accumulation, cap)
    for world in range(1, batch.samples_per_step + 1):
        if batch.samples_per_step % world:
            with pytest.raises(LayoutError, match="cannot be split"):
                step_layout(batch, 0, world)
            continue
        layouts = [step_layout(batch, rank, world) for rank in range(world)]
        assert len({len(layout) for layout in layouts}) == 1  # FSDP: same collectives on every rank
        covered = sorted((f.micro, slot) for f in itertools.chain(*layouts) for slot in range(f.start, f.stop))
        assert covered == [(m, s) for m in range(accumulation) for s in range(micro)]
        assert all(0 < f.stop - f.start <= cap and f.stop <= micro for f in itertools.chain(*layouts))


def test_streaming_safetensors_writer_matches_the_library(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).bfloat16()}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    chunks = [{"a": tensors["a"]}, {"b": tensors["b"], "c": tensors["c"]}]
    write_safetensors_streaming(tmp_path / "out.safetensors", entries, chunks, metadata={"k": "v"})
    read = load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(read[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="arrived where"):
        write_safetensors_streaming(tmp_path / "bad.safetensors", entries, [{"b": tensors["b"]}])
    assert not (tmp_path / "bad.safetensors").exists()


def test_rows_are_read_into_a_reshaped_model_tensor(tmp_path):
    """The original file stores the modulation table flat (6D,), the model holds (6, D)."""
    flat = torch.randn(12)
    save_file({"t": flat}, str(tmp_path / "f.safetensors"))
    header_len = int.from_bytes((tmp_path / "f.safetensors").read_bytes()[:8], "little")
    source = FileWeights({"table": TensorLocation(tmp_path / "f.safetensors", 8 + header_len, torch.float32, (12,))})
    assert torch.equal(source.read_rows("table", 2, 5, (2,)), flat.view(6, 2)[2:5])
    model = torch.nn.Module()
    model.register_parameter("table", torch.nn.Parameter(torch.empty(6, 2)))
    load_local_shards_(model, source)
    assert torch.equal(model.table.detach(), flat.view(6, 2))
    source.close()


def test_async_save_is_published_only_once_complete(tmp_path):
    folder = tmp_path / "checkpoints"
    checkpointer = ckpt.Checkpointer(folder, _runtime(), keep_last=3, async_save=True)
    model, optimizer = _trained_model(0)
    checkpointer.save(1, model, optimizer, trainable_only=False, train_state={"fingerprint": "a"})
    assert ckpt.latest_checkpoint(folder) is None  # still being written: not visible to --resume
    checkpointer.wait()
    assert ckpt.latest_checkpoint(folder) == folder / "step-1"
    other, other_optimizer = _trained_model(1)
    checkpointer.load(folder / "step-1", other, other_optimizer, trainable_only=False, expected={})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
