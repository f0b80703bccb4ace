"""``method: distill``: trajectory distribution matching (TDM), data-free, few steps.

The student (initialised from the teacher) samples with the Turbo schedule in ``K =
distill.student_steps`` Euler steps. Each training step picks a student step ``k`` at random and
runs the student to ``x_{t_k}`` without gradients; its velocity ``v`` there (with gradients) gives
the clean estimate ``x0_hat = x_{t_k} - t_k v``. Two terms train it, both on the student's *own*
states, so every step of its trajectory is taught, not only the last:

* distribution matching (DMD's score difference, ``distribution_weight``) inside that step's
  segment: ``tau ~ U(t_{k+1}, t_k)``, ``x_tau = (1 - tau) x0_hat + tau eps`` and::

      g = (x0_fake(x_tau) - x0_teacher_cfg(x_tau)) / mean|x0_hat - x0_teacher_cfg|
      loss = 1/2 |x0_hat - sg(x0_hat - g)|^2

  The fake-score model (initialised from the teacher) takes ``fake_updates_per_step`` flow-
  matching updates on the student's step-k estimates at times from the same segment before each
  student update, so it models that step's distribution;
* trajectory matching (``trajectory_weight``): ``|v - (x^T_{t_{k+1}} - x_{t_k}) / (t_{k+1} - t_k)|^2``
  where ``x^T_{t_{k+1}}`` is the teacher's own guided ODE over the segment in
  ``teacher_steps / student_steps`` Euler steps from the same state.

The teacher is RAW with CFG (``teacher_guidance``, Krea convention). No data: prompts only.

Full: the student and a fake-score copy are trained, the teacher is the frozen reference (all
three built sharded from the meta device, see :mod:`.reference`). LoRA: the
student and the fake score are two adapters on the one frozen base, which is the teacher with
the adapters switched off (no second or third copy of the weights: fits where a LoRA does).
The fake score exists only with ``distribution_weight > 0`` (:func:`trains_fake_score`): at the
default 0 nothing builds, plans, optimizes or checkpoints it (at 12.8B a whole float32 master copy
with its gradients and AdamW state). A checkpoint of an older run that held one at weight 0
resumes: the engine skips the tensors this run does not hold and logs their names.

This is our reading of TDM (distribution and trajectory matching on the student's trajectory,
segment-restricted times); we do not claim it reproduces Krea's Turbo recipe bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from krea2_diffusers import sampling
from krea2_diffusers.conditioning.text import pad_conditioning
from krea2_diffusers.presets import DISTILLED_METADATA_KEY, STEPS_METADATA_KEY

from ..methods import ADAPTER_NAME, add_lora
from ..engine.parallel import full_state_dict, unwrap
from ..optimization.objective import add_noise, flow_matching_loss
from ..trainer import NonFiniteLossError
from .rollout import initial_noise, text_inputs, text_positions, velocity
from .trainer import PosttrainTrainer

# Keeps tau away from 0 in the last segment, where x0 = x_tau and the score difference vanishes.
MIN_TAU = 1e-3
FAKE_ADAPTER = "fake"
# LoRA distillation: the two adapters on the one base (the teacher is the base, adapters off).
ADAPTERS = {"student": ADAPTER_NAME, "fake": FAKE_ADAPTER}
# DMD's normaliser is floored so a perfect teacher match does not divide by zero.
NORMALISER_FLOOR = 1e-6


def trains_fake_score(config) -> bool:
    """Whether a distillation run has a fake score: only its distribution term uses one."""
    return config.distill.distribution_weight > 0


class StudentAndFakeScore(nn.Module):
    """One trained module holding the student and (``distribution_weight > 0``) the fake-score
    transformer, so the engine's checkpoints, optimizer and resume cover both; the student is
    always ``student.`` in checkpoints and exports. ``transformer_blocks`` lists the models'
    blocks for per-block FSDP wrapping."""

    def __init__(self, student: nn.Module, fake: nn.Module | None):
        super().__init__()
        self.student = student
        self.fake = fake

    @property
    def parts(self) -> list[nn.Module]:
        return [self.student] if self.fake is None else [self.student, self.fake]

    @property
    def config(self):
        """The student's (what checkpoints record and exports write)."""
        return self.student.config

    @property
    def transformer_blocks(self) -> list[nn.Module]:
        return [block for part in self.parts for block in part.transformer_blocks]

    def enable_gradient_checkpointing(self) -> None:
        for part in self.parts:
            part.enable_gradient_checkpointing()

    def forward(self, which: str, **inputs):
        return getattr(self, which)(**inputs)


