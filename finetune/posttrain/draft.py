"""``method: draft``: DRaFT-K / DRaFT-LV, tuning by back-propagating a differentiable reward
through the last sampling steps and the VAE decode (Clark et al., "Directly Fine-Tuning Diffusion
Models on Differentiable Rewards").

Each step takes ``training.batch_size`` prompts per process and samples them with the pipeline's
own pieces (:func:`.rollout.schedule`, :func:`.rollout.initial_noise`,
:func:`krea2_diffusers.sampling.euler_step` / ``guided_velocity``, ``decode_latents``): the
first ``num_inference_steps - draft_k`` Euler steps without gradients, the last ``draft_k`` with
them, then the decode with them. The rewards see the decoded images (B, 3, H, W) in [0, 1] and::

    loss = -mean over samples of sum_r weight_r * reward_r(images)  [+ anchor_weight * anchor]

``anchor_weight`` > 0 adds the base anchor: at each differentiable step, the mean squared
difference between the trained and the base weights' conditional velocity on the trained
model's own latents, averaged over those steps (logged as ``anchor``). Reward maximisation alone
has no term that keeps the model near its base, and a classifier reward is then reached by
texture it misreads (the proving ground's DRaFT: reward 0.69 -> 0.98 while the judge's accuracy
fell); with the anchor the optimum is the base tilted toward the reward, as KL-regularised
fine-tuning has it.

With ``draft_lv`` the final latent ``x0`` is also re-noised ``lv_samples`` times at the last
step's time ``t = times[-2]`` (``(1 - t) sg(x0) + t eps_i``, each ``eps_i`` its own noise) and one
more differentiable Euler step is taken from each; the loss averages the rewards of the sample
and its ``lv_samples`` re-noised steps. DRaFT-LV (Clark et al. 2023, Sec. 4 and Algorithm 1)
averages n = 2 re-noised last steps, the default; it takes the sample's own chain without
gradients, where here its DRaFT-K gradient (the last ``draft_k`` steps) joins the average.

CFG (``guidance`` > 0, Krea convention): only the conditional branch carries gradients; the
unconditional one runs under ``no_grad`` (its output is a constant of the backward).

Memory: the transformer's blocks are checkpointed by the engine (``training.activation_checkpointing``)
in each of the ``draft_k`` (+ ``lv_samples``) differentiable steps; the VAE decode is checkpointed as a whole
(only its input latent is kept, the decode is recomputed in the backward).

Every transformer forward of a step, trained model and base alike, runs under the trained
model's autocast (``runtime.autocast()``), so with the model equal to its base the two sample
exactly the same images. ``eval/reward_vs_base`` (every ``eval_every_n_steps``) is the mean
reward of the model's samples on fixed seeds minus the base weights' on the same seeds.

Several processes: every micro-batch but the last of a step samples, scores and back-propagates
inside ``no_sync`` (DDP decides at the forward whether the backward all-reduces), so one gradient
all-reduce per optimizer step; the logged reward statistics are the global batch's (gathered).
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
from .config import DraftConfig
from .differentiable_rewards import score_images
from .rewards import load_rewards
from .rollout import initial_noise, schedule, text_fusion_frozen, text_inputs, velocity
from .trainer import PosttrainTrainer

# Generator index of the fixed evaluation noise, away from every training step's.
EVAL_SEED_INDEX = -3


class DraftTrainer(PosttrainTrainer):
    @classmethod
    def model_copies(cls, config):
        """The activations of the ``draft_k`` differentiable steps (+ ``lv_samples`` for LV) are kept together."""
        section = config.draft
        return super().model_copies(config, forward_batch=config.training.batch_size * (section.draft_k + lv_count(section)))

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

    def step_velocity(self, forward, latents: torch.Tensor, t: float,
                      text: tuple[dict, dict | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, C) velocity of ``forward`` at time t and its conditional branch (the same tensor
        without CFG); with CFG the unconditional branch carries no gradient."""
        cond = velocity(forward, latents, t, text[0])
        guidance = self.config.draft.guidance
        if not sampling.guidance_active(t, guidance, None):
            return cond, cond
        with torch.no_grad():
            uncond = velocity(forward, latents, t, text[1])
        return sampling.guided_velocity(cond, uncond, guidance), cond

    def anchor_gap(self, cond: torch.Tensor, latents: torch.Tensor, t: float, text: tuple[dict, dict | None]) -> torch.Tensor:
        """(B,) mean squared difference between the trained conditional velocity ``cond`` (B, N, C)
        and the base weights' on the same latents (no gradient into the base)."""
        return (cond - velocity(self.base, latents, t, text[0])).pow(2).mean(dim=(1, 2))

    def sample(self, forward, text, noise: torch.Tensor, lv_noise: torch.Tensor | None = None,
               grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Euler samples (B, N, C) from ``noise`` (B, N, C); with ``grad`` the last ``draft_k``
        steps keep their graph. With ``lv_noise`` (n, B, N, C) also the n LV samples (n, B, N, C):
        the final latent re-noised at the last step's time with each ``lv_noise[i]`` and stepped
        once more (differentiably) to 0. The third value: with ``grad`` and ``anchor_weight`` > 0,
        the (B,) base anchor (:meth:`anchor_gap` averaged over the ``draft_k`` differentiable steps), else None."""
        times, k = self.times, self.config.draft.draft_k
        first_grad = len(times) - 1 - k
        anchored = self.config.draft.anchor_weight > 0
        latents, lv, gaps = noise, None, []
        with self.runtime.autocast():
            for i, (t, t_next) in enumerate(zip(times[:-1], times[1:])):
                differentiable = grad and i >= first_grad
                with torch.set_grad_enabled(differentiable):
                    v, cond = self.step_velocity(forward, latents, t, text)
                    if anchored and differentiable:
                        gaps.append(self.anchor_gap(cond, latents, t, text))
                    latents = sampling.euler_step(latents, v, t, t_next)
            if lv_noise is not None:
                t, final = times[-2], latents.detach()
                with torch.set_grad_enabled(grad):
                    starts = [sampling.noised(final, eps, t) for eps in lv_noise]
                    lv = torch.stack([sampling.euler_step(x, self.step_velocity(forward, x, t, text)[0], t, times[-1])
                                      for x in starts])
        return latents, lv, torch.stack(gaps).mean(0) if gaps else None

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents (B, N, C) -> images (B, 3, H, W) in [0, 1] through the pipeline's
        decode, checkpointed when the latents carry gradients."""
        unpacked = unpack_latents(latents.to(next(self.pipe.vae.parameters()).device), self.size, self.size)
        if not latents.requires_grad:
            return decode_latents(self.pipe.vae, unpacked)
        return checkpoint(decode_latents, self.pipe.vae, unpacked, use_reentrant=False)

    # ---------------------------------------------------------------- one step
    def draft_inputs(self, index: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """This process's prompt ids, initial noise (B, N, C) and LV noise (lv_samples, B, N, C)
        (or None) of forward ``index``, drawn for the run's whole global batch (the same after a
        resume on any number of processes)."""
        runtime = self.runtime
        total = self.global_batch.micro_batch
        per_rank = total // runtime.world_size
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        generator = self.generator(index)
        order = torch.randperm(len(self.prompts), generator=generator).tolist()
        global_ids = [order[i % len(order)] for i in range(total)]
        noise = initial_noise(total, self.pipe.transformer.config.in_channels, self.size, self.size, generator)
        lv = lv_count(self.config.draft)
        lv_noise = torch.randn((lv, *noise.shape), generator=generator)[:, mine].to(runtime.device) if lv else None
        return global_ids[mine], noise[mine].to(runtime.device), lv_noise

    def micro_batch_loss(self, step: int, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
        """Forward ``index`` of step ``step``: (loss (), this process's per-sample statistics
        {logged key: (B,) values}, prompts). The loss is minus the mean total reward, with LV
        averaged over the sample and its re-noised steps."""
        prompt_ids, noise, lv_noise = self.draft_inputs(index)
        text = self.conditioning(prompt_ids)
        prompts = [self.prompts[i] for i in prompt_ids]
        metadata = [{"prompt_index": i, "step": step + 1, "sample": j} for j, i in enumerate(prompt_ids)]
        latents, lv, anchor = self.sample(self.model, text, noise, lv_noise)
        reward, raw = score_images(self.rewards, self.decode(latents), prompts, metadata)
        stats = {"reward_mean": reward.detach(), **{f"reward/{name}": values for name, values in raw.items()}}
        if lv is not None:
            # One decode and score at a time: each checkpointed decode is redone alone in the backward.
            lv_rewards = [score_images(self.rewards, self.decode(x), prompts, metadata)[0] for x in lv]
            stats["reward_lv_mean"] = torch.stack(lv_rewards).detach().mean(0)
            reward = (reward + sum(lv_rewards)) / (1 + len(lv_rewards))
        loss = -reward.mean()
        if anchor is not None:
            stats["anchor"] = anchor.detach()
            loss = loss + self.config.draft.anchor_weight * anchor.mean()
        return loss, stats, prompts

    def train_step(self, step: int, items=None) -> tuple[float, float]:
        runtime, section = self.runtime, self.config.draft
        accumulation = self.global_batch.accumulation
        loss_value, columns = 0.0, {}
        for micro in range(accumulation):
            # DDP decides at each forward whether the next backward all-reduces: the sampling,
            # scoring and backward of every micro-batch but the last run inside no_sync, so the
            # step's gradients are all-reduced once.
            with no_sync(self.model, runtime, sync=micro == accumulation - 1):
                loss, stats, prompts = self.micro_batch_loss(step, step * accumulation + micro)
                value = float(runtime.mean(loss))
                if not math.isfinite(value):
                    raise NonFiniteLossError(f"DRaFT loss is {value} at step {step + 1} on prompts {sorted(set(prompts))}; "
                                             f"the last checkpoint is kept in {self.checkpointer.folder}")
                (loss / accumulation).backward()
            loss_value += value / accumulation
            for key, values in stats.items():
                columns.setdefault(key, []).append(values)
        grad_norm = self.optimizer_step()
        self.lr_scheduler.step()
        metrics = self.reward_statistics(columns)
        if self.eval_due(step, section.eval_every_n_steps):
            metrics.update(self.evaluate())
        self.extra_metrics = metrics
        return loss_value, grad_norm

    def reward_statistics(self, columns: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """Each logged key's mean over the step's global batch (every micro-batch of every
        process: one all-gather), and ``reward_std`` the spread of the total rewards over it,
        so any number of processes logs what one process with the whole batch logs."""
        keys = list(columns)
        local = torch.stack([torch.cat(columns[key]).double() for key in keys], 1)  # (accumulation * B, keys)
        every = self.runtime.gather(local)  # (world_size * accumulation * B, keys)
        metrics = {key: float(every[:, i].mean()) for i, key in enumerate(keys)}
        metrics["reward_std"] = float(every[:, keys.index("reward_mean")].std(unbiased=False))
        return metrics

    @torch.no_grad()
    def eval_reward(self, forward) -> float:
        """Mean total reward of ``forward``'s samples (no gradients, the training guidance), every
        prompt x ``eval_seeds`` from fixed noise."""
        section = self.config.draft
        ids = [i for i in range(len(self.prompts)) for _ in range(section.eval_seeds)]
        noise = initial_noise(len(ids), self.pipe.transformer.config.in_channels, self.size, self.size,
                              self.generator(EVAL_SEED_INDEX)).to(self.runtime.device)
        latents, _, _ = self.sample(forward, self.conditioning(ids), noise, grad=False)
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


def lv_count(section: DraftConfig) -> int:
    """Re-noised final steps per sample: ``lv_samples`` with DRaFT-LV, else 0."""
    return section.lv_samples if section.draft_lv else 0
