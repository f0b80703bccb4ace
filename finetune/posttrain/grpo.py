"""``method: grpo``: group-relative policy optimisation for the flow model (as in Flow-GRPO).

Each step: ``training.batch_size`` prompts per process from the pool, ``group_size`` guidance-free
rollouts each, the SDE (same marginals as the ODE) on ``sde_steps`` exploring steps; rewards
from the plug-ins; advantages normalised within each prompt's group. Then
``updates_per_rollout`` optimizer updates of::

    loss = mean over samples and exploring steps k of
           -min(A r_k, A clip(r_k, 1 - eps, 1 + eps)) + kl_weight * |mu_k - mu_ref,k|^2 / (2 s_k^2)

with ``r_k = p_theta(x_{k+1} | x_k) / p_rollout(x_{k+1} | x_k)`` from the per-step Gaussian
log-probabilities and the KL the closed form between the two Gaussian steps (current vs base
weights). No CFG anywhere in training: guidance stays available at inference.
"""

from __future__ import annotations

import logging
import math

import torch

from krea2_diffusers.conditioning.text import pad_conditioning

from ..engine.parallel import no_sync
from .prompt_pool import PoolLog, PromptPool
from ..trainer import NonFiniteLossError
from .rewards import group_advantages, load_rewards, score
from .rollout import decode_to_pil, initial_noise, ode_samples, schedule, sde_rollout, step_log_prob, text_fusion_frozen, text_inputs
from .trainer import PosttrainTrainer

logger = logging.getLogger("finetune")

# Generator index of the fixed evaluation noise, away from every training step's.
EVAL_SEED_INDEX = -2


def clipped_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate; all (B,). Returns (per-sample loss (B,), clipped mask (B,))."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), (ratio - 1.0).abs() > clip_range


def exploring_steps(steps: int, window: int | None, start: int | None, generator: torch.Generator) -> list[int]:
    """Indices of the sampler steps that explore (SDE) and are trained: ``window`` consecutive steps
    (None = all ``steps``) from ``start``, or from a start drawn from ``generator`` when ``start`` is None."""
    window = window or steps
    if start is None:
        start = int(torch.randint(0, steps - window + 1, (1,), generator=generator))
    return list(range(start, start + window))


def gaussian_step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: float) -> torch.Tensor:
    """(B,) KL between N(mean, s^2) and N(ref_mean, s^2) per element, averaged over (N, C)."""
    return ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(1) / (2 * std**2)


