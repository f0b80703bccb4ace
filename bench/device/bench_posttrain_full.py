"""One GRPO iteration and one TDM distillation step of the full-size Krea 2 transformer on one GPU.

    python bench/device/bench_posttrain_full.py                 # both, 12.8B, random weights
    python bench/device/bench_posttrain_full.py --tiny          # CPU dry run of the same code
    python bench/device/bench_posttrain_full.py --only grpo --group-size 8 --resolution 1024
    python bench/device/bench_posttrain_full.py --only tdm --tdm full       # needs > 141 GB at 12.8B

GRPO (LoRA rank --rank on a bf16 base): --prompts x --group-size guidance-free rollouts of --steps
steps (the SDE on --sde-steps of them), then one clipped-ratio update with the KL to the
reference (the adapter switched off) on every exploring step. Rewards are random numbers (a
reward model's cost is its own); VAE decoding is not included.

TDM, ``--tdm lora`` (default, what fits one GPU): the student and the fake score are two LoRA
adapters on one bf16 base, which is the teacher with the adapters off. ``--tdm full``: full
student + full fake score + frozen teacher, all bf16 (fp32 masters with AdamW need 16 bytes per
parameter per trained model, 410 GB for the pair: a real full distillation shards them over
several GPUs with FSDP2; --optimizer adamw8bit needs bitsandbytes, ``none`` steps without
optimizer state). One step: the student runs to its last step without gradients, one student
pass with gradients, the teacher with CFG (both branches batched), the fake score without and
with gradients, one backward and the optimizer step.

Random weights and inputs: speed and memory are those of real ones, no download. Prints one JSON
row per method: seconds (mean after a warm-up) and peak allocated GPU memory.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_full import FULL_CONFIG, GIB, TINY_CONFIG, build_model  # noqa: E402
from finetune.config import LoRAConfig, OptimizerConfig  # noqa: E402
from finetune.methods import add_lora  # noqa: E402
from finetune.optimization.optim import make_optimizer  # noqa: E402
from finetune.posttrain.grpo import clipped_policy_loss, gaussian_step_kl  # noqa: E402
from finetune.posttrain.reference import Reference  # noqa: E402
from finetune.posttrain.rewards import group_advantages  # noqa: E402
from finetune.posttrain.rollout import initial_noise, schedule, sde_rollout, step_log_prob, text_inputs, velocity  # noqa: E402
from finetune.posttrain.tdm import dmd_student_loss  # noqa: E402
from krea2_diffusers import sampling  # noqa: E402


def _text(config: dict, batch: int, text_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layers = config.get("num_text_layers", 12)
    dim = config.get("text_hidden_dim", 2560)
    return torch.randn(batch, text_len, layers, dim, device=device, dtype=dtype), torch.ones(batch, text_len, dtype=torch.bool, device=device)


def autocast(device):
    """Every forward's precision (the trainer's ``runtime.autocast``): bf16 on a GPU, off on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def grpo_iteration(model, reference, optimizer, args, device, dtype) -> None:
    n = args.prompts * args.group_size
    embeds, mask = _text(args.config, n, args.text_len, device, dtype)
    times = schedule(args.steps, args.resolution, args.resolution)
    generator = torch.Generator().manual_seed(0)
    noise = initial_noise(n, 64, args.resolution, args.resolution, generator).to(device)
    explore = list(range(args.sde_steps))
    with autocast(device):
        # Under autocast like every forward of the trainer (the text fusion's norms stay float32).
        text = text_inputs(model, embeds, mask, args.resolution, args.resolution, reuse=True)
        rollout = sde_rollout(model, text, noise, times, explore, 0.7, generator)
        advantages = group_advantages(torch.rand(n, generator=generator, dtype=torch.float64), args.group_size).float().to(device)
        for k, (t, t_next) in enumerate(rollout.times):
            log_probs, mean, std = step_log_prob(model, rollout.states[k], rollout.next_states[k], t, t_next, times[1], 0.7, text)
            ref_v = reference(model, hidden_states=rollout.states[k], timestep=torch.full((n,), t, device=device), **text)
            _, ref_mean, _ = sampling.sde_step(rollout.states[k], ref_v, t, t_next, 0.7, noise=torch.zeros_like(ref_v), t_cap=times[1])
            policy, _ = clipped_policy_loss(log_probs, rollout.log_probs[k], advantages, 1e-4)
            ((policy + 0.04 * gaussian_step_kl(mean, ref_mean, std)).mean() / len(explore)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tdm_step(student, fake, teacher, optimizer, args, device, dtype) -> None:
    """One distillation step as the trainer runs it at its most expensive student step (k = K-1):
    the student's trajectory without gradients, one fake-score update with its own backward, then
    the student's update from distribution matching (teacher with CFG + fake score) and trajectory
    matching (teacher_steps / student_steps guided teacher steps over the segment)."""
    b = args.prompts
    embeds, mask = _text(args.config, b, args.text_len, device, dtype)
    uncond, uncond_mask = _text(args.config, b, args.text_len, device, dtype)
    times = sampling.sigma_schedule(args.student_steps, sampling.DISTILLED_SHIFT).tolist()
    generator = torch.Generator().manual_seed(0)
    latents = initial_noise(b, 64, args.resolution, args.resolution, generator).to(device)
    k = args.student_steps - 1  # the longest trajectory: the most expensive step
    raw = lambda e, m: text_inputs(torch.nn.Identity(), e, m, args.resolution, args.resolution, reuse=False)
    cond, both = raw(embeds, mask), raw(torch.cat([embeds, uncond]), torch.cat([mask, uncond_mask]))

    def guided(x, t):
        v_cond, v_uncond = velocity(teacher, torch.cat([x, x]), t, both).chunk(2)
        return sampling.guided_velocity(v_cond, v_uncond, 3.5)

    def optimizer_step():
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with autocast(device):
        with torch.no_grad():
            for i in range(k):
                latents = sampling.euler_step(latents, velocity(student, latents, times[i], cond), times[i], times[i + 1])
            sample = latents - times[k] * velocity(student, latents, times[k], cond)
        tau = torch.full((b, 1, 1), 0.5 * times[k], device=device)
        eps = torch.randn_like(sample)
        noisy = (1 - tau) * sample + tau * eps
        fake_loss = (velocity(fake, noisy, float(tau[0]), cond) - (eps - sample)).pow(2).mean()
        fake_loss.backward()
        optimizer_step()

        v = velocity(student, latents, times[k], cond)
        x0_hat = latents - times[k] * v
        noisy = (1 - tau) * x0_hat.detach() + tau * torch.randn_like(x0_hat)
        with torch.no_grad():
            x0_teacher = noisy - tau * guided(noisy, float(tau[0]))
            x0_fake = noisy - tau * velocity(fake, noisy, float(tau[0]), cond)
            substeps = max(1, round(args.teacher_steps / args.student_steps))
            segment = torch.linspace(times[k], times[k + 1], substeps + 1).tolist()
            x = latents
            for t, t_next in zip(segment[:-1], segment[1:]):
                x = sampling.euler_step(x, guided(x, t), t, t_next)
            target = (x - latents) / (times[k + 1] - times[k])
        loss = dmd_student_loss(x0_hat, x0_fake, x0_teacher) + (v - target).pow(2).mean()
    loss.backward()
    optimizer_step()


def _adapter(model, name: str, params):
    """Call ``model`` with only adapter ``name`` active (both adapters stay trainable)."""

    def call(**inputs):
        model.set_adapter(name)
        for param in params:
            param.requires_grad_(True)
        return model(**inputs)

    return call


def measure(name: str, step, args, device) -> dict:
    times = []
    for _ in range(args.repeats + 1):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    return {"method": name, "seconds": sum(times[1:]) / len(times[1:]), "peak_gib": round(peak, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", choices=["grpo", "tdm"])
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sde-steps", type=int, default=4)
    parser.add_argument("--student-steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tdm", choices=["lora", "full"], default="lora")
    parser.add_argument("--teacher-steps", type=int, default=52, help="TDM: the trajectory term runs teacher_steps / student_steps teacher steps")
    parser.add_argument("--optimizer", choices=["adamw8bit", "none"], default="none", help="--tdm full only")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.config = TINY_CONFIG if args.tiny else FULL_CONFIG
    precision = functools.partial(autocast, device)  # the reference's passes, as every other forward
    if args.tiny:
        args.resolution, args.text_len, args.steps = 64, 8, 4
    rows = []
    if args.only in (None, "grpo"):
        model = build_model(args.config, device, dtype)
        reference = Reference(precision)
        params = add_lora(model, LoRAConfig(rank=args.rank, alpha=float(args.rank)))
        model.enable_gradient_checkpointing()
        optimizer = make_optimizer(params, OptimizerConfig(learning_rate=1e-4))
        rows.append(measure("grpo", lambda: grpo_iteration(model, reference, optimizer, args, device, dtype), args, device))
        del model, optimizer, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    if args.only in (None, "tdm"):
        base = build_model(args.config, device, dtype)
        if args.tdm == "lora":
            params = add_lora(base, LoRAConfig(rank=args.rank, alpha=float(args.rank)), adapter_names=("default", "fake"))
            base.enable_gradient_checkpointing()
            base.train()
            reference = Reference(precision)
            student, fake = _adapter(base, "default", params), _adapter(base, "fake", params)
            teacher = lambda **inputs: (reference(base, **{k: v for k, v in inputs.items() if k != "return_dict"}),)
            optimizer = make_optimizer(params, OptimizerConfig(learning_rate=1e-5))
        else:
            teacher = base.requires_grad_(False).eval()
            student, fake = copy.deepcopy(teacher).requires_grad_(True), copy.deepcopy(teacher).requires_grad_(True)
            for model in (student, fake):
                model.enable_gradient_checkpointing()
                model.train()
            optimizer = None
            if args.optimizer != "none":
                optimizer = make_optimizer([*student.parameters(), *fake.parameters()],
                                           OptimizerConfig(name=args.optimizer, learning_rate=1e-6))
        rows.append(measure(f"tdm-{args.tdm}", lambda: tdm_step(student, fake, teacher, optimizer, args, device, dtype),
                            args, device))
    for row in rows:
        print(json.dumps({**row, "resolution": args.resolution, "tiny": args.tiny}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
