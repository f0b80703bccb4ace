"""The post-training config: a training config (model, training, lora, optimizer, checkpointing,
export ... exactly as ``krea2 train``) plus ``method`` and that method's own section.

``data`` is not used: DPO reads preference pairs, GRPO, DRaFT and distillation read prompts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from ..config import ConfigError, TrainConfig, load_config
from ..config_paths import PATH

METHODS = ("dpo", "grpo", "distill", "draft")


@dataclass
class SyntheticPairsConfig:
    """A self-made preference set: each pair prefers a warm flat colour over a cool one."""

    num_pairs: int = 12
    size: int = 64


@dataclass
class DPOConfig:
    data: str | None = field(default=None, metadata=PATH)
    """JSONL/Parquet manifest with ``prompt``, ``chosen``, ``rejected`` (image paths relative to it)."""
    synthetic: SyntheticPairsConfig | None = None
    """Generate a synthetic pair set into ``data`` (or ``<output_dir>/synthetic_pairs``) instead."""
    resolution: int = 1024
    """Pairs are bucketed at about ``resolution**2`` pixels (both images of a pair share a bucket)."""
    beta: float = 2500.0
    """Diffusion-DPO's KL strength; the losses are per-element means, as in the Diffusion-DPO paper."""
    sft_weight: float = 0.0
    """Anchor 1: weight of the plain flow-matching (SFT) loss on the chosen sample."""
    chosen_anchor_weight: float = 0.0
    """Anchor 2: weight of ``relu(loss_chosen - loss_chosen_reference)``, a penalty whenever the
    chosen sample's likelihood falls below the reference's (plain DPO lets both fall)."""
    heldout_pairs: int = 4
    """The manifest's last N usable pairs are never trained on; their metrics show drift."""
    eval_every_n_steps: int = 10
    cache_dir: str | None = field(default=None, metadata=PATH)


@dataclass
class RewardConfig:
    function: str = ""
    """``package.module:function(images, prompts, metadata) -> list[float]``, or a built-in
    (``krea2.vlm_rubric``, ``krea2.ocr``, ``krea2.clip``: see :mod:`finetune.posttrain.rewards`).
    DRaFT's are differentiable: a float tensor (B, 3, H, W) in [0, 1] in, a tensor (B,) out
    (:mod:`finetune.posttrain.differentiable_rewards`)."""
    weight: float = 1.0
    gate: float | None = None
    """A raw value below the gate zeroes the sample's total reward (e.g. an artefact detector)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the function (built-ins: model paths, rubric template ...)."""


@dataclass
class PromptPoolConfig:
    solved_above: float | None = None
    """Drop a prompt whose mean total reward is at least this (too easy to teach anything)."""
    hopeless_below: float | None = None
    """Drop a prompt whose best total reward so far is below this (always fails)."""
    min_std: float = 1e-6
    """Drop a prompt whose group reward spread stays below this (no variance, no advantage)."""
    min_groups: int = 2
    """Groups a prompt must have had before it can be dropped."""


@dataclass
class PromptSource:
    """Where GRPO, DRaFT and distillation read their prompts (no images: all three are data-free)."""

    prompts: list[str] = field(default_factory=list)
    prompts_file: str | None = field(default=None, metadata=PATH)
    """A text file, one prompt per line (added to ``prompts``)."""


@dataclass
class GRPOConfig(PromptSource):
    group_size: int = 8
    """Samples per prompt; ``training.batch_size`` prompts per step."""
    num_inference_steps: int = 10
    resolution: int = 1024
    noise_level: float = 0.7
    """SDE diffusion ``a`` in ``s_t = a sqrt(t / (1 - t))`` (marginals unchanged)."""
    sde_steps: int | None = None
    """Steps that explore (SDE) and are trained, a window of them per step; the rest follow the ODE. None = all."""
    sde_window_start: int | None = None
    """First step of that window: None = a random window each step (Flow-GRPO-Fast); 0 = always the
    first steps, where the high-noise steps decide the layout and the subject (the rewards that judge
    those gain most there: see finetune/POSTTRAIN.md)."""
    clip_range: float = 1e-4
    """PPO clip on the per-step likelihood ratio (per-element mean log-probs, Flow-GRPO's scale)."""
    kl_weight: float = 0.04
    """Weight of the KL to the reference (base weights) per trained step."""
    updates_per_rollout: int = 2
    """Optimizer updates on each batch of rollouts (the ratio leaves 1 after the first)."""
    rewards: list[RewardConfig] = field(default_factory=list)
    pool: PromptPoolConfig = field(default_factory=PromptPoolConfig)
    eval_every_n_steps: int = 10
    """Mean reward of guidance-free ODE samples on fixed seeds (0 = off)."""
    eval_seeds: int = 2


