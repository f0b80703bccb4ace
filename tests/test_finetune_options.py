"""Issue 29's training options end to end on the tiny LoRA (train -> checkpoint -> die -> resume ->
validate -> export -> load): the EMA (``training.ema``), the optimizers from their packages
(``prodigy``, ``adafactor``, ``adamw_schedulefree``), the samplers ``sigmoid`` / ``mode`` / ``beta``
and W&B offline.

Three runs of 8 steps, checkpoints every 4, each dying after step 6 (steps 5 and 6 are replayed on
resume): Prodigy with an EMA exported ``both`` ways is a real ``python -m finetune`` process killed
with SIGKILL (tests/sigkill_runs.py) while the others die in-process (an exception right after step
6 is logged): Adafactor with an EMA in host memory, schedule-free with validation samples at steps 4
and 8 (taken, like its checkpoints, with its eval-mode weights). An uninterrupted Prodigy run with
W&B offline is the reference the killed run must reproduce. Every run records its trainable
parameters after each step (the trajectory) for the float64 recomputation of the EMA.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import finetune.trainer
from finetune.config import ConfigError, build_config
from finetune.engine.checkpoint import latest_checkpoint
from finetune.engine.parallel import trainable_state
from finetune.export.writer import model_tensors, read_model_tensors
from finetune.metrics import read_metrics
from finetune.optimization.optim import state_bytes
from finetune.trainer import Trainer
from lora_checks import DiedAfterStep, dying_metrics_logger, fixed_batch_loss

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS, EVERY, KILL_AT = 8, 4, 6
KILLED = "prodigy"
OPTIONS = {
    # d_coef 30: Prodigy's estimate starts at d0 = 1e-6 and would need more than 8 steps to grow at 1.
    # With the text-fusion adapters (krea2 train's default) 100 overshot (fixed-batch loss 1.633 -> 1.723);
    # 30 gives 1.435, 10 gives 1.559.
    "prodigy": {"optimizer": {"name": "prodigy", "learning_rate": 1.0, "d_coef": 30.0},
                "training": {"ema": {"decay": 0.8, "every_n_steps": 2, "export": "both"}},
                "objective": {"timestep_sampling": "sigmoid", "sigmoid_scale": 1.0}},
    # Adafactor's steps are relative to each matrix's RMS (at least 1e-3): a zero LoRA B needs rate 1.
    "adafactor": {"optimizer": {"name": "adafactor", "learning_rate": 1.0},
                  # a 4-step warm-up (k = 4 * 0.3 / 0.7): 0.7 reached at step 4, the checkpoint resumed from
                  "training": {"ema": {"decay": 0.7, "on_cpu": True, "warmup": 4}},
                  "objective": {"timestep_sampling": "mode"}},
    "adamw_schedulefree": {"optimizer": {"name": "adamw_schedulefree", "learning_rate": 1e-2},
                           "lr_scheduler": {"warmup_steps": 2},
                           "objective": {"timestep_sampling": "beta", "beta_alpha": 2.0, "beta_beta": 1.5},
                           "validation": {"prompts": ["red"], "num_inference_steps": 2, "guidance_scale": 3.5,
                                          "height": 32, "width": 32, "every_n_steps": EVERY}},
}
pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(root: Path, name: str, wandb: bool = False) -> dict:
    config = {
        "output_dir": str(root / name),
        "data": {"synthetic": {"num_prompts": 2, "size": 32}, "resolution": 32, "caption_dropout": 0.0,
                 # the killed run's own cache: the two sides never write one together
                 "cache_dir": str(root / ("cache-killed" if name == KILLED else "cache")), "num_workers": 0},
        "training": {"max_steps": MAX_STEPS, "batch_size": 2, "seed": 3},
        "lora": {"rank": 4, "alpha": 4},
        "checkpointing": {"every_n_steps": EVERY, "keep_last": 1},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    for section, values in OPTIONS[name.split("-")[0]].items():
        config[section] = {**config.get(section, {}), **values}
    if wandb:
        config["logging"]["wandb"] = {"project": "krea2-tests", "mode": "offline"}
    return config




class RecordingTrainer(Trainer):
    """Keeps float64 copies of the trainable parameters: at the start (``trajectory[0]``, before
    any step or any resume) and after each optimizer step (``trajectory[step]``)."""

    def setup(self) -> None:
        super().setup()
        self.trajectory = {self.start_step: self.parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().double().clone() for name, p in trainable_state(self.model).items()}

    def train_step(self, step: int, items):
        out = super().train_step(step, items)
        self.trajectory[step + 1] = self.parameters()
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (died trainer, died rows, resumed trainer, resumed result)} for the three runs, and
    ``"reference"``: (trainer, result) of the uninterrupted Prodigy run with W&B offline."""
    root = tmp_path_factory.mktemp("options")
    path = root / f"{KILLED}.yaml"
    path.write_text(yaml.safe_dump(run_config(root, KILLED)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out, log = root / "worker.out", root / "worker.log"
    with open(out, "w") as stdout, open(log, "w") as stderr:
        worker = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sigkill_runs.py"), str(KILL_AT), str(path)],
                                  cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    found, died = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the function-scoped one_thread fixture
    try:
        reference = RecordingTrainer(build_config(run_config(root, "prodigy-reference", wandb=True)))
        found["reference"] = (reference, reference.train())
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(finetune.trainer, "MetricsLogger", dying_metrics_logger(KILL_AT))
            for name in OPTIONS:
                if name != KILLED:
                    died[name] = RecordingTrainer(build_config(run_config(root, name)))
                    with pytest.raises(DiedAfterStep):
                        died[name].train()
    finally:
        torch.set_num_threads(threads)
        worker.wait(timeout=600)
    assert worker.returncode == 0, out.read_text()[-2000:] + log.read_text()[-4000:]
    report = json.loads(out.read_text().splitlines()[-1])
    assert report["signal"] == 9, f"the {KILLED} run was not killed mid-run: {report}\n{log.read_text()[-3000:]}"
    for name in OPTIONS:
        rows = read_metrics(root / name)
        assert len(rows) >= KILL_AT and latest_checkpoint(root / name / "checkpoints").name == f"step-{EVERY}"
        resumed = RecordingTrainer(build_config(run_config(root, name)), resume=True)
        found[name] = (died.get(name), rows, resumed, resumed.train())
    return found


def checkpoint_section(run_dir: Path, section: str) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir / "checkpoints")
    shapes = model_tensors(path, section=section)
    return read_model_tensors(path, sorted(shapes), shapes, section=section)


def warmed_decays(decay: float, every: int, k: float) -> dict[int, float]:
    """{step: decay of its update}: ``min(decay, (1 + n) / (1 + n + k))`` after ``n`` earlier updates
    (``training.ema.warmup``; k = 9 is diffusers' EMAModel schedule)."""
    return {step: min(decay, (step // every) / (step // every + k)) for step in range(every, MAX_STEPS + 1, every)}


def recomputed_ema(trajectory: dict[int, dict[str, torch.Tensor]], decays: dict[int, float]) -> dict[str, torch.Tensor]:
    """``ema_0 = w_0``, then ``ema = d * ema + (1 - d) * w_k`` after each step k of ``decays`` (float64)."""
    ema = {name: w.clone() for name, w in trajectory[0].items()}
    for step, d in sorted(decays.items()):
        ema = {name: d * ema[name] + (1 - d) * trajectory[step][name] for name in ema}
    return ema


def assert_ema_matches(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], updates: int) -> None:
    """The float32 average rounds twice per update (the product and the sum), each by at most half
    an ulp of its magnitude: ``updates * eps32 * max|value|`` bounds the difference."""
    assert saved.keys() == expected.keys()
    for name, value in saved.items():
        bound = updates * torch.finfo(torch.float32).eps * float(expected[name].abs().max())
        torch.testing.assert_close(value.double(), expected[name], rtol=0, atol=bound, msg=name)


def test_ema_equals_its_float64_recomputation_and_a_kill_9_resume_reproduces_it(runs):
    reference, result = runs["reference"]
    saved = checkpoint_section(result.output_dir, "ema")
    decays = warmed_decays(0.8, 2, 9.0)  # every 2 steps, the default warm-up: 0.1, 2/11, 3/12, 4/13
    assert_ema_matches(saved, recomputed_ema(reference.trajectory, decays), MAX_STEPS // 2)
    assert {r["step"]: r["ema_decay"] for r in read_metrics(result.output_dir) if "ema_decay" in r} == pytest.approx(decays)
    raw = checkpoint_section(result.output_dir, "model")
    assert max(float((saved[n] - raw[n]).abs().max()) for n in raw) > 1e-4  # the average is not the weights

    # Adafactor's average lives on the host and came through the step-4 checkpoint: steps 1-4 of the
    # run that died, 5-8 of the resumed one.
    died, _, resumed, adafactor = runs["adafactor"]
    trajectory = {**{s: w for s, w in died.trajectory.items() if s <= EVERY}, **resumed.trajectory}
    decays = warmed_decays(0.7, 1, 4 * 0.3 / 0.7)
    assert decays[4] == pytest.approx(0.7) and decays[3] < 0.7 and decays[8] == 0.7
    assert_ema_matches(checkpoint_section(adafactor.output_dir, "ema"), recomputed_ema(trajectory, decays), MAX_STEPS)
    assert all(t.device.type == "cpu" for t in resumed.ema.state.values())

    # The run killed with SIGKILL resumed to the reference's average and weights, bit for bit.
    _, _, _, killed = runs[KILLED]
    for section in ("ema", "model"):
        expected, got = checkpoint_section(result.output_dir, section), checkpoint_section(killed.output_dir, section)
        assert all(torch.equal(got[n], expected[n]) for n in expected), section

    # export: both -> the average in the usual file, the trained weights in raw/, each saying which.
    names = sorted(p.relative_to(killed.output_dir).as_posix() for p in killed.exported)
    assert names == ["lora_diffusers.safetensors", "raw/lora_diffusers.safetensors"]
    with safe_open(str(killed.output_dir / "lora_diffusers.safetensors"), "pt") as ema_file:
        assert ema_file.metadata()["krea2.ema_decay"] == "0.8"
    with safe_open(str(killed.output_dir / "raw" / "lora_diffusers.safetensors"), "pt") as raw_file:
        assert "krea2.ema_decay" not in raw_file.metadata()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_optimizer_resumes_exactly_after_dying_and_trains_the_lora(runs, name, tiny_pipe):
    _, died_rows, trainer, result = runs[name]
    rows = read_metrics(result.output_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)) and not result.interrupted
    # Steps 5 and 6 ran twice: before the death and after the resume from step 4, identically.
    for before, after in zip(died_rows[EVERY:KILL_AT], rows[EVERY:KILL_AT], strict=True):
        assert (before["loss"], before["lr"], before["grad_norm"]) == (after["loss"], after["lr"], after["grad_norm"])
    if name == KILLED:  # and the whole run equals the uninterrupted one
        reference = read_metrics(runs["reference"][1].output_dir)
        assert [r["loss"] for r in rows] == [r["loss"] for r in reference]

    # The trained LoRA (raw/: the weights, not their EMA) lowers the loss of a plain pipeline on
    # fixed noise and times (measured outside the trainer).
    before = fixed_batch_loss(tiny_pipe, trainer, None)
    trained = result.output_dir / ("raw" if name == KILLED else "") / "lora_diffusers.safetensors"
    after = fixed_batch_loss(tiny_pipe, trainer, trained)
    print(f"{name}: loss without the LoRA {before:.4f}, with {after:.4f}")
    assert after < 0.99 * before, (before, after)

    # The dry-run plan's state bytes are what the optimizer holds (Prodigy keeps a scalar ``p0`` for
    # a matrix that starts at zero, LoRA B: the plan counts the full copy, an upper bound).
    optimizer = trainer.optimizer
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    zero_start = sum(p.numel() * 4 for p, s in optimizer.state.items() if "p0" in s and s["p0"].dim() == 0)
    assert state_bytes(name, [p.shape for p in trainer.params]) == held + zero_start
    if name == "adamw_schedulefree":
        samples = sorted(p.parent.name for p in (result.output_dir / "samples").glob("*/raw-00.png"))
        assert samples == [f"step-{EVERY:06d}", f"step-{MAX_STEPS:06d}"]
        assert optimizer.param_groups[0]["train_mode"]  # back to training after checkpoints and samples


def wandb_history(run_dir: Path) -> list[dict]:
    """The ``history`` records of the W&B offline run in ``run_dir/wandb``: its ``.wandb`` file is
    a LevelDB-style log (a 7-byte header, 32 KiB blocks of records each behind a 7-byte
    ``crc32, length, type`` header; types 1 = whole record, 2 / 3 / 4 = first / middle / last part)
    of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length, kind) == (0, 0):
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_wandb_offline_holds_the_runs_scalars(runs):
    _, result = runs["reference"]
    expected = read_metrics(result.output_dir)
    history = wandb_history(result.output_dir)
    assert [row["_step"] for row in history] == [row["step"] for row in expected]
    for logged, row in zip(history, expected):
        assert {k: logged[k] for k in ("loss", "lr", "grad_norm", "step_time")} == {
            k: row[k] for k in ("loss", "lr", "grad_norm", "step_time")}


def test_bad_options_are_refused_before_anything_loads(tmp_path, monkeypatch, no_model_loading):
    import finetune.optimization.optim

    base = run_config(tmp_path, "adafactor")
    base["training"].pop("ema")

    def refused(overrides: list[str], match: str, missing: str | None = None) -> None:
        with monkeypatch.context() as patch:
            if missing:
                real = finetune.optimization.optim.importlib.util.find_spec
                patch.setattr(finetune.optimization.optim.importlib.util, "find_spec", lambda n, *a: None if n == missing else real(n, *a))
            with pytest.raises(ConfigError, match=match):
                Trainer(build_config(base, overrides)).train()

    refused(["optimizer.name=prodigy"], r"prodigyopt: pip install 'krea2-diffusers\[optimizers\]'", missing="prodigyopt")
    refused(["optimizer.name=adamw_schedulefree"], r"schedulefree: pip install", missing="schedulefree")
    refused(["optimizer.name=adamw_schedulefree", "lr_scheduler.name=cosine"], "lr_scheduler.name must be 'constant'")
    refused(["optimizer.name=adamw_schedulefree", "training.ema={decay: 0.9}"], "schedule-free already averages")
    refused(["training.ema={decay: 1.0}"], r"training.ema.decay must be in \(0, 1\)")
    refused(["objective.timestep_sampling=mode", "objective.mode_scale=2.0"], r"objective.mode_scale must be in \[-1")
    refused(["objective.timestep_sampling=beta", "objective.beta_beta=0"], "objective.beta_beta must be positive")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    refused(["logging.wandb={project: p}"], "logging.wandb.mode online needs a W&B API key")
