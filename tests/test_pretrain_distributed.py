"""`krea2 pretrain` on 2 processes (torchrun, gloo, FSDP2 with Muon's gathered orthogonalisation and
the REPA projector as its own FSDP unit), resumed on 1 process: the same losses and the same PMA
export (written once, by the main process).

PMA bound: step-4's PMA is the mean of checkpoints 2 (shared) and 4; checkpoint 4's last step ran on
1 process instead of 2, which only reassociates float32 sums (the gradient's, then Muon's
orthogonalisation of the whole matrix): the weights agree to ``rtol=1e-4`` in Frobenius norm per
tensor (measured: equal bit for bit, the 1-process run accumulating the same micro-batches in the
same order) while a lost process's half batch changes the step by ~1e-2 relative."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.packs import PackReader
from finetune.pretrain.batches import StageBatches
from finetune.pretrain.config import build_pretrain_config
from krea2_diffusers.cli import main as krea2
from launcher import torchrun

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """\
output_dir: two
model: {architecture: tiny, init: scratch, text_encoder: tiny-random, vae: tiny-random}
optimizer: {name: muon, learning_rate: 2.0e-3}
checkpointing: {every_n_steps: 2, keep_last: 4}
pma: {every_n_steps: 2, num_checkpoints: 2}
logging: {progress_bar: false, tensorboard: false}
stages:
  - {name: s64, data: pack, resolution: 64, batch_size: 2, steps: 4,
     repa: {encoder: tiny-random, weight: 0.5, block: 1, epochs: 1}}
"""


def _rows(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_two_process_run_resumes_on_one_process_with_the_same_losses(tmp_path):
    from finetune.packs.synthetic import make_synthetic_set

    manifest = make_synthetic_set(tmp_path / "data", count=16)
    assert krea2(["pack", str(manifest), str(tmp_path / "pack"), "--resolution", "64", "--batch-size", "2"]) == 0
    # Broken rows: one in step 2, and all of process 1's rows in step 3 (the epoch's order places them).
    config = build_pretrain_config(yaml.safe_load(CONFIG))
    batches = StageBatches(config.stages[0], PackReader(tmp_path / "pack"), 2, config.training.seed)
    step_2, step_3 = batches.global_rows(1), batches.global_rows(2)
    shard = next((tmp_path / "pack").glob("*.parquet"))
    table = pq.read_table(shard)
    images = table.column("image_bytes").to_pylist()
    for row in (step_2[0].start, *step_3[1]):
        images[row] = b"not a png"
    table = table.set_column(table.schema.get_field_index("image_bytes"), "image_bytes", pa.array(images, pa.binary()))
    pq.write_table(table.replace_schema_metadata(table.schema.metadata), shard)
    (tmp_path / "c.yaml").write_text(CONFIG)
    torchrun(2, ["-m", "finetune.pretrain", str(tmp_path / "c.yaml")], timeout=400)
    two = tmp_path / "two"
    assert sorted((two / "checkpoints").iterdir())[-1].name == "step-4"
    assert len(list((two / "checkpoints/step-4").glob("*.distcp"))) == 2  # one shard file per process
    one = tmp_path / "one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "checkpoints/step-4")
    (one / "pma" / "step-4.safetensors").unlink()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert krea2(["pretrain", str(tmp_path / "c.yaml"), "--output-dir", str(one), "--resume"]) == 0
    finally:
        torch.set_num_threads(threads)
    expected, got = _rows(two), _rows(one)
    assert sorted(got) == [1, 2, 3, 4]
    assert [expected[s]["decode_failures"] for s in (1, 2, 3, 4)] == [0, 1, 2, 0]
    assert got[3]["decode_failures"] == 2 and all("repa_loss" in r for r in expected.values())
    for step in (3, 4):  # trained by 1 process on the 2-process run's global batch of 4 rows
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
        assert got[step]["repa_loss"] == pytest.approx(expected[step]["repa_loss"], rel=1e-5), step
    assert sorted(p.name for p in (two / "pma").iterdir()) == ["step-2.safetensors", "step-4.safetensors"]
    pma_two, pma_one = load_file(str(two / "pma/step-4.safetensors")), load_file(str(one / "pma/step-4.safetensors"))
    assert pma_two.keys() == pma_one.keys() and pma_one
    worst = 0.0
    for key, tensor in pma_one.items():
        relative = float((pma_two[key].double() - tensor.double()).norm() / tensor.double().norm().clamp_min(1e-12))
        worst = max(worst, relative)
        assert relative <= 1e-4, (key, relative)
    print(f"PMA step 4, 2 vs 1 process(es): worst relative difference {worst:.2e}")
