"""`krea2 pretrain` end to end on the pinned tiny config: two stages from scratch over packs made
by `krea2 pack`, checked from the outside (checkpoints, PMA files, the packs themselves)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from krea2_diffusers import Krea2Transformer2DModel
from finetune.pretrain.trainer import Pretrainer
from krea2_diffusers.cli import main as krea2
from krea2_diffusers.models.tiny import tiny_transformer_config

# The interface pinned in the issue, verbatim.
PINNED = """\
output_dir: outputs/pretrain-tiny
model: {architecture: tiny, init: scratch, text_encoder: tiny-random, vae: tiny-random}
optimizer: {name: muon, learning_rate: 2.0e-3}
pma: {every_n_steps: 4, num_checkpoints: 3}
checkpointing: {every_n_steps: 4, keep_last: 8}
stages:
  - {name: s64, data: packs/64, resolution: 64, batch_size: 4, steps: 24,
     repa: {encoder: tiny-random, weight: 0.5, block: 1, epochs: 1}}
  - {name: s128, data: packs/128, resolution: 128, batch_size: 2, steps: 12,
     activation_checkpointing: full}
"""
ROOT = Path(__file__).resolve().parents[1]


def _metrics(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _dcp_model(path, names_shapes):
    tensors = {n: torch.empty(s) for n, s in names_shapes.items()}
    dcp.load({"model": tensors}, checkpoint_id=str(path), no_dist=True)
    return tensors


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One uninterrupted run of the pinned config; stage 2's pack carries precomputed text features."""
    from finetune.packs.synthetic import make_synthetic_set

    root = tmp_path_factory.mktemp("pretrain")
    manifest = make_synthetic_set(root / "data", count=32)
    assert krea2(["pack", str(manifest), str(root / "packs/64"), "--resolution", "64", "--batch-size", "4"]) == 0
    assert krea2(["pack", str(manifest), str(root / "packs/128"), "--resolution", "128", "--batch-size", "2",
                  "--text-encoder", "tiny-random"]) == 0
    (root / "config.yaml").write_text(PINNED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only add synchronisation
    trained = {}  # step -> the sample ids the trainer's step received (what --replay must name)
    step = Pretrainer.train_step

    def recording(self, item):
        trained[item["step"]] = [i for micro in item["micro"] for i in micro["sample_ids"]]
        return step(self, item)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Pretrainer, "train_step", recording)
            assert krea2(["pretrain", str(root / "config.yaml"), "logging.progress_bar=false", "logging.tensorboard=false"]) == 0
        (root / "trained.json").write_text(json.dumps(trained))
        yield root, root / "outputs/pretrain-tiny"
    finally:
        torch.set_num_threads(threads)


def test_two_stages_from_scratch_learn_with_repa_muon_and_pma(run):
    root, out = run
    metrics = _metrics(out)
    assert sorted(metrics) == list(range(1, 37))
    assert {metrics[s]["stage"] for s in range(1, 25)} == {"s64"} and {metrics[s]["stage"] for s in range(25, 37)} == {"s128"}
    # 32 rows / 4 per batch = 8 batches per epoch: REPA exactly on steps 1..8.
    assert [s for s in metrics if "repa_loss" in metrics[s]] == list(range(1, 9))
    for row in metrics.values():
        assert {"lr", "grad_norm", "samples_per_s", "decode_failures"} <= set(row) and row["decode_failures"] == 0

    # The loss falls within stage 1, measured outside the trainer: the checkpoints' weights on a
    # fixed batch with fixed noise and times (a zero prediction, the scratch init, as baseline).
    from finetune.components import load_text_encoder, load_vae
    from finetune.packs import PackReader, decode_image
    from krea2_diffusers.latents import encode_images, pack_latents, position_ids

    rows = PackReader(root / "packs/64").rows(0, 4)
    pixels = torch.stack([decode_image(r) for r in rows])
    vae, text = load_vae("tiny-random"), load_text_encoder("tiny-random", torch.float32)
    with torch.no_grad():
        x0 = pack_latents(encode_images(vae, pixels).float())
        embeds, mask = text.encode([r["caption_long"] for r in rows], 512)
    generator = torch.Generator().manual_seed(0)
    t = torch.tensor([0.2, 0.4, 0.6, 0.8]).repeat_interleave(4)
    noise = torch.randn((16, *x0.shape[1:]), generator=generator)
    x0, embeds, mask = x0.repeat(4, 1, 1), embeds.repeat(4, 1, 1, 1), mask.repeat(4, 1)
    noisy = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
    h, w = rows[0]["height"] // 16, rows[0]["width"] // 16
    model = Krea2Transformer2DModel(**tiny_transformer_config()).eval()
    shapes = {k: v.shape for k, v in model.state_dict().items()}

    def loss_at(step):
        model.load_state_dict(_dcp_model(out / f"checkpoints/step-{step}", shapes))
        with torch.no_grad():
            pred = model(hidden_states=noisy, encoder_hidden_states=embeds, timestep=t,
                         position_ids=position_ids(embeds.shape[1], h, w), encoder_attention_mask=mask, return_dict=False)[0]
        return float((pred - (noise - x0)).pow(2).mean())

    baseline = float((noise - x0).pow(2).mean())
    early, late = loss_at(8), loss_at(24)
    assert late < 0.85 * early < 0.85 * baseline, (baseline, early, late)

    # Optimizer state under the parameter's own name, torch's state names, read from the DCP checkpoint.
    keys = set(dcp.FileSystemReader(str(out / "checkpoints/step-36")).read_metadata().state_dict_metadata)
    state = "optimizer.state."
    for name in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.1.ff.down.weight", "time_mod_proj.weight"):
        assert state + name + ".momentum_buffer" in keys and state + name + ".exp_avg" not in keys
    for name in ("img_in.weight", "final_layer.linear.weight", "transformer_blocks.0.norm1.weight"):
        assert {state + name + ".exp_avg", state + name + ".exp_avg_sq"} <= keys and state + name + ".momentum_buffer" not in keys
    buffer = {"q": torch.empty(shapes["transformer_blocks.0.attn.to_q.weight"])}
    dcp.load({"optimizer": {"state": {"transformer_blocks.0.attn.to_q.weight": {"momentum_buffer": buffer["q"]}}}},
             checkpoint_id=str(out / "checkpoints/step-36"), no_dist=True)
    assert buffer["q"].abs().sum() > 0

    # PMA: the mean of the checkpoints its metadata names, with the transformer's diffusers names.
    with safe_open(str(out / "pma/step-36.safetensors"), "pt") as f:
        steps = json.loads(f.metadata()["pma_steps"])
        pma = {k: f.get_tensor(k) for k in f.keys()}
    assert steps == [28, 32, 36] and set(pma) == set(shapes)
    averaged = [_dcp_model(out / f"checkpoints/step-{s}", shapes) for s in steps]
    for name, value in pma.items():
        torch.testing.assert_close(value, sum(a[name] for a in averaged) / 3, rtol=0, atol=1e-7)
    assert not torch.equal(averaged[0]["img_in.weight"], averaged[2]["img_in.weight"])

    # `krea2 export` writes a pretraining checkpoint as a transformer folder holding its exact weights.
    assert krea2(["export", str(out / "checkpoints/step-36"), str(root / "export-36"), "--format", "diffusers"]) == 0
    exported = Krea2Transformer2DModel.from_pretrained(str(root / "export-36" / "transformer")).state_dict()
    assert set(exported) == set(shapes)
    for name, value in averaged[2].items():
        assert torch.equal(exported[name], value), name