class GRPOTrainer(PosttrainTrainer):
    @classmethod
    def model_copies(cls, config):
        """The update re-scores every rollout of the process's prompts in one forward."""
        return super().model_copies(config, forward_batch=config.training.batch_size * config.grpo.group_size)

    def prepare_inputs(self) -> None:
        section = self.config.grpo
        self.prompts = self.config.prompt_list()
        self.rewards = load_rewards(section.rewards)  # import errors: refused before any model loads
        self.pool = PromptPool(self.prompts, section.pool)
        self.pool_log = PoolLog(self.out / "prompt_pool.jsonl", self.runtime.is_main)
        self.size = section.resolution

    def encode_inputs(self) -> None:
        self.text = self.encode_prompts(self.prompts)
        self.times = schedule(self.config.grpo.num_inference_steps, self.size, self.size)

    def setup(self) -> None:
        super().setup()
        self.reuse_text = text_fusion_frozen(self.model)

    def _restore(self) -> int:
        step = super()._restore()
        self.pool_log.replay(self.pool, step)
        return step

    def conditioning(self, prompt_ids: list[int], repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B * repeat, L, layers, dim) embeds and (B * repeat, L) mask on the device."""
        embeds, mask = pad_conditioning([self.text[i][0] for i in prompt_ids], [self.text[i][1] for i in prompt_ids])
        device = self.runtime.device
        return embeds.repeat_interleave(repeat, 0).to(device), mask.repeat_interleave(repeat, 0).to(device)

    def train_step(self, step: int, items=None) -> tuple[float, float]:
        runtime, section = self.runtime, self.config.grpo
        # The run's global batch of prompts, kept on resume with another number of processes.
        group, per_rank = section.group_size, self.global_batch.micro_batch // runtime.world_size
        generator = self.generator(step)
        global_ids = self.pool.sample(self.global_batch.micro_batch, generator)
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        prompt_ids = global_ids[mine]
        explore = exploring_steps(len(self.times) - 1, section.sde_steps, section.sde_window_start, generator)
        channels = self.pipe.transformer.config.in_channels
        noise = initial_noise(len(global_ids) * group, channels, self.size, self.size, generator)
        rows = slice(runtime.rank * per_rank * group, (runtime.rank + 1) * per_rank * group)
        noise = noise[rows]
        sde_generator = self.generator(f"sde-{step}")  # the global batch's: the same on any number of processes

        # 1. Rollouts with the current weights, and their rewards.
        # Every forward (rollout, updates, reference) under the run's one precision policy: the
        # first update's ratios are then exactly 1 and its KL exactly 0 whatever mixed_precision.
        embeds, mask = self.conditioning(prompt_ids, group)
        with runtime.autocast():
            text = text_inputs(self.model, embeds, mask, self.size, self.size, reuse=self.reuse_text)
            self.model.eval()
            rollout = sde_rollout(self.model, text, noise.to(runtime.device), self.times, explore, section.noise_level,
                                  sde_generator, rows, len(global_ids) * group)
            self.model.train()
        prompts = [self.prompts[i] for i in prompt_ids for _ in range(group)]
        metadata = [{"prompt_index": i, "step": step + 1, "sample": k} for i in prompt_ids for k in range(group)]
        images = decode_to_pil(self.pipe.vae, rollout.latents, self.size, self.size)
        total, raw = score(self.rewards, images, prompts, metadata)
        advantages = group_advantages(total, group).float().to(runtime.device)
        # every process's rewards in rank order: the pool must agree everywhere
        all_totals = runtime.gather(total.float()).view(-1, group)
        groups = [(pid, all_totals[g].tolist()) for g, pid in enumerate(global_ids)]
        for prompt_id, values in groups:
            self.pool.update(prompt_id, values)
        if runtime.is_main:
            self.pool_log.append(step + 1, groups)

        # 2. Clipped-ratio updates on the exploring steps, with the KL to the base weights.
        t_cap = self.times[1]
        # The base weights' step means do not change between updates: once per rollout.
        ref_means = [step_log_prob(_Frozen(self), rollout.states[k], rollout.next_states[k], t, t_next, t_cap,
                                   section.noise_level, text)[1] for k, (t, t_next) in enumerate(rollout.times)]
        stats = {"policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        grad_norm = 0.0
        for _ in range(section.updates_per_rollout):
            for k, (t, t_next) in enumerate(rollout.times):
                # One gradient all-reduce per update: the exploring steps' backwards accumulate.
                with no_sync(self.model, runtime, sync=k == len(rollout.times) - 1):
                    with runtime.autocast():
                        log_probs, mean, std = step_log_prob(self.model, rollout.states[k], rollout.next_states[k], t, t_next,
                                                             t_cap, section.noise_level, text)
                    policy, clipped = clipped_policy_loss(log_probs, rollout.log_probs[k], advantages, section.clip_range)
                    kl = gaussian_step_kl(mean, ref_means[k], std)
                    loss = (policy + section.kl_weight * kl).mean() / len(rollout.times)
                    if not math.isfinite(float(loss.detach())):
                        raise NonFiniteLossError(f"GRPO loss is {float(loss.detach())} at step {step + 1} on prompts "
                                                 f"{sorted(set(prompts))}; the last checkpoint is kept in {self.checkpointer.folder}")
                    loss.backward()
                scale = len(rollout.times) * section.updates_per_rollout
                stats["policy_loss"] += float(policy.detach().mean()) / scale
                stats["kl"] += float(kl.detach().mean()) / scale
                stats["clip_fraction"] += float(clipped.float().mean()) / scale
            grad_norm = self.optimizer_step()
        self.lr_scheduler.step()

        # Means over the global batch (every process has as many samples), as one process logs them.
        stats = runtime.means(stats)
        stats["reward_mean"] = float(all_totals.mean())  # the global batch's rewards, gathered above
        stats["reward_std"] = float(all_totals.std(unbiased=False))
        stats.update({f"reward/{name}": float(runtime.gather(values.float()).mean()) for name, values in raw.items()})
        stats.update(self.pool.summary())
        if self.eval_due(step, section.eval_every_n_steps):
            stats["eval/reward_mean"] = self.evaluate()
        self.extra_metrics = stats
        return stats["policy_loss"] + section.kl_weight * stats["kl"], grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean total reward of guidance-free ODE samples, fixed noise, every prompt x ``eval_seeds``."""
        section = self.config.grpo
        ids = list(range(len(self.prompts)))
        embeds, mask = self.conditioning(ids, section.eval_seeds)
        noise = initial_noise(len(ids) * section.eval_seeds, self.pipe.transformer.config.in_channels, self.size, self.size,
                              self.generator(EVAL_SEED_INDEX))
        self.model.eval()
        try:
            with self.runtime.autocast():
                text = text_inputs(self.model, embeds, mask, self.size, self.size, reuse=self.reuse_text)
                latents = ode_samples(self.model, text, noise.to(self.runtime.device), self.times)
        finally:
            self.model.train()
        prompts = [self.prompts[i] for i in ids for _ in range(section.eval_seeds)]
        metadata = [{"prompt_index": i, "sample": k, "eval": True} for i in ids for k in range(section.eval_seeds)]
        total, _ = score(self.rewards, decode_to_pil(self.pipe.vae, latents, self.size, self.size), prompts, metadata)
        return float(total.mean())


class _Frozen:
    """The reference (base weights) called like a model, for :func:`step_log_prob`."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def __call__(self, return_dict: bool = False, **inputs):
        return (self.trainer.reference(self.trainer.model, **inputs),)
