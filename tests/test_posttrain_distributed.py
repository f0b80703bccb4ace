"""`krea2 posttrain` dpo / grpo / distill / draft (LoRA) on 2 processes (torchrun, gloo, DDP) with
validation and held-out metrics on: each exits 0, logs and exports what 1 process logs and exports
with the same global batch, and writes its samples and log lines once. DRaFT runs 2 accumulated
micro-batches per step (draft_k 2 and 2 LV steps: several forwards per backward) and its 2-process
run counts DDP's gradient all-reduces (tests/posttrain_allreduce_worker.py): one per optimizer step.
The four 2-process runs are one torchrun job whose processes run the CLI on each config in turn
(tests/posttrain_allreduce_worker.py: the heavy imports once, not once per method and rank).

Bound: the two runs differ only in where float32 sums are split (each process reduces its half of
the global batch, one all-reduce adds the halves; the noise and timesteps are drawn for the global
batch and sliced), so step 1's losses and metrics agree to a few ulps of their summands (``rtol=1e-5``,
``atol=1e-6``). Adam divides each update by the gradient's running scale, so a reassociation error
of k * 2**-24 * sum|terms| (k: terms summed, a few hundred) stays ~1e-4 relative in the weights
where the gradient is large, but reaches a few % of one step (lr) on the odd element whose gradient
nearly cancels. Hence: the metrics of later steps to ``rtol=1e-4``; each adapter tensor to 1e-3
relative in Frobenius norm, and no element by more than one step (lr), which Adam's update never
exceeds. One process's contribution dropped or counted twice flips update signs: ~1e-2..1 relative.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.config import build_config
from finetune.metrics import read_metrics
from finetune.posttrain.config import PosttrainConfig
from finetune.posttrain.run import posttrain
from launcher import ROOT, command

TESTS = Path(__file__).resolve().parent
MAX_STEPS = 2
LEARNING_RATE = 1.0e-3
# Adam's first step moves each weight by lr * g / (|g| + eps): with the default eps (1e-8), a
# gradient component near eps turns the float reassociation of 1 vs 2 processes (~1e-7 relative)
# into a weight difference of a good fraction of lr, and the step-2 metrics carry it (DPO's step-2
# grad norm differed by 1.8e-4 relative on one machine, within 1e-4 on the earlier ones). An eps
# of the order of the gradient components keeps the update's slope in g at most lr / eps = 1, so
# the step-2 differences stay at the reassociation level the rtol below is set for.
ADAM_EPS = 1.0e-3
TURBO = {"dpo", "grpo"}  # sample a Turbo with the adapter too (the distilled student is sampled as RAW)
DRAFT_MICRO_BATCHES = 2  # accumulated forwards per optimizer step: all but the last must skip DDP's all-reduce
# The 2-process runs: one job running the same CLI on each config in turn; DRaFT's run records DDP's
# gradient all-reduces.
WORKER = str(TESTS / "posttrain_allreduce_worker.py")
COUNTED = {"draft"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _configs(tmp: Path, batch_size: int) -> dict[str, dict]:
    def common(method: str) -> dict:
        model = {"pretrained_model_name_or_path": "tiny-random"}
        if method in TURBO:
            model["turbo_model_name_or_path"] = "tiny-random"
        return {
            "output_dir": str(tmp / method), "method": method, "model": model,
            "training": {"method": "lora", "max_steps": MAX_STEPS, "batch_size": batch_size, "seed": 3},
            "lora": {"rank": 4, "alpha": 4}, "optimizer": {"learning_rate": LEARNING_RATE, "max_grad_norm": 0.5, "eps": ADAM_EPS},
            "checkpointing": {"every_n_steps": 0, "keep_last": 1},
            "validation": {"prompts": ["red"], "num_inference_steps": 2, "turbo_num_inference_steps": 2, "guidance_scale": 2.0,
                           "height": 32, "width": 32},
            "export": {"formats": ["diffusers"]}, "logging": {"progress_bar": False, "tensorboard": False},
        }

    return {
        "dpo": {**common("dpo"), "dpo": {"data": str(tmp / "pairs" / "pairs.jsonl"), "synthetic": {"num_pairs": 6, "size": 32},
                                         "resolution": 32, "heldout_pairs": 2, "eval_every_n_steps": MAX_STEPS, "sft_weight": 1.0}},
        "grpo": {**common("grpo"), "grpo": {"prompts": ["a picture", "an image of a thing"], "group_size": 2, "num_inference_steps": 3,
                                            "sde_steps": 2, "resolution": 32, "rewards": [{"function": "posttrain_rewards:brightness"}],
                                            "eval_every_n_steps": MAX_STEPS, "eval_seeds": 1, "pool": {"min_std": 0.0}}},
        "distill": {**common("distill"), "distill": {"prompts": ["a picture", "a landscape"], "student_steps": 2, "resolution": 32}},
        "draft": {**common("draft"), "training": {**common("draft")["training"], "gradient_accumulation_steps": DRAFT_MICRO_BATCHES},
                  "draft": {"prompts": ["a picture", "an image of a thing", "a third"], "num_inference_steps": 3, "draft_k": 2,
                            "draft_lv": True, "lv_samples": 2, "resolution": 32,
                            "rewards": [{"function": "posttrain_rewards:redness"}], "eval_every_n_steps": MAX_STEPS, "eval_seeds": 1}},
    }


def _samples(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out / "samples")) for p in (out / "samples").rglob("*") if p.is_file())


def _difference_atol(key: str, row: dict, rtol: float, config: dict) -> float:
    """DPO's margins and ``*_vs_reference`` are differences of flow-matching losses: their error is
    the losses' relative error times the losses (times beta / 2 for the margin), not times the
    (cancelled, small) difference itself."""
    prefix = key.split("/")[0] + "/"
    losses = abs(row.get(prefix + "chosen_loss", 0.0)) + abs(row.get(prefix + "rejected_loss", 0.0))
    if key.endswith("margin"):
        return rtol * config["dpo"].get("beta", 2500.0) / 2 * 2 * losses  # L and L_ref of both samples
    if key.endswith("vs_reference"):
        return rtol * 2 * losses
    if key == "eval/reward_vs_base":  # reward minus the base's reward (= reward - vs_base): both carry rtol
        reward = row["eval/reward_mean"]
        return rtol * (abs(reward) + abs(reward - row[key]))
    if key == "reward_std":  # off by at most the largest sample's error; of n = 4 samples none exceeds |mean| + sqrt(n) std
        return rtol * (abs(row["reward_mean"]) + 2 * row[key])
    return 1e-6


def test_each_method_on_two_processes_equals_one_with_validation_and_exports(tmp_path):
    two, one = _configs(tmp_path / "two", batch_size=1), _configs(tmp_path / "one", batch_size=2)
    # One 2-process job (2 single-threaded processes, the 2 cores CI has) running the four methods in
    # turn, started from a thread while this process runs the 1-process references (1 thread; much
    # of a job's time is start-up and waits on its peer).
    paths = []
    for method, config in two.items():
        folder = tmp_path / "two" / f"{method}-launch"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        paths += ["--count"] * (method in COUNTED) + [str(folder / "config.yaml")]
    argv, env = command(two["dpo"], tmp_path / "two" / "dpo-launch", 2, [WORKER], *paths[1:])
    assert argv[-len(paths):] == paths
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])
    result, running = {}, []

    def run_job():
        job = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        running.append(job)
        result["log"] = job.communicate(timeout=4 * 600)[0]

    runner = threading.Thread(target=run_job, daemon=True)
    runner.start()
    sys.path.insert(0, str(TESTS))
    try:
        for config in one.values():
            posttrain(build_config(config, cls=PosttrainConfig))
        runner.join(timeout=4 * 600)
    finally:
        for job in running:
            if job.poll() is None:
                job.kill()
    assert "log" in result, "the 2-process job did not finish"
    log = result["log"]
    assert running[0].returncode == 0, log[-4000:]
    # The main process's lines of each run end with its "=== CONFIG exit CODE" line.
    ends = [line for line in log.splitlines() if line.startswith("=== ")]
    assert ends == [f"=== {tmp_path / 'two' / f'{m}-launch' / 'config.yaml'} exit 0" for m in two], log[-4000:]
    for method, part in zip(two, re.split(r"^=== .*$", log, flags=re.M)):
        assert part.count("2 process(es)") == 1, (method, part[-4000:])  # the main process logs, once

    # Every bucket of DDP's gradients all-reduced exactly once per optimizer step, on both processes
    # (before the fix each of the DRAFT_MICRO_BATCHES forwards armed its backward's all-reduce).
    probes = [json.loads((tmp_path / "two" / "draft-launch" / f"allreduce-{rank}.json").read_text()) for rank in (0, 1)]
    assert probes[0] == probes[1] and len(probes[0]) == MAX_STEPS, probes
    for buckets in probes[0]:
        assert buckets == list(range(len(buckets))) and buckets, probes

    for method in two:
        out_two, out_one = Path(two[method]["output_dir"]), Path(one[method]["output_dir"])
        rows_two, rows_one = read_metrics(out_two), read_metrics(out_one)
        assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == list(range(1, MAX_STEPS + 1))
        # accuracy: the fraction of margins > 0, a step function of them (the margins are compared).
        keys = {k for r in rows_one for k in r if k != "step_time" and not k.endswith(("_per_s", "accuracy"))}
        assert {"heldout/margin", "eval/reward_mean"} & keys or method == "distill", sorted(keys)
        for row_two, row_one in zip(rows_two, rows_one):
            assert row_two.keys() == row_one.keys()
            for key in sorted(keys & row_one.keys()):
                rtol = 1e-5 if row_one["step"] == 1 else 1e-4  # after an Adam step: the weights' bound
                torch.testing.assert_close(torch.tensor(float(row_two[key])), torch.tensor(float(row_one[key])), rtol=rtol,
                                           atol=_difference_atol(key, row_one, rtol, one[method]),
                                           msg=lambda m: f"{method} step {row_one['step']} {key}: {m}")
        lora_two, lora_one = load_file(str(out_two / "lora_diffusers.safetensors")), load_file(str(out_one / "lora_diffusers.safetensors"))
        assert lora_two.keys() == lora_one.keys() and lora_one
        for key in lora_one:
            difference = (lora_two[key].double() - lora_one[key].double())
            assert float(difference.norm()) <= 1e-3 * float(lora_one[key].double().norm()) + 1e-7, (method, key, float(difference.norm()))
            assert float(difference.abs().max()) <= LEARNING_RATE, (method, key)
        expected = [f"step-{MAX_STEPS:06d}/raw-00.png"] + ([f"step-{MAX_STEPS:06d}/turbo-00.png"] if method in TURBO else [])
        assert _samples(out_two) == _samples(out_one) == expected, method
