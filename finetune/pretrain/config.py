"""The typed configuration of a pretraining run (``krea2 pretrain CONFIG.yaml``).

Parsing, unknown-key errors and ``key=value`` overrides are :mod:`finetune.config`'s; the LR
schedule, objective and checkpoint sections are its dataclasses too. Relative paths in the file
(stage packs, ``init`` weights, ``output_dir``) are relative to the file.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..config import (CheckpointConfig, ConfigError, LoggingConfig, LRSchedulerConfig, ObjectiveConfig, OptimizerConfig,
                      check_step_list, config_from_dict, parse_override)

ACTIVATION_CHECKPOINTING = ("none", "selective", "full")


@dataclass
class ArchitectureConfig:
    """Explicit transformer dimensions (``Krea2Transformer2DModel`` arguments); unset = the released model's."""

    num_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    num_key_value_heads: int = 12
    intermediate_size: int = 16384
    timestep_embed_dim: int = 256
    text_hidden_dim: int = 2560
    num_text_layers: int = 12
    text_num_attention_heads: int = 20
    text_num_key_value_heads: int = 20
    text_intermediate_size: int = 6912
    num_layerwise_text_blocks: int = 2
    num_refiner_text_blocks: int = 2
    axes_dims_rope: list[int] = field(default_factory=lambda: [32, 48, 48])


@dataclass
class PretrainModelConfig:
    architecture: Literal["tiny", "krea2"] | ArchitectureConfig = "krea2"
    """``tiny`` (tests), ``krea2`` (the released 12.8B shapes) or explicit dimensions."""
    init: str = "scratch"
    """``scratch``: the architecture's own initialisation (zero-initialised output layer and
    residual gates, so every block starts as the identity); or a transformer file / diffusers
    folder to continue pretraining from."""
    text_encoder: str = "Qwen/Qwen3-VL-4B-Instruct"
    """Hub id, folder, single file or ``tiny-random``; unused when every pack holds text features."""
    vae: str = "Qwen/Qwen-Image"
    max_sequence_length: int = 512


@dataclass
class PretrainOptimizerConfig(OptimizerConfig):
    """finetune's optimizer section with Muon as the alternative to AdamW and pretraining defaults."""

    name: Literal["adamw", "muon"] = "adamw"
    """One ``learning_rate`` for both optimizers: Muon's updates are RMS-matched to AdamW's (``match_rms_adamw``)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    norm_weight_decay: bool = True
    """Decay the zero-centred RMSNorm scales too (towards scale 1), as the report does."""
    momentum: float = 0.95
    """Muon's (Nesterov) momentum."""


@dataclass
class PMAConfig:
    every_n_steps: int = 0
    """Write ``pma/step-<N>.safetensors`` every N steps (a multiple of ``checkpointing.every_n_steps``); 0 = off."""
    num_checkpoints: int = 4
    """Average the model weights of this many latest checkpoints."""


@dataclass
class CaptionConfig:
    long: float = 0.8
    medium: float = 0.1
    short: float = 0.1
    """Sampling ratios; a missing caption falls back to the next longer/shorter one that exists."""
    dropout: float = 0.1
    """Probability of training on the empty prompt (what classifier-free guidance needs)."""


@dataclass
class RepaConfig:
    encoder: str = "facebook/dinov2-base"
    """Any transformers ``AutoModel`` vision tower (DINOv2/v3, SigLIP-2 ...) or ``tiny-random``."""
    weight: float = 0.5
    block: int = 8
    """Transformer block whose output image tokens are aligned (0-based)."""
    epochs: int = 1
    """REPA is on for the stage's first ``epochs`` passes over its pack, then removed."""


@dataclass
class StageLRConfig(LRSchedulerConfig):
    """finetune's schedule section, warmup-stable-decay unless a stage names another."""

    name: Literal["constant", "cosine", "wsd"] = "wsd"