def test_each_epoch_visits_the_pack_in_a_new_order_and_replay_names_the_rows_of_a_step(run, capsys):
    root, out = run
    config = str(root / "config.yaml")
    trained = {int(k): v for k, v in json.loads((root / "trained.json").read_text()).items()}
    pack = [r["sample_id"] for r in pq.read_table(sorted((root / "packs/64").glob("*.parquet"))[0]).to_pylist()]
    # Stage s64: 32 rows, 8 steps of 4 per epoch, 3 epochs: each epoch is every row once, each in
    # its own order (drawn from the seed and the epoch), none the pack's own order.
    epochs = [sum((trained[s] for s in range(1 + 8 * e, 9 + 8 * e)), []) for e in range(3)]
    assert all(sorted(e) == sorted(pack) for e in epochs)
    assert len({tuple(e) for e in epochs + [pack]}) == 4
    for step in (7, 21, 30):  # --replay names what the step trained on (epochs 0 and 2 of s64, s128)
        assert krea2(["pretrain", config, "--replay", str(step)]) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        stage = "s64" if step <= 24 else "s128"
        assert line == {"stage": stage, "step": step, "sample_ids": trained[step]}

    assert krea2(["pretrain", config, "--dry-run", "--output-dir", str(root / "dry")]) == 0
    plan = capsys.readouterr().out
    assert "stage s64: steps 1..24" in plan and "repa on steps 1..8" in plan and "AdamW" in plan
    assert not (root / "dry").exists()  # nothing written
    assert krea2(["pretrain", config, "--dry-run", "stages.0.batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert str(root / "packs/64") in err and "batch_size=4" in err and "batch_size=2" in err
    assert krea2(["pretrain", config, "--dry-run", "stages.1.precision=fp8"]) == 2
    assert "fp8 needs a CUDA GPU" in capsys.readouterr().err
    assert krea2(["pretrain", config, "--dry-run", "optimizer.nam=adamw"]) == 2
    assert "did you mean 'optimizer.name'" in capsys.readouterr().err


def test_kill_9_in_stage_2_then_resume_gives_the_uninterrupted_losses(run):
    root, out = run
    resumed = root / "resumed"
    shutil.copytree(out, resumed)  # the run as it stood at its step-28 checkpoint (inside stage 2)
    for path in [*resumed.glob("checkpoints/step-*"), *resumed.glob("pma/step-*")]:
        if int(path.name.split("-")[1].split(".")[0]) > 28:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= 28))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "finetune.pretrain", str(root / "config.yaml"), "--output-dir", str(resumed),
            "--resume", "logging.progress_bar=false", "logging.tensorboard=false"]
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if max(_metrics(resumed)) >= 30:  # step 30 done: between the step-28 and step-32 checkpoints
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    assert 30 <= max(_metrics(resumed)) < 36  # killed while training stage 2
    assert not (resumed / "checkpoints/step-36").exists()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert krea2(["pretrain", str(root / "config.yaml"), "--output-dir", str(resumed), "--resume",
                      "logging.progress_bar=false", "logging.tensorboard=false"]) == 0
    finally:
        torch.set_num_threads(threads)
    expected, got = _metrics(out), _metrics(resumed)
    assert sorted(got) == list(range(1, 37))
    for step in range(25, 37):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-6, abs=1e-7), step