class _Part:
    """One of the two trained models ("student" / "fake") called like a transformer."""

    def __init__(self, trainer: "DistillTrainer", which: str):
        self.trainer, self.which = trainer, which

    def __call__(self, **inputs):
        return self.trainer.call_part(self.which, **inputs)


def dmd_student_loss(x0_hat: torch.Tensor, x0_fake: torch.Tensor, x0_teacher: torch.Tensor) -> torch.Tensor:
    """DMD's distribution-matching loss on the student's clean estimate; all (B, N, C).

    Its gradient w.r.t. ``x0_hat`` is ``(x0_fake - x0_teacher) / normaliser`` (per sample, the
    mean absolute distance to the teacher's estimate), i.e. the score difference.
    """
    normaliser = (x0_hat.detach().float() - x0_teacher.float()).abs().flatten(1).mean(1).clamp_min(NORMALISER_FLOOR)
    grad = (x0_fake.float() - x0_teacher.float()) / normaliser.view(-1, 1, 1)
    target = (x0_hat.detach().float() - grad).detach()
    return 0.5 * (x0_hat.float() - target).pow(2).flatten(1).mean(1).mean()


class DistillTrainer(PosttrainTrainer):
    @property
    def partial_backward(self) -> bool:
        """LoRA with a fake score: its updates reach its adapter only, the student's update the student's."""
        return trains_fake_score(self.config)

    @classmethod
    def model_copies(cls, config):
        """Full: student (+ fake score with ``distribution_weight > 0``) trained (master + optimizer
        state each), teacher frozen. LoRA: one adapter per trained model on the base, which is the
        teacher. The fake score's updates and the student's each run their own backward, so one
        batch of activations is held at a time."""
        copies = super().model_copies(config)
        fake = trains_fake_score(config)
        models = 2 if fake else 1
        note = "" if fake else " (no fake score: distribution_weight 0)"
        if config.training.method == "lora":
            trained = "student + fake score adapters" if fake else "student adapter"
            return replace(copies, adapters=models, what=f"distill: {trained}, teacher = base, adapters off{note}")
        trained = "student + fake score" if fake else "student"
        return replace(copies, trained=models, frozen_name="teacher", what=f"distill: {trained} trained, teacher frozen{note}")

    def prepare_inputs(self) -> None:
        self.lora = self.config.training.method == "lora"
        self.fake_score = trains_fake_score(self.config)
        self.prompts = self.config.prompt_list()
        section = self.config.distill
        self.size = section.resolution
        self.student_times = sampling.sigma_schedule(section.student_steps, sampling.DISTILLED_SHIFT).tolist()

    def encode_inputs(self) -> None:
        device, section = self.runtime.device, self.config.distill
        texts = self.prompts + [section.negative_prompt]
        embeds, mask = self.pipe.encode_prompt(texts, device=device, max_sequence_length=self.config.model.max_sequence_length)
        self.text = [(embeds[i:i + 1][:, mask[i]].cpu(), mask[i:i + 1][:, mask[i]].cpu()) for i in range(len(texts))]

    def trainable_module(self, transformer: nn.Module) -> nn.Module:
        """LoRA: adapters on the one base, the student's (``default``) and, with a fake score, its
        own (``fake``); the teacher is the base itself (adapters off)."""
        names = (ADAPTERS["student"], FAKE_ADAPTER) if self.fake_score else (ADAPTERS["student"],)
        params = add_lora(transformer, self.config.lora, adapter_names=names)
        transformer.set_adapter(ADAPTERS["student"])
        for param in params:
            param.requires_grad_(True)
        return transformer

    def assemble_full(self, make) -> nn.Module:
        """Full: the student and (with a fake score) the fake score, transformers filled from the
        teacher's weights and sharded block by block like one model (the teacher is the frozen
        reference)."""
        return StudentAndFakeScore(make(), make() if self.fake_score else None)

    def sampling_transformer(self, module: nn.Module) -> nn.Module:
        return module.student

    def _fake_parameter_ids(self) -> set[int]:
        inner = unwrap(self.model)
        if self.lora:
            return {id(p) for n, p in inner.named_parameters() if f".{FAKE_ADAPTER}." in n}
        return {id(p) for p in inner.fake.parameters()}

    def param_groups(self) -> list:
        if not self.fake_score:
            return self.params
        fake_lr = self.config.distill.fake_learning_rate or self.config.optimizer.learning_rate
        fake = self._fake_parameter_ids()
        return [{"params": [p for p in self.params if id(p) not in fake]},
                {"params": [p for p in self.params if id(p) in fake], "lr": fake_lr}]

    def call_part(self, which: str, **inputs):
        """Run the student or the fake score (through the wrapper, so DDP/FSDP hooks run)."""
        if not self.lora:
            return self.model(which, **inputs)
        # PEFT's set_adapter also switches requires_grad to the active adapter; both adapters stay
        # trainable (the optimizer, checkpoints and exports see a fixed set of parameters).
        unwrap(self.model).set_adapter(ADAPTERS[which])
        for param in self.params:
            param.requires_grad_(True)
        return self.model(**inputs)

    # ---------------------------------------------------------------- conditioning
    def conditioning(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = pad_conditioning([self.text[i][0] for i in prompt_ids], [self.text[i][1] for i in prompt_ids])
        return embeds.to(self.runtime.device), mask.to(self.runtime.device)

    def teacher_velocity(self, latents, t: torch.Tensor, embeds, mask, uncond, uncond_mask) -> torch.Tensor:
        """RAW with CFG: ``v_c + g (v_c - v_u)``, both branches in one batch of the frozen teacher."""
        both_embeds, both_mask = pad_conditioning([embeds, uncond], [mask, uncond_mask])
        positions = text_positions(both_embeds, self.size, self.size)
        out = self.reference(self.model, hidden_states=torch.cat([latents, latents]), encoder_hidden_states=both_embeds,
                             timestep=torch.cat([t, t]), position_ids=positions, encoder_attention_mask=both_mask)
        cond, uncond_v = out.chunk(2)
        return sampling.guided_velocity(cond, uncond_v, self.config.distill.teacher_guidance)

    def part_velocity(self, which: str, latents, t: torch.Tensor, embeds, mask) -> torch.Tensor:
        """(B, N, C) velocity of the student or the fake score (``which``) at ``latents`` (B, N, C),
        times ``t`` (B,), under the run's precision policy (as the teacher's)."""
        positions = text_positions(embeds, self.size, self.size)
        with self.runtime.autocast():
            return self.call_part(which, hidden_states=latents, encoder_hidden_states=embeds, timestep=t, position_ids=positions,
                                  encoder_attention_mask=mask, return_dict=False)[0].float()

    # ---------------------------------------------------------------- one step
    def _segment_times(self, generator: torch.Generator, total: int, mine: slice, t_k: float, t_after: float) -> torch.Tensor:
        """(B,) times uniform in the segment (t_{k+1}, t_k], drawn for the whole global batch."""
        tau = torch.rand(total, generator=generator, dtype=torch.float64)[mine]
        return (t_after + (t_k - t_after) * tau).clamp_min(MIN_TAU).float().to(self.runtime.device)

    @torch.no_grad()
    def teacher_segment_velocity(self, latents, t_k: float, t_after: float, embeds, mask, uncond, uncond_mask) -> torch.Tensor:
        """(B, N, C) mean velocity of the teacher's guided ODE over the segment [t_k -> t_{k+1}]:
        ``(x_{t_{k+1}} - x_{t_k}) / (t_{k+1} - t_k)`` after ``teacher_steps / student_steps``
        Euler steps of the teacher with CFG, from the student's own state ``latents``."""
        section = self.config.distill
        substeps = max(1, round(section.teacher_steps / section.student_steps))
        times = torch.linspace(t_k, t_after, substeps + 1, dtype=torch.float64).tolist()
        x = latents
        for t, t_next in zip(times[:-1], times[1:]):
            t_vec = torch.full((x.shape[0],), t, device=x.device)
            x = sampling.euler_step(x, self.teacher_velocity(x, t_vec, embeds, mask, uncond, uncond_mask), t, t_next)
        return (x - latents) / (t_after - t_k)

    def _fake_update(self, sample: torch.Tensor, tau: torch.Tensor, eps: torch.Tensor, embeds, mask) -> torch.Tensor:
        """One optimizer step of the fake score alone: flow matching on the student's step-k
        estimates ``sample`` (B, N, C) diffused to ``tau`` (B,), so it models that step's
        distribution (the segment-restricted part of TDM's distribution matching). Returns the loss."""
        fake_v = self.part_velocity("fake", add_noise(sample, eps, tau), tau, embeds, mask)
        loss = flow_matching_loss(fake_v, sample, eps, tau)
        loss.backward()
        # Only the fake score's parameters have gradients: the optimizer leaves the student's alone.
        self.optimizer_step()
        return loss.detach()

    def train_step(self, step: int, items=None) -> tuple[float, float]:
        """``distill.fake_updates_per_step`` updates of the fake score on the student's current
        estimates (DMD2's two time-scales: the score difference is only as good as the fake
        score), then one update of the student. With ``distribution_weight: 0`` the fake score
        and its teacher call are skipped (only the trajectory term trains the student)."""
        runtime, section = self.runtime, self.config.distill
        total = self.global_batch.micro_batch  # the run's, kept on resume with another number of processes
        per_rank = total // runtime.world_size
        generator = self.generator(step)
        order = torch.randperm(len(self.prompts), generator=generator).tolist()
        global_ids = [order[i % len(order)] for i in range(total)]
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        channels = self.pipe.transformer.config.in_channels
        noise = initial_noise(total, channels, self.size, self.size, generator)[mine]
        k = int(torch.randint(0, section.student_steps, (1,), generator=generator))
        t_k, t_after = self.student_times[k], self.student_times[k + 1]
        device = runtime.device
        draw_eps = lambda: torch.randn((total, *noise.shape[1:]), generator=generator)[mine].to(device)  # noqa: E731
        prompt_ids = global_ids[mine]
        embeds, mask = self.conditioning(prompt_ids)
        uncond, uncond_mask = self.conditioning([len(self.prompts)] * len(prompt_ids))
        latents = noise.to(device)
        t_vec = torch.full((len(prompt_ids),), t_k, device=device)

        # The student's own trajectory up to step k (no gradients).
        # Every forward of the step (student, fake score, teacher) under the run's one precision
        # policy: while the three have equal weights their velocities are equal bit for bit.
        with torch.no_grad(), runtime.autocast():
            text = text_inputs(self.model, embeds, mask, self.size, self.size, reuse=False)
            for i in range(k):
                v = velocity(_Part(self, "student"), latents, self.student_times[i], text)
                latents = sampling.euler_step(latents, v, self.student_times[i], self.student_times[i + 1])
        student_loss = fake_loss = trajectory_loss = torch.zeros((), device=device)
        if section.distribution_weight:
            # The fake score first follows the student's distribution at step k (its clean
            # estimates there, without gradients) ...
            with torch.no_grad():
                sample = latents - t_k * self.part_velocity("student", latents, t_vec, embeds, mask)
            fake_losses = [self._fake_update(sample, self._segment_times(generator, total, mine, t_k, t_after), draw_eps(),
                                             embeds, mask) for _ in range(section.fake_updates_per_step)]
            fake_loss = torch.stack(fake_losses).mean()

        # ... then the student's estimate (now with gradients) is pulled toward the teacher's
        # marginal by the score difference, at times inside the segment (t_{k+1}, t_k].
        student_v = self.part_velocity("student", latents, t_vec, embeds, mask)
        if section.distribution_weight:
            x0_hat = latents - t_k * student_v
            tau, eps = self._segment_times(generator, total, mine, t_k, t_after), draw_eps()
            noisy = add_noise(x0_hat.detach(), eps, tau)
            with torch.no_grad():
                x0_teacher = noisy - tau.view(-1, 1, 1) * self.teacher_velocity(noisy, tau, embeds, mask, uncond, uncond_mask)
                x0_fake = noisy - tau.view(-1, 1, 1) * self.part_velocity("fake", noisy, tau, embeds, mask)
            student_loss = section.distribution_weight * dmd_student_loss(x0_hat, x0_fake, x0_teacher)
        if section.trajectory_weight:
            # Trajectory matching on the student's own states: its one step over the segment
            # follows the teacher's many guided steps over the same segment.
            target = self.teacher_segment_velocity(latents, t_k, t_after, embeds, mask, uncond, uncond_mask)
            trajectory_loss = (student_v - target).pow(2).flatten(1).mean(1).mean()
            student_loss = student_loss + section.trajectory_weight * trajectory_loss
        value = float(runtime.mean(student_loss + fake_loss))
        if not math.isfinite(value):
            raise NonFiniteLossError(f"distillation loss is {value} at step {step + 1} on prompts "
                                     f"{[self.prompts[i] for i in global_ids]}; the last checkpoint is kept in {self.checkpointer.folder}")
        if self.lora:
            # The teacher calls (adapters off and on) leave PEFT's requires_grad on the active
            # adapter only; a parameter not requiring grad at backward gets none. The student's
            # adapter is also what validation and exports see.
            unwrap(self.model).set_adapter(ADAPTERS["student"])
            for param in self.params:
                param.requires_grad_(True)
        student_loss.backward()
        grad_norm = self.optimizer_step()
        self.lr_scheduler.step()
        self.extra_metrics = {"student_loss": float(runtime.mean(student_loss)), "fake_loss": float(runtime.mean(fake_loss)),
                              "trajectory_loss": float(runtime.mean(trajectory_loss)), "student_step": float(k)}
        return value, grad_norm

    # ---------------------------------------------------------------- export
    def lora_layers(self):
        """The student adapter (validation samples with it)."""
        from krea2_diffusers.loaders.lora import lora_layers_from_diffusers_state_dict

        state = full_state_dict(self.model, self.runtime, trainable_only=True)
        student = {k: v for k, v in state.items() if f".{FAKE_ADAPTER}." not in k}
        return lora_layers_from_diffusers_state_dict(student, self.config.lora.alpha, self.config.lora.rank)

    def export_hints(self) -> dict:
        """Full: the student part, marked distilled in the files' metadata (``transformer/`` and
        ``krea2_original.safetensors``). LoRA: the student adapter (apply it to the teacher and
        pass ``is_distilled=True``)."""
        if self.lora:
            return {"exclude_adapters": [FAKE_ADAPTER]} if self.fake_score else {}
        return {"model_prefix": "student.",
                "metadata": {DISTILLED_METADATA_KEY: "true", STEPS_METADATA_KEY: str(self.config.distill.student_steps)}}