@dataclass
class DistillConfig(PromptSource):
    student_steps: int = 8
    teacher_steps: int = 28
    """The teacher's step count for the whole trajectory: the trajectory term runs
    ``teacher_steps / student_steps`` teacher steps (with CFG) per student step."""
    teacher_guidance: float = 3.5
    """CFG of the teacher (Krea convention, RAW's default); the student learns guidance in."""
    negative_prompt: str = ""
    resolution: int = 1024
    fake_learning_rate: float | None = None
    """Learning rate of the fake-score model (default: ``optimizer.learning_rate``)."""
    distribution_weight: float = 0.0
    """Weight of TDM's distribution-matching term (DMD's score difference through the fake score).
    Default 0 (trajectory matching alone): the best our measurements support (POSTTRAIN.md: on the
    tiny teacher 0 gives SWD 0.0345, 0.1 0.0372, 1.0 no gain over the 4-step teacher's 0.0400); at 0
    there is no fake score (not built, planned, optimized or checkpointed)."""
    trajectory_weight: float = 1.0
    """Weight of TDM's trajectory-matching term: on each of the student's own states, its one step
    over the segment regresses onto the teacher's ``teacher_steps / student_steps`` guided Euler
    steps over the same segment (0 = distribution matching alone)."""
    fake_updates_per_step: int = 1
    """Fake-score optimizer updates before each student update (DMD2's two time-scales, which
    uses 5): the student's gradient is the fake score's error, so a lagging fake score misleads it."""


@dataclass
class DraftConfig(PromptSource):
    num_inference_steps: int = 28
    draft_k: int = 1
    """Gradients flow through the last ``draft_k`` sampling steps (and the VAE decode)."""
    draft_lv: bool = False
    """DRaFT-LV: also re-noise the final latent at the last step's time ``lv_samples`` times
    (each with its own noise), take one more differentiable step from each, and average the
    rewards of the sample and its re-noised steps."""
    lv_samples: int = 2
    """DRaFT-LV's ``n``: re-noised final steps per sample (only with ``draft_lv``). The paper
    (Clark et al. 2023, Sec. 4 "DRaFT-LV" and Algorithm 1) uses n = 2."""
    guidance: float = 0.0
    """CFG while sampling (Krea convention, 0 = off); only the conditional branch carries gradients."""
    anchor_weight: float = 0.0
    """Weight of the base anchor: the mean squared difference between the trained and the base
    weights' conditional velocity at each differentiable step (on the trained model's own latents),
    added to the loss. A trust region toward the base, which reward maximisation alone lacks
    (0 = off, DRaFT as published; each differentiable step then costs one more forward, no gradient)."""
    resolution: int = 1024
    rewards: list[RewardConfig] = field(default_factory=list)
    """Differentiable plug-ins ``package.module:function(images, prompts, metadata) -> tensor (B,)``
    with ``images`` a float tensor (B, 3, H, W) in [0, 1] that carries gradients."""
    eval_every_n_steps: int = 10
    """``eval/reward_mean`` and ``eval/reward_vs_base`` on fixed seeds (0 = off)."""
    eval_seeds: int = 2