@dataclass
class StageConfig:
    name: str = "stage"
    data: str = ""
    """A ``krea2-pack-v1`` folder made for this stage's ``resolution`` and ``batch_size``."""
    resolution: int = 256
    batch_size: int = 1
    """Per process, as the pack was made."""
    steps: int = 1
    shift: float | None = None
    """Timestep shift factor s (t -> s t / (1 + (s - 1) t), i.e. mu = ln s); None = the sampler's
    resolution rule (mu linear in image tokens)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    precision: Literal["bf16", "fp8"] = "bf16"
    """bf16: compute as ``training.mixed_precision`` resolves (``auto``: bf16 autocast on CUDA and on
    CPUs with bf16 units, float32 elsewhere); fp8: torchao float8 training (CUDA, sm >= 89)."""
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"
    repa: RepaConfig | None = None
    lr_scheduler: StageLRConfig = field(default_factory=StageLRConfig)
    """Warmup-stable-decay by default: ``warmup_steps``, then flat, then linear decay over the last
    ``decay_fraction`` of the stage to ``min_lr_ratio``."""
    keep_optimizer_state: bool = True
    """Carry the optimizer state over from the previous stage (weights always carry over)."""


@dataclass
class PretrainTrainingConfig:
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """``auto``: bf16 autocast on CUDA and on CPUs with bf16 units (AVX512-BF16 / AMX), float32
    elsewhere (:mod:`krea2_diffusers.precision`); master weights and optimizer state stay float32."""
    compile: bool = False
    num_workers: int = 0
    """DataLoader worker processes decoding pack rows."""


@dataclass
class PretrainConfig:
    output_dir: str = "outputs/pretrain"
    model: PretrainModelConfig = field(default_factory=PretrainModelConfig)
    optimizer: PretrainOptimizerConfig = field(default_factory=PretrainOptimizerConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    captions: CaptionConfig = field(default_factory=CaptionConfig)
    pma: PMAConfig = field(default_factory=PMAConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: PretrainTrainingConfig = field(default_factory=PretrainTrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stages: list[StageConfig] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def stage_at(self, step: int) -> tuple[int, int]:
        """(stage index, 0-based batch index inside it) of global step ``step`` (1-based)."""
        if not 1 <= step <= self.total_steps:
            raise ConfigError(f"step {step} is outside the run's steps 1..{self.total_steps}")
        start = 0
        for index, stage in enumerate(self.stages):
            if step <= start + stage.steps:
                return index, step - 1 - start
            start += stage.steps
        raise AssertionError("unreachable")

    def stage_start(self, index: int) -> int:
        """Global steps completed before stage ``index`` starts."""
        return sum(s.steps for s in self.stages[:index])

    def validate(self) -> None:
        if not self.stages:
            raise ConfigError("stages: at least one stage is required")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ConfigError(f"stages: names must be unique, got {names}")
        for stage in self.stages:
            where = f"stage {stage.name!r}"
            for key in ("resolution", "batch_size", "steps"):
                if getattr(stage, key) <= 0:
                    raise ConfigError(f"{where}: {key} must be positive, got {getattr(stage, key)}")
            if stage.resolution % 16:
                raise ConfigError(f"{where}: resolution must be a multiple of 16, got {stage.resolution}")
            if not stage.data:
                raise ConfigError(f"{where}: data (a krea2-pack-v1 folder) is required")
            if stage.shift is not None and stage.shift <= 0:
                raise ConfigError(f"{where}: shift must be positive, got {stage.shift}")
            if stage.repa is not None and (stage.repa.epochs < 1 or stage.repa.weight < 0 or stage.repa.block < 0):
                raise ConfigError(f"{where}: repa needs epochs >= 1, weight >= 0 and block >= 0")
        ratios = (self.captions.long, self.captions.medium, self.captions.short)
        if min(ratios) < 0 or sum(ratios) <= 0:
            raise ConfigError(f"captions: ratios must be >= 0 with a positive sum, got {ratios}")
        if not 0 <= self.captions.dropout < 1:
            raise ConfigError(f"captions.dropout must be in [0, 1), got {self.captions.dropout}")
        every = self.checkpointing.every_n_steps
        check_step_list("checkpointing.steps", self.checkpointing.steps, self.total_steps, "the stages' total steps")
        if self.pma.every_n_steps and self.checkpointing.steps:
            raise ConfigError("checkpointing.steps with pma: PMA averages the last checkpoints of the "
                              "checkpointing.every_n_steps grid; extra ones would enter its window")
        if self.pma.every_n_steps:
            if every <= 0 or self.pma.every_n_steps % every:
                raise ConfigError(f"pma.every_n_steps ({self.pma.every_n_steps}) must be a multiple of "
                                  f"checkpointing.every_n_steps ({every}): PMA averages saved checkpoints")
            if self.pma.num_checkpoints < 1 or self.checkpointing.keep_last < self.pma.num_checkpoints:
                raise ConfigError(f"pma.num_checkpoints ({self.pma.num_checkpoints}) must be >= 1 and <= "
                                  f"checkpointing.keep_last ({self.checkpointing.keep_last})")
        if len(self.optimizer.betas) != 2:
            raise ConfigError(f"optimizer.betas needs two values, got {self.optimizer.betas}")

    def timestep_objective(self, stage: StageConfig) -> ObjectiveConfig:
        """The objective section with this stage's shift (:func:`finetune.optimization.timesteps.sample_timesteps` applies it)."""
        if stage.shift is None:
            return dataclasses.replace(self.objective, shift="resolution")
        return dataclasses.replace(self.objective, shift="fixed", shift_mu=math.log(stage.shift))


def _resolve(path: str, base: Path) -> str:
    return path if Path(path).is_absolute() else str(base / path)


def build_pretrain_config(raw: dict[str, Any], overrides: list[str] = (), base_dir: str | Path = ".") -> PretrainConfig:
    """Parse the YAML mapping plus ``key=value`` overrides (``stages.0.steps=10`` addresses a stage)."""
    raw = copy.deepcopy(raw or {})
    for text in overrides:
        path, value = parse_override(text)
        node: Any = raw
        for part in path[:-1]:
            if isinstance(node, list):
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        if isinstance(node, list):
            node[int(path[-1])] = value
        else:
            node[path[-1]] = value
    config = config_from_dict(PretrainConfig, raw)
    base = Path(base_dir)
    for stage in config.stages:
        stage.data = _resolve(stage.data, base) if stage.data else stage.data
    if config.model.init != "scratch" and not Path(config.model.init).is_absolute() and (base / config.model.init).exists():
        config.model.init = str(base / config.model.init)
    config.output_dir = _resolve(config.output_dir, base)
    config.validate()
    return config


def load_pretrain_config(path: str | Path, overrides: list[str] = ()) -> PretrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return build_pretrain_config(raw, overrides, path.resolve().parent)
