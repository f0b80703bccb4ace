"""Full-weight post-training on the engine's sharded build, with the most demanding method:
distillation holds three transformers (student and fake score trained, teacher frozen).

A mid-size (~90 MB fp32) original-layout file made on the fly, the tiny text encoder and VAE:

* 2 real processes (torchrun, gloo): each rank's memory while its models are set up (RSS sampled
  in the rank) is about half of what one process needs for the three copies, and the losses equal
  a 1-process run's; the DCP checkpoint has one shard file per rank and no teacher in it;
* that 2-process checkpoint resumed on 1 process continues with the 1-process run's losses and
  exports the same student;
* ``krea2 posttrain --dry-run`` prints the plan of the three copies, loads no weights and writes
  nothing but ``dry-run.log``.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from finetune.posttrain.cli import main as posttrain_main
from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file
from launcher import launch

LAYERS = 6
pytestmark = pytest.mark.usefixtures("one_thread")

# Runs `python -m finetune.posttrain` with the trainer's model set-up (trained root + frozen
# reference) wrapped in a probe (RSS sampled every 2 ms from a thread, see HostPeak), written as
# {"rank", "growth"} bytes to PROBE_DIR/rank<R>.json; and after every call of the frozen teacher,
# whether all its parameters are back to their shards, to PROBE_DIR/rank<R>-teacher.json.
PROBE = '''
import json, os, sys
from torch.distributed.tensor import DTensor
from finetune.engine.plan import HostPeak
from finetune.posttrain.reference import Reference
from finetune.posttrain.trainer import PosttrainTrainer

build = PosttrainTrainer.build_models
call = Reference.__call__

def resharded(self, model, **inputs):
    out = call(self, model, **inputs)
    record = os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ.get('RANK', '0')}-teacher.json")
    previous = json.load(open(record)) if os.path.exists(record) else []
    with open(record, "w") as f:
        json.dump(previous + [all(isinstance(p, DTensor) for p in self.frozen.parameters())], f)
    return out

Reference.__call__ = resharded

def probed(self):
    with HostPeak() as probe:
        build(self)
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{self.runtime.rank}.json"), "w") as f:
        json.dump({"rank": self.runtime.rank, "growth": probe.growth}, f)

PosttrainTrainer.build_models = probed
from finetune.posttrain.cli import main
sys.exit(main())
'''


@pytest.fixture(scope="module")
def medium_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("medium") / "krea2_medium.safetensors"
    size = save_random_original_file(path, proportioned_transformer_config(num_layers=LAYERS), seed=0)
    return path, size


def _config(out: Path, model: Path, **training) -> dict:
    return {
        "output_dir": str(out), "method": "distill",
        "model": {"pretrained_model_name_or_path": str(model), "text_encoder": "tiny-random", "vae": "tiny-random"},
        "training": {"method": "full", "max_steps": 3, "batch_size": 1, "seed": 5, **training},
        "optimizer": {"learning_rate": 1e-4, "max_grad_norm": 1.0},
        # DMD's term on (not the default): the fake score trains, three transformers at work.
        "distill": {"prompts": ["a picture", "a landscape"], "student_steps": 4, "resolution": 32, "distribution_weight": 1.0},
        "checkpointing": {"every_n_steps": 2, "keep_last": 1},
        "export": {"formats": ["original"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def _run(config: dict, folder: Path, processes: int, *args: str) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "probe.py"
    script.write_text(PROBE)
    return launch(config, folder, processes, [str(script)], *args, timeout=300)


def _growth(folder: Path, processes: int) -> list[int]:
    return [json.loads((folder / f"rank{r}.json").read_text())["growth"] for r in range(processes)]


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "step_time"} for row in read_metrics(out)]


def _assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {a['step']} {key}: {m}")


def test_sharded_full_distillation_memory_losses_and_resume_from_2_to_1_process(tmp_path, medium_file):
    model, fp32_bytes = medium_file
    # One process, the run's global batch of 2, three steps: student + fake score (fp32) + teacher (fp32).
    one = tmp_path / "one"
    _run(_config(one / "run", model, batch_size=2), one, 1)
    reference = _rows(one / "run")
    assert len(reference) == 3
    (one_growth,) = _growth(one, 1)
    assert one_growth > 2.7 * fp32_bytes, (one_growth, fp32_bytes)

    # Two processes, one sample each per step, stopped after step 2 (its checkpoint).
    two = tmp_path / "two"
    done = _run(_config(two / "run", model, max_steps=2), two, 2)
    assert "2 process(es)" in done.stdout + done.stderr
    # Each rank holds half of each of the three copies, read slice by slice from the file.
    for rank_growth in _growth(two, 2):
        assert rank_growth < 0.6 * one_growth, (rank_growth, one_growth)
    _assert_same_rows(_rows(two / "run"), reference[:2])
    for rank in range(2):  # the teacher, called every step, keeps only its shards between calls
        calls = json.loads((two / f"rank{rank}-teacher.json").read_text())
        assert len(calls) >= 2 and all(calls), (rank, calls)

    checkpoint = two / "run" / "checkpoints" / "step-2"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    names = set(model_tensors(checkpoint))
    assert names == set(model_tensors(one / "run" / "checkpoints" / "step-3"))
    assert {n.split(".")[0] for n in names} == {"student", "fake"}  # the frozen teacher is rebuilt, not saved

    # Resume the 2-process checkpoint on 1 process (the CLI, in this process): same global batch,
    # the 1-process run's losses.
    path = two / "resume.yaml"
    path.write_text(yaml.safe_dump(_config(two / "run", model)))
    assert posttrain_main([str(path), "--resume"]) == 0
    _assert_same_rows(_rows(two / "run"), reference)
    from safetensors.torch import load_file

    resumed = load_file(str(two / "run" / "krea2_original.safetensors"))
    expected = load_file(str(one / "run" / "krea2_original.safetensors"))
    assert resumed.keys() == expected.keys()
    # Steps 1-2 ran on 2 processes: each gradient is the sum of the two samples' in another order
    # than one process adds them (relative error ~1e-7). AdamW's step normalises each element's
    # gradient, so where that element's gradient is at the rounding-noise level (its sign or its
    # ratio to the running moments undetermined) the two runs' updates may differ by up to the
    # whole update, but never more: the bound below holds whatever the gradients. A 2-process
    # run of 3 steps without any resume differs from the 1-process run by the same 1.57e-5 at the
    # same element of first.weight, and the resumed run equals it to 7e-8, so this is the sum's
    # order, not the resume. A wrong resume (another step's noise, a lost optimizer state) moves
    # nearly every element by ~lr; reassociation moves very few beyond (1e-5 + 1e-4 |w|)
    # (measured: 1 of 22.5M; 82 beyond 1e-6).
    bound = adamw_update_bound(1e-4, (0.9, 0.999), steps=3)
    total = loose = 0
    for key in expected:
        difference = (resumed[key].double() - expected[key].double()).abs()
        assert float(difference.max()) <= bound, (key, float(difference.max()), bound)
        total += difference.numel()
        loose += int((difference > 1e-5 + 1e-4 * expected[key].double().abs()).sum())
    assert loose <= 1e-4 * total, (loose, total)


def adamw_update_bound(lr: float, betas: tuple[float, float], steps: int) -> float:
    """The most two AdamW runs of ``steps`` steps from the same weights can differ by, per element,
    whatever their gradients: the step ``lr m_t / (sqrt(v_t) + eps)`` (bias-corrected) has
    ``|m_t| / sqrt(v_t) <= (1 - b1) / (1 - b1^t) sqrt((1 - b2^t) / (1 - b2) sum_{j<t} (b1^2 / b2)^j)``
    (Cauchy-Schwarz on the two moving averages), so each run's step is at most that times ``lr``
    and two runs differ by at most twice the sum. (Weight decay adds ``lr wd |w_a - w_b|``, below
    1e-9 of it here.)"""
    b1, b2 = betas
    ratios = [(1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * sum((b1**2 / b2) ** j for j in range(t)))
              for t in range(1, steps + 1)]
    return 2 * lr * sum(ratios) * (1 + 1e-3)


def test_adamw_update_bound_holds_for_adversarial_gradients():
    """The bound of the resume test against real AdamW steps on gradients chosen to maximise the
    gap: one run sees +g every step, the other the signs flipped, at scales 1e-12 .. 1e3."""
    lr, betas, steps = 1e-4, (0.9, 0.999), 3
    bound = adamw_update_bound(lr, betas, steps)
    gaps = []
    for scales in ([1.0, 1.0, 1.0], [1e-12, 1.0, 1e3], [1e3, 1e-3, 1.0], [1.0, 1e-8, 1e-8]):
        weights = []
        for sign in (1.0, -1.0):
            w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
            optimizer = torch.optim.AdamW([w], lr=lr, betas=betas, weight_decay=0.0, eps=0.0)
            for scale in scales:
                w.grad = torch.full_like(w, sign * scale)
                optimizer.step()
            weights.append(float(w))
        gaps.append(abs(weights[0] - weights[1]))
    assert max(gaps) <= bound and max(gaps) > 0.99 * 2 * lr * steps, (gaps, bound)


def test_posttrain_dry_run_plans_three_copies_and_loads_nothing(tmp_path, medium_file, no_model_loading, capsys, monkeypatch):
    from finetune.config import build_config
    from finetune.posttrain.config import PosttrainConfig
    from finetune.posttrain.run import trainer_class
    from finetune.dryrun import build_plan

    model, fp32_bytes = medium_file
    out = tmp_path / "run"
    config = _config(out, model)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher of 2 processes sets it
    assert posttrain_main([str(path), "--dry-run"]) == 0  # the CLI in this process: a model load fails the test
    printed = capsys.readouterr().out
    assert "memory plan per process" in printed and "2 process(es)" in printed
    assert "student + fake score trained, teacher frozen" in printed
    assert "frozen teacher (float32, 1/2 shard, no optimizer state)" in printed
    assert sorted(p.name for p in out.iterdir()) == ["dry-run.log"]  # no weights read, no cache, no checkpoint

    # The figures, per process of 2 (the file is float32: its size is the parameter bytes).
    parsed = build_config(config, cls=PosttrainConfig)
    plan, _ = build_plan(parsed, 2, trainer_class(parsed).model_copies(parsed))
    rows = dict(plan.rows)
    two_models = 2 * fp32_bytes / 2
    assert rows["fp32 master weights (2 x 1/2 shard)"] == pytest.approx(two_models, rel=1e-3)
    assert rows["fp32 gradients (shard)"] == pytest.approx(two_models, rel=1e-3)
    assert rows["optimizer state (adamw, shard)"] == pytest.approx(2 * two_models, rel=1e-3)
    assert rows["frozen teacher (float32, 1/2 shard, no optimizer state)"] == pytest.approx(fp32_bytes / 2, rel=1e-3)
    # one batch of activations at a time: the fake score's updates and the student's run their own backwards
    assert any(k.startswith("activations (32x32 px, batch 1") for k in rows), rows
    # LoRA distillation: two adapters on one base, which is the teacher (no further copy).
    lora = build_config({**config, "training": {**config["training"], "method": "lora"}, "lora": {"rank": 4, "alpha": 4}},
                        cls=PosttrainConfig)
    lora_rows = dict(build_plan(lora, 1, trainer_class(lora).model_copies(lora))[0].rows)
    assert not any("teacher" in k for k in lora_rows)
    one_adapter = dict(build_plan(lora, 1)[0].rows)
    weights = next(k for k in lora_rows if k.startswith("LoRA r4 weights"))
    assert weights.endswith(", 2 adapters)")
    single = next(v for k, v in one_adapter.items() if k.startswith("LoRA r4 weights"))
    assert lora_rows[weights] == 2 * single
