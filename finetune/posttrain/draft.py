"""``method: draft``: DRaFT-K / DRaFT-LV, tuning by back-propagating a differentiable reward
through the last sampling steps and the VAE decode (Clark et al., "Directly Fine-Tuning Diffusion
Models on Differentiable Rewards").

Each step takes ``training.batch_size`` prompts per process and samples them with the pipeline's
own pieces (:func:`.rollout.schedule`, :func:`.rollout.initial_noise`,
:func:`krea2_diffusers.sampling.euler_step` / ``guided_velocity``, ``decode_latents``): the
first ``num_inference_steps - draft_k`` Euler steps without gradients, the last ``draft_k`` with
them, then the decode with them. The rewards see the decoded images (B, 3, H, W) in [0, 1] and::

    loss = -mean over samples of sum_r weight_r * reward_r(images)

With ``draft_lv`` the final latent ``x0`` is also re-noised at the last step's time
``t = times[-2]`` (``(1 - t) sg(x0) + t eps``) and one more differentiable Euler step is taken
from there; the loss averages the two samples' rewards (DRaFT-LV's lower-variance estimate).

CFG (``guidance`` > 0, Krea convention): only the conditional branch carries gradients; the
unconditional one runs under ``no_grad`` (its output is a constant of the backward).

Memory: the transformer's blocks are checkpointed by the engine (``training.activation_checkpointing``)
in each of the ``draft_k`` (+1) differentiable steps; the VAE decode is checkpointed as a whole
(only its input latent is kept, the decode is recomputed in the backward).

Every transformer forward of a step, trained model and base alike, runs under the trained
model's autocast (``runtime.autocast()``), so with the model equal to its base the two sample
exactly the same images. ``eval/reward_vs_base`` (every ``eval_every_n_steps``) is the mean
reward of the model's samples on fixed seeds minus the base weights' on the same seeds.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from krea2_diffusers import sampling
from krea2_diffusers.conditioning.text import pad_conditioning
from krea2_diffusers.latents import decode_latents, unpack_latents

from ..engine.parallel import no_sync
from ..trainer import NonFiniteLossError
from .differentiable_rewards import score_images
from .rewards import load_rewards
from .rollout import initial_noise, schedule, text_fusion_frozen, text_inputs, velocity
from .trainer import PosttrainTrainer

# Generator index of the fixed evaluation noise, away from every training step's.
EVAL_SEED_INDEX = -3


class DraftTrainer(PosttrainTrainer):
    @classmethod
    def model_copies(cls, config):
        """The activations of the ``draft_k`` differentiable steps (+1 for LV) are kept together."""
        section = config.draft
        return super().model_copies(config, forward_batch=config.training.batch_size * (section.draft_k + int(section.draft_lv)))

    def prepare_inputs(self) -> None:
        section = self.config.draft
        self.prompts = self.config.prompt_list()
        self.rewards = load_rewards(section.rewards)  # import errors: refused before any model loads
        self.size = section.resolution
        self.base_eval_reward = None

    def encode_inputs(self) -> None:
        """Every prompt and the empty negative prompt (the last row), once."""
        self.text = self.encode_prompts([*self.prompts, ""])
        self.times = schedule(self.config.draft.num_inference_steps, self.size, self.size)

    def setup(self) -> None:
        super().setup()
        self.reuse_text = text_fusion_frozen(self.model)
        self.pipe.vae.requires_grad_(False)  # the gradient goes through the decode, never into it

    # ---------------------------------------------------------------- sampling
    def base(self, return_dict: bool = False, **inputs):
        """The base weights (:class:`.reference.Reference`) called like the transformer."""
        return (self.reference(self.model, **inputs),)

    def conditioning(self, prompt_ids: list[int]) -> tuple[dict, dict | None]:
        """The transformer's text arguments for the prompts and (with CFG) for the negative prompt."""
        def inputs(ids):
            embeds, mask = pad_conditioning([self.text[i][0] for i in ids], [self.text[i][1] for i in ids])
            device = self.runtime.device
            with self.runtime.autocast():  # the text fusion is part of every forward's precision
                return text_inputs(self.model, embeds.to(device), mask.to(device), self.size, self.size, reuse=self.reuse_text)

        uncond = inputs([len(self.prompts)] * len(prompt_ids)) if self.config.draft.guidance > 0 else None
        return inputs(prompt_ids), uncond

    def step_velocity(self, forward, latents: torch.Tensor, t: float, text: tuple[dict, dict | None]) -> torch.Tensor:
        """(B, N, C) velocity of ``forward`` at time t; with CFG the unconditional branch carries no gradient."""
        cond = velocity(forward, latents, t, text[0])
        guidance = self.config.draft.guidance
        if not sampling.guidance_active(t, guidance, None):
            return cond
        with torch.no_grad():
            uncond = velocity(forward, latents, t, text[1])
        return sampling.guided_velocity(cond, uncond, guidance)

    def sample(self, forward, text, noise: torch.Tensor, lv_noise: torch.Tensor | None = None,
               grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Euler samples (B, N, C) from ``noise`` (B, N, C); with ``grad`` the last ``draft_k``
        steps keep their graph. With ``lv_noise`` also the LV sample: the final latent re-noised
        at the last step's time and stepped once more (differentiably) to 0."""
        times, k = self.times, self.config.draft.draft_k
        first_grad = len(times) - 1 - k
        latents, lv = noise, None
        with self.runtime.autocast():
            for i, (t, t_next) in enumerate(zip(times[:-1], times[1:])):
                with torch.set_grad_enabled(grad and i >= first_grad):
                    latents = sampling.euler_step(latents, self.step_velocity(forward, latents, t, text), t, t_next)
            if lv_noise is not None:
                t = times[-2]
                start = sampling.noised(latents.detach(), lv_noise, t)
                with torch.set_grad_enabled(grad):
                    lv = sampling.euler_step(start, self.step_velocity(forward, start, t, text), t, times[-1])
        return latents, lv

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents (B, N, C) -> images (B, 3, H, W) in [0, 1] through the pipeline's
        decode, checkpointed when the latents carry gradients."""
        unpacked = unpack_latents(latents.to(next(self.pipe.vae.parameters()).device), self.size, self.size)
        if not latents.requires_grad:
            return decode_latents(self.pipe.vae, unpacked)
        return checkpoint(decode_latents, self.pipe.vae, unpacked, use_reentrant=False)

    # ---------------------------------------------------------------- one step
    def draft_inputs(self, index: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """This process's prompt ids, initial noise (B, N, C) and LV noise (or None) of forward
        ``index``, drawn for the run's whole global batch (the same after a resume on any number
        of processes)."""
        runtime = self.runtime
        total = self.global_batch.micro_batch
        per_rank = total // runtime.world_size
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        generator = self.generator(index)
        order = torch.randperm(len(self.prompts), generator=generator).tolist()
        global_ids = [order[i % len(order)] for i in range(total)]
        noise = initial_noise(total, self.pipe.transformer.config.in_channels, self.size, self.size, generator)
        lv_noise = torch.randn(noise.shape, generator=generator)[mine].to(runtime.device) if self.config.draft.draft_lv else None
        return global_ids[mine], noise[mine].to(runtime.device), lv_noise

    def train_step(self, step: int, items=None) -> tuple[float, float]:
        runtime, section = self.runtime, self.config.draft
        accumulation = self.global_batch.accumulation
        loss_value, stats = 0.0, {}

        def add(key, value):
            stats[key] = stats.get(key, 0.0) + value / accumulation

        for micro in range(accumulation):
            index = step * accumulation + micro
            prompt_ids, noise, lv_noise = self.draft_inputs(index)
            text = self.conditioning(prompt_ids)
            prompts = [self.prompts[i] for i in prompt_ids]
            metadata = [{"prompt_index": i, "step": step + 1, "sample": j} for j, i in enumerate(prompt_ids)]
            latents, lv = self.sample(self.model, text, noise, lv_noise)
            reward, raw = score_images(self.rewards, self.decode(latents), prompts, metadata)
            add("reward_mean", float(runtime.mean(reward.detach().mean())))
            add("reward_std", float(reward.detach().std(unbiased=False)))
            for name, values in raw.items():
                add(f"reward/{name}", float(runtime.mean(values.mean())))
            if lv is not None:
                lv_reward, _ = score_images(self.rewards, self.decode(lv), prompts, metadata)
                add("reward_lv_mean", float(runtime.mean(lv_reward.detach().mean())))
                reward = (reward + lv_reward) / 2
            loss = -reward.mean()
            value = float(runtime.mean(loss))
            if not math.isfinite(value):
                raise NonFiniteLossError(f"DRaFT loss is {value} at step {step + 1} on prompts {sorted(set(prompts))}; "
                                         f"the last checkpoint is kept in {self.checkpointer.folder}")
            with no_sync(self.model, runtime, sync=micro == accumulation - 1):
                (loss / accumulation).backward()
            loss_value += value / accumulation
        grad_norm = self.optimizer_step()
        self.lr_scheduler.step()
        if self.eval_due(step, section.eval_every_n_steps):
            stats.update(self.evaluate())
        self.extra_metrics = stats
        return loss_value, grad_norm

    @torch.no_grad()
    def eval_reward(self, forward) -> float:
        """Mean total reward of ``forward``'s samples (no gradients, the training guidance), every
        prompt x ``eval_seeds`` from fixed noise."""
        section = self.config.draft
        ids = [i for i in range(len(self.prompts)) for _ in range(section.eval_seeds)]
        noise = initial_noise(len(ids), self.pipe.transformer.config.in_channels, self.size, self.size,
                              self.generator(EVAL_SEED_INDEX)).to(self.runtime.device)
        latents, _ = self.sample(forward, self.conditioning(ids), noise, grad=False)
        metadata = [{"prompt_index": i, "sample": j, "eval": True} for j, i in enumerate(ids)]
        total, _ = score_images(self.rewards, self.decode(latents), [self.prompts[i] for i in ids], metadata)
        return float(total.mean())

    def evaluate(self) -> dict[str, float]:
        """``eval/reward_mean`` and ``eval/reward_vs_base`` (the base's reward on the same seeds,
        computed once: the base never changes)."""
        self.model.eval()
        try:
            if self.base_eval_reward is None:
                self.base_eval_reward = self.eval_reward(self.base)
            reward = self.eval_reward(self.model)
        finally:
            self.model.train()
        return {"eval/reward_mean": reward, "eval/reward_vs_base": reward - self.base_eval_reward}
