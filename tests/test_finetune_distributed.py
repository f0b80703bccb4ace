"""Two real processes (torchrun or ``accelerate launch``, gloo on CPU) give the same training as one
process with the same global batch: FSDP2 for a full fine-tune, DDP for LoRA; validation (RAW and,
for LoRA, Turbo with the adapter) on, samples written once; a rank killed with SIGKILL ends the job,
and ``--resume`` on 2 processes recomputes the same losses. The LoRA (DDP) comparison runs through
that kill and resume: one 2-process job shows both (the torchrun steps before the kill and the
``accelerate launch`` steps after it each equal the 1-process run's). Two launches in all: the
``accelerate launch`` job's processes resume the LoRA run and then run the full fine-tune from
scratch (COUNT_ALL_REDUCES runs the CLI on each in turn: the heavy imports once per process).

Bound for 2 processes vs 1: the only difference is where float32 sums are split (each process sums
its half of the global batch, then one all-reduce adds the halves), so per-sample losses agree to a
few ulps and each gradient element to ``k * 2**-24 * sum|terms|`` (k: terms summed, a few hundred
here). Adam divides each step by the running gradient scale, so after 4-6 steps of lr 1e-3 the weights
agree to ~1e-4 relative; ``rtol=1e-4, atol=1e-5`` on weights (atol: 1% of one step) and ``1e-5`` on
losses. A dropped or doubled contribution of one process changes losses and weights at ~1e-1.
LoRA runs 4 accumulated micro-batches per step, which communicate once: a DDP communication hook
counts the gradient all-reduces of the resumed run's steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.config import build_config
from finetune.export.writer import model_tensors
from finetune.metrics import read_metrics
from finetune.trainer import train
from launcher import ROOT, command, launch

STEPS = 4

# `python -m finetune` with a DDP-wrapped model given a comm hook that counts its bucket
# all-reduces (then runs DDP's default all-reduce), written to PROBE_DIR/rank<R>-allreduce.json.
# DDP prepares the reduction in the forward: `no_sync` must wrap forward and backward.
COUNT_ALL_REDUCES = '''
import atexit, json, os, sys
import torch
import finetune.trainer as trainer
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

calls = []
wrap = trainer.wrap_model

def counted(*args, **kwargs):
    model = wrap(*args, **kwargs)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        def hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)
        model.register_comm_hook(None, hook)
    return model

trainer.wrap_model = counted
atexit.register(lambda: json.dump(calls, open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}-allreduce.json"), "w")))
from finetune.cli import main
# Several runs in turn, their arguments separated by "::"; the main process prints "=== exit CODE" after
# each, on stdout and on stderr (the log).
runs, current = [], []
for arg in sys.argv[1:] + ["::"]:
    if arg == "::":
        runs.append(current)
        current = []
    else:
        current.append(arg)
for argv in runs:
    code = main(argv)
    if os.environ["RANK"] == "0":
        print(f"=== exit {code}", flush=True)
        print(f"=== exit {code}", file=sys.stderr, flush=True)
    if code:
        sys.exit(code)
'''


LORA_FILES = ["lora_comfyui.safetensors", "lora_diffusers.safetensors", "lora_kohya.safetensors"]


def _config(out: Path, cache: Path, method: str, batch_size: int, max_steps: int = STEPS, accumulation: int = 1) -> dict:
    lora = method == "lora"
    return {
        "output_dir": str(out),
        # Turbo: the same tiny model; validation samples it with the trained adapter (main process only).
        "model": {"pretrained_model_name_or_path": "tiny-random", **({"turbo_model_name_or_path": "tiny-random"} if lora else {})},
        "data": {"synthetic": {"num_prompts": 3, "size": 64}, "resolution": 64, "caption_dropout": 0.5, "cache_dir": str(cache)},
        "training": {"method": method, "max_steps": max_steps, "batch_size": batch_size, "seed": 3,
                     "gradient_accumulation_steps": accumulation},
        "lora": {"rank": 4, "alpha": 4},
        "optimizer": {"learning_rate": 1e-3, "max_grad_norm": 0.5},  # clipping needs the global norm
        "lr_scheduler": {"name": "cosine", "warmup_steps": 1},
        "parallel": {"strategy": "auto"},  # FSDP2 for full, DDP for LoRA
        "checkpointing": {"every_n_steps": 2 if max_steps == 4 else 3, "keep_last": 1},
        # Sampling a sharded model needs every process (FSDP gathers parameters collectively).
        "validation": {"every_n_steps": 0, "prompts": ["red"], "num_inference_steps": 2, "guidance_scale": 2.0,
                       "turbo_num_inference_steps": 2, "height": 64, "width": 64},
        "export": {"formats": ["diffusers", "comfyui", "kohya"] if lora else ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


pytestmark = pytest.mark.usefixtures("one_thread")


def _samples(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out / "samples")) for p in (out / "samples").rglob("*") if p.is_file())


def _assert_same_files(two: Path, one: Path, names: list[str]) -> None:
    for name in names:
        weights_two, weights_one = load_file(str(two / name)), load_file(str(one / name))
        assert weights_two.keys() == weights_one.keys(), name
        for key in weights_one:
            torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")


def _assert_two_equal_one(two: Path, one: Path, method: str, steps: int) -> None:
    """The 2-process run in ``two`` trained what the 1-process run in ``one`` trained: the same
    losses and gradient norms every step, the same exported weights, the end-of-run validation
    written once (by the main process: one folder, one file per kind), and a DCP checkpoint of
    the last step where every process wrote its own shard file, with the 1-process run's tensors."""
    rows_two, rows_one = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == list(range(1, steps + 1))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows_two]), torch.tensor([r["loss"] for r in rows_one]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows_two]), torch.tensor([r["grad_norm"] for r in rows_one]),
                               rtol=1e-4, atol=1e-6)
    _assert_same_files(two, one, ["transformer/diffusion_pytorch_model.safetensors"] if method == "full" else LORA_FILES)
    expected = [f"step-{steps:06d}/raw-00.png"] + ([f"step-{steps:06d}/turbo-00.png"] if method == "lora" else [])
    assert _samples(two) == _samples(one) == expected
    folder = two / "checkpoints" / f"step-{steps}"
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert model_tensors(folder) == model_tensors(one / "checkpoints" / f"step-{steps}")