@dataclass
class PosttrainConfig(TrainConfig):
    output_dir: str = field(default="outputs/krea2-posttrain", metadata=PATH)
    method: Literal["dpo", "grpo", "distill", "draft"] = "dpo"
    dpo: DPOConfig | None = None
    grpo: GRPOConfig | None = None
    distill: DistillConfig | None = None
    draft: DraftConfig | None = None

    requires_data: ClassVar[bool] = False
    text_fusion_default: ClassVar[bool] = False

    @property
    def section(self):
        return getattr(self, self.method)

    def validate(self) -> None:
        if self.section is None:
            setattr(self, self.method, {"dpo": DPOConfig, "grpo": GRPOConfig, "distill": DistillConfig, "draft": DraftConfig}[self.method]())
        super().validate()
        section, name = self.section, self.method
        if self.training.method == "lora" and self.lora.type != "lora":
            raise ConfigError(f"lora.type={self.lora.type!r}: krea2 posttrain trains LoRA adapters only (lokr and loha are for krea2 train)")
        # Both change which weights are validated, saved and exported, which krea2 train's loop handles and this one does not.
        if self.training.ema is not None:
            raise ConfigError("training.ema is for krea2 train; krea2 posttrain keeps no EMA")
        if self.optimizer.name == "adamw_schedulefree":
            raise ConfigError("optimizer.name=adamw_schedulefree is for krea2 train; krea2 posttrain takes adamw, adamw8bit, prodigy or adafactor")
        if section.resolution <= 0 or section.resolution % 16:
            raise ConfigError(f"{name}.resolution must be a positive multiple of 16, got {section.resolution}")
        if name == "dpo":
            if section.data is None and section.synthetic is None:
                raise ConfigError("dpo.data is required (a .jsonl/.parquet of prompt, chosen, rejected), or dpo.synthetic")
            for key in ("sft_weight", "chosen_anchor_weight", "heldout_pairs"):
                if getattr(section, key) < 0:
                    raise ConfigError(f"dpo.{key} must be >= 0, got {getattr(section, key)}")
            if section.beta <= 0:
                raise ConfigError(f"dpo.beta must be positive, got {section.beta}")
        else:
            if not section.prompts and not section.prompts_file:
                raise ConfigError(f"{name}.prompts (or {name}.prompts_file) is required")
        if name in ("grpo", "draft"):
            if not section.rewards:
                raise ConfigError(f"{name}.rewards is empty: give at least one {{function: 'module:function'}}")
            for i, reward in enumerate(section.rewards):
                if ":" not in reward.function and not reward.function.startswith("krea2."):
                    raise ConfigError(f"{name}.rewards[{i}].function {reward.function!r} must look like 'package.module:function'")
        if name == "grpo":
            if section.group_size < 2:
                raise ConfigError(f"grpo.group_size must be at least 2 (advantages compare samples), got {section.group_size}")
            if section.sde_steps is not None and not 1 <= section.sde_steps <= section.num_inference_steps:
                raise ConfigError(f"grpo.sde_steps must be in [1, num_inference_steps], got {section.sde_steps}")
            window = section.sde_steps or section.num_inference_steps
            if section.sde_window_start is not None and not 0 <= section.sde_window_start <= section.num_inference_steps - window:
                raise ConfigError(f"grpo.sde_window_start must be in [0, num_inference_steps - sde_steps] = "
                                  f"[0, {section.num_inference_steps - window}], got {section.sde_window_start}")
        if name == "distill":
            if section.student_steps < 1 or section.teacher_steps < 1:
                raise ConfigError("distill.student_steps and distill.teacher_steps must be positive")
            for key in ("distribution_weight", "trajectory_weight"):
                if getattr(section, key) < 0:
                    raise ConfigError(f"distill.{key} must be >= 0, got {getattr(section, key)}")
            if section.distribution_weight == section.trajectory_weight == 0:
                raise ConfigError("distill.distribution_weight and distill.trajectory_weight are both 0: nothing to learn")
            if section.fake_updates_per_step < 1:
                raise ConfigError(f"distill.fake_updates_per_step must be at least 1, got {section.fake_updates_per_step}")

        if name == "draft":
            if section.num_inference_steps < 1:
                raise ConfigError(f"draft.num_inference_steps must be positive, got {section.num_inference_steps}")
            if section.anchor_weight < 0:
                raise ConfigError(f"draft.anchor_weight must be >= 0, got {section.anchor_weight}")
            if not 1 <= section.draft_k <= section.num_inference_steps:
                raise ConfigError(f"draft.draft_k must be in [1, num_inference_steps={section.num_inference_steps}], "
                                  f"got {section.draft_k}")
            if section.guidance < 0:
                raise ConfigError(f"draft.guidance must be >= 0 (Krea convention, 0 = off), got {section.guidance}")
            if section.lv_samples < 1:
                raise ConfigError(f"draft.lv_samples must be at least 1 (re-noised final steps per sample), got {section.lv_samples}")
            if not section.draft_lv and section.lv_samples != DraftConfig.lv_samples:
                raise ConfigError(f"draft.lv_samples={section.lv_samples} is used only by DRaFT-LV: set draft.draft_lv: true "
                                  "(or drop draft.lv_samples)")
            if section.eval_every_n_steps < 0 or section.eval_seeds < 1:
                raise ConfigError("draft.eval_every_n_steps must be >= 0 and draft.eval_seeds >= 1")

    def prompt_list(self) -> list[str]:
        """GRPO / DRaFT / distill prompts: the inline list, then the file's non-empty lines."""
        section = self.section
        prompts = list(section.prompts)
        if section.prompts_file:
            path = Path(section.prompts_file)
            if not path.is_file():
                raise ConfigError(f"{self.method}.prompts_file {str(path)!r} not found")
            prompts += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise ConfigError(f"{self.method}: no prompts")
        return prompts


def load_posttrain_config(path: str | Path, overrides: list[str] = ()) -> PosttrainConfig:
    return load_config(path, overrides, cls=PosttrainConfig)