MAX_STEPS, KILL_AFTER, ENDS_WITHIN = 6, 4, 90
ACCUMULATION = 4


def _rank(launcher_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:  # a helper process that ended meanwhile
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both mechanisms' 2-process runs, with two launches: torchrun (LoRA, DDP, killed) and one
    ``accelerate launch`` job whose processes resume that run and then run the full fine-tune (FSDP2)
    from scratch (COUNT_ALL_REDUCES: the CLI on each in turn); then both 1-process references. What
    the tests check of the killed run is recorded here as it stood before the resume."""
    tmp_path = tmp_path_factory.mktemp("distributed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the function-scoped one_thread fixture
    try:
        return _run_jobs(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run_jobs(tmp_path: Path) -> dict:
    record = {"root": tmp_path}
    out = tmp_path / "run"
    cache = tmp_path / "cache"
    config = _config(out, cache, "lora", batch_size=1, max_steps=MAX_STEPS, accumulation=ACCUMULATION)
    argv, env = command(config, tmp_path, 2, ["-m", "finetune"])
    job = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= KILL_AFTER):
            assert job.poll() is None, f"the job ended before step {KILL_AFTER}:\n{job.stdout.read()[-3000:]}"
            assert time.time() < deadline, f"no step {KILL_AFTER} within 600 s"
            time.sleep(0.005)
        _rank(job.pid, 1).send_signal(signal.SIGKILL)
        killed_at = time.time()
        job.wait(timeout=ENDS_WITHIN)
        record["ended_after"] = time.time() - killed_at
    finally:
        if job.poll() is None:
            job.kill()
    record["killed_returncode"] = job.returncode
    record["killed"] = read_metrics(out)
    record["samples_after_kill"] = (out / "samples").exists()
    record["checkpoints_after_kill"] = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    record["shards_after_kill"] = sorted(p.name for p in (out / "checkpoints" / "step-3").glob("*.distcp"))

    full = tmp_path / "full"
    full_config = tmp_path / "full.yaml"
    full_config.write_text(yaml.safe_dump(_config(full / "two", full / "cache", "full", batch_size=1)))
    probe = tmp_path / "probe.py"
    probe.write_text(COUNT_ALL_REDUCES)
    done = launch(config, tmp_path, 2, [str(probe)], "--resume", "::", str(full_config), launcher="accelerate")
    outputs, logs = (re.split(r"^=== exit .*$", text, flags=re.M) for text in (done.stdout, done.stderr))
    assert len(outputs) == len(logs) == 3, done.stdout[-2000:] + done.stderr[-3000:]
    record["logs"] = [outputs[i] + logs[i] for i in range(2)]  # the resume's, the full run's

    train(build_config(_config(tmp_path / "one", cache, "lora", batch_size=2, max_steps=MAX_STEPS, accumulation=ACCUMULATION)))
    train(build_config(_config(full / "one", full / "cache", "full", batch_size=2)))
    return record


def test_two_processes_equal_one_full_fine_tune_with_fsdp(jobs):
    log = jobs["logs"][1]
    assert "strategy fsdp" in log and "2 process(es)" in log
    _assert_two_equal_one(jobs["root"] / "full" / "two", jobs["root"] / "full" / "one", "full", STEPS)


def test_kill_9_of_rank_1_ends_the_job_and_resume_on_2_processes_with_accelerate(jobs):
    """torchrun, LoRA (DDP), 4 accumulated micro-batches per step: SIGKILL rank 1 once step 4 is
    logged (after the step-3 checkpoint); the launcher must end the job (non-zero) within
    ``ENDS_WITHIN`` s, not hang. ``accelerate launch`` on 2 processes then resumes from step 3: the
    steps logged past the checkpoint come out the same (``rtol=1e-5``: the same processes, the same
    sums), each of its optimizer steps all-reduces the gradients once (not once per micro-batch),
    and the run finishes with validation and exports. Every step, before the kill and after the
    resume, equals a 1-process run's with the same global batch (the module's bound)."""
    tmp_path, out = jobs["root"], jobs["root"] / "run"
    assert jobs["killed_returncode"] != 0, "a job that lost a rank must not report success"
    print(f"job ended {jobs['ended_after']:.1f} s after rank 1 was killed")
    killed = jobs["killed"]
    assert KILL_AFTER <= len(killed) < MAX_STEPS and not jobs["samples_after_kill"]
    assert jobs["checkpoints_after_kill"] == ["step-3"]
    assert jobs["shards_after_kill"] == ["__0_0.distcp", "__1_0.distcp"]

    assert "2 process(es), strategy ddp" in jobs["logs"][0]
    for rank in range(2):  # one bucket (the LoRA's gradients are small), one all-reduce per optimizer step
        calls = json.loads((tmp_path / f"rank{rank}-allreduce.json").read_text())  # the full run (FSDP) adds none
        assert set(calls) == {0} and len(calls) == MAX_STEPS - 3, (rank, calls)  # steps 4..6, not x ACCUMULATION
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    for before in killed:  # steps 4.. were lost with the kill and computed again
        after = rows[before["step"] - 1]
        for key in ("loss", "grad_norm", "lr"):
            assert after[key] == pytest.approx(before[key], rel=1e-5), (before["step"], key)

    _assert_two_equal_one(out, tmp_path / "one", "lora", MAX_STEPS)
