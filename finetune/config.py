"""The typed configuration tree of a training run.

A YAML file (plus ``key=value`` overrides) is parsed into :class:`TrainConfig`. Every section is a
dataclass; unknown keys are rejected with the closest valid name, and values are type-checked,
so a typo fails before any model is loaded instead of being silently ignored.

The parsing itself is :mod:`finetune.config_parser`'s; the ``data`` sections live in
:mod:`finetune.data.config` and the optimizer / schedule / objective / EMA sections in
:mod:`finetune.optimization.config`. All of them are importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from .config_parser import ConfigError, config_from_dict, parse_override
from .config_paths import MODEL_NAME, PATH, report, resolve_config_paths
from .data.config import DataConfig, DatasetConfig, ReferencesConfig, StyleReferencesConfig, SyntheticDataConfig
from .optimization.config import EMAConfig, LRSchedulerConfig, ObjectiveConfig, OptimizerConfig, shortest_warmup

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "DatasetConfig", "EMAConfig", "ExportConfig", "LoggingConfig",
    "LoRAConfig", "LRSchedulerConfig", "ModelConfig", "ObjectiveConfig", "OptimizerConfig", "ParallelConfig",
    "ReferencesConfig", "StyleReferencesConfig", "SyntheticDataConfig", "TrainConfig", "TrainingConfig",
    "ValidationConfig", "WandbConfig", "build_config", "config_from_dict", "load_config",
    "parse_override",
]

@dataclass
class ModelConfig:
    pretrained_model_name_or_path: str = field(default="tiny-random", metadata=MODEL_NAME)
    """RAW checkpoint to train on: a diffusers folder, an original-layout file, or ``tiny-random``."""
    turbo_model_name_or_path: str | None = field(default=None, metadata=MODEL_NAME)
    """Optional Turbo checkpoint; validation then also samples it with the LoRA applied."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of the frozen weights (LoRA weights and full fine-tune masters stay float32)."""
    text_encoder: str | None = field(default=None, metadata=MODEL_NAME)
    """For a transformer file: the Qwen3-VL text encoder (hub id, folder or ``tiny-random``); default Qwen/Qwen3-VL-4B-Instruct."""
    vae: str | None = field(default=None, metadata=MODEL_NAME)
    """For a transformer file: the Qwen-Image VAE (hub id, folder or ``tiny-random``); default Qwen/Qwen-Image."""
    quantize: Literal["none", "fp8", "int8", "nf4"] = "none"
    """LoRA only: storage of the frozen base's block matrices (fp8 per-row scaled; int8/nf4 via
    bitsandbytes). Embedders, input/output projections and the text-fusion projector stay in ``dtype``."""
    max_sequence_length: int = 512


@dataclass
class LoRAConfig:
    type: Literal["lora", "lokr", "loha"] = "lora"
    """``lora`` (low-rank ``B @ A``), ``lokr`` (Kronecker product ``kron(w1, w2)``) or ``loha``
    (Hadamard product of two low-rank matrices), through PEFT's LoraConfig / LoKrConfig / LoHaConfig.
    Each scales its weight delta by ``alpha / rank``."""
    rank: int = 32
    alpha: float = 32.0
    factor: int = -1
    """``lokr`` only: PEFT's ``decompose_factor``, one side of each Kronecker split of a layer's
    widths (-1: the divisor nearest the square root). ``w2`` (the large factor) is itself
    decomposed at ``rank`` when ``rank`` is under half its width, otherwise stored whole."""
    dropout: float = 0.0
    """``lora`` only (PEFT's LoKr/LoHa have no input dropout)."""
    target_modules: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate",
            "ff.gate", "ff.up", "ff.down",
        ]
    )
    """Module suffixes inside ``transformer_blocks.N`` (and text-fusion blocks when enabled)."""
    extra_modules: list[str] = field(default_factory=list)
    """Full names of other linear layers to adapt, e.g. ``img_in``, ``final_layer.linear``, ``time_mod_proj``."""
    train_text_fusion: bool | None = None
    """Also adapt the text-fusion blocks (layer-wise and refiner), where a caption's words, a new
    trigger word among them, become the tokens the image attends to. ``None``: the command's default,
    true for ``krea2 train`` (a trigger word binds there: on the proving ground's digits, a user's
    config reached digit accuracy 1.00 with the trigger against 0.66-0.80 without it, the leak
    unchanged; on the full model at 1024 px about +0.5 GiB at 128 text tokens, +1.8 GiB at 512) and false for
    ``krea2 posttrain`` (its prompts are known ones, and a frozen text path is computed once per prompt)."""
    use_dora: bool = False
    """``lora`` only."""


@dataclass
class TrainingConfig:
    method: Literal["lora", "full"] = "lora"
    max_steps: int = 1000
    batch_size: int = 1
    """Per process. The global batch is ``batch_size * gradient_accumulation_steps * world_size``."""
    gradient_accumulation_steps: int = 1
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """``auto``: bf16 autocast on CUDA and on CPUs with bf16 units (AVX512-BF16 / AMX), float32
    elsewhere (:mod:`krea2_diffusers.precision`; ``KREA2_CPU_BF16=0|1`` overrides the CPU's
    detection). ``bf16`` / ``no`` are obeyed. Trainable weights and optimizer state stay float32."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Per transformer block: ``full`` keeps only block inputs, ``selective`` also matmul/attention outputs."""
    compile: bool = False
    """``torch.compile`` each transformer block."""
    offload_blocks: int = 0
    """LoRA only: keep this many transformer blocks' frozen weights on the CPU and stream them in."""
    ema: EMAConfig | None = None
    """An EMA of the trainable parameters (adapters or the full model); absent: none."""
    reference_kv_cache: bool = False
    """``data.references`` only: reference tokens attend only to reference tokens (the transformer's
    ``reference_attention="cached"``), so inference can compute their keys/values once."""
    prior_loss_weight: float = 1.0
    """Loss weight of the samples of ``data.datasets`` marked ``is_regularization``."""


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """``auto``: DDP for LoRA, FSDP2 for full fine-tune (only matters with more than one process)."""


def scheduled(step: int, every_n_steps: int, steps: list[int]) -> bool:
    """A schedule of ``every_n_steps`` (0: none) plus the listed ``steps``: is optimizer step ``step`` on it?"""
    return (every_n_steps > 0 and step % every_n_steps == 0) or step in steps


@dataclass
class CheckpointConfig:
    every_n_steps: int = 250
    keep_last: int = 3
    async_save: bool = False
    """Write checkpoints in the background (DCP async_save) while training continues."""
    steps: list[int] = field(default_factory=list)
    """Also save after these steps, besides every ``every_n_steps``: e.g. a denser grid early in a
    LoRA run, where it changes most (``keep_last`` counts them too)."""

    def due(self, step: int) -> bool:
        """Whether the schedule saves after optimizer step ``step`` (1-based)."""
        return scheduled(step, self.every_n_steps, self.steps)


@dataclass
class ValidationConfig:
    every_n_steps: int = 0
    """0 disables sampling during training; a final sample set is still made if prompts are given."""
    steps: list[int] = field(default_factory=list)
    """Also sample after these steps, besides every ``every_n_steps`` (the report measures each)."""
    prompts: list[str] = field(default_factory=list)
    negative_prompt: str = ""
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    """Krea convention: ``v = v_cond + g * (v_cond - v_uncond)``, 0 disables guidance (= 1 in ComfyUI terms)."""
    turbo_num_inference_steps: int = 8
    height: int = 1024
    width: int = 1024
    seed: int = 0
    reference_images: list[list[str]] = field(default_factory=list, metadata=PATH)
    """``data.references`` runs: one list of reference images per prompt (the pipeline's
    ``reference_images``); each sample is saved as the references and the output side by side."""
    metrics: bool | None = None
    """The checkpoint report (:mod:`finetune.report`: concept, leak, copying, diversity at each
    validation, ``report.json`` / ``report.html``). None: on when ``prompts`` are set (``krea2 train``;
    not for ``data.references`` runs, whose samples are edits)."""
    leak_prompts: list[str] | None = None
    """Prompts without the trigger, measured against the base model's samples (leak). None: the
    ``prompts`` with the trigger words (``export.trigger_words``, datasets' ``caption_prefix``) removed."""
    seeds_per_prompt: int = 2
    """Seeds each report prompt is sampled with (copy 0 is the ordinary validation sample); diversity needs 2."""
    encoder: str = field(default="qwen3vl", metadata=MODEL_NAME)
    """Image features of the report: ``qwen3vl`` (the pipeline's own vision tower, pooled; nothing to
    download), ``pixels`` (no model: layout and colour, for tiny models) or a ``transformers`` image
    model (folder or hub id: DINOv2, SigLIP, CLIP ...)."""

    def due(self, step: int) -> bool:
        """Whether the schedule samples after optimizer step ``step`` (1-based; prompts or not)."""
        return scheduled(step, self.every_n_steps, self.steps)


@dataclass
class ExportConfig:
    formats: list[Literal["diffusers", "comfyui", "kohya", "original"]] = field(
        default_factory=lambda: ["diffusers", "comfyui", "kohya"]
    )
    """LoRA: diffusers/comfyui/kohya files. Full fine-tune: diffusers folder and original-layout file."""
    trigger_words: list[str] = field(default_factory=list)
    base_model: str | None = None
    """Name written into the metadata; defaults to ``model.pretrained_model_name_or_path``."""


@dataclass
class WandbConfig:
    """Weights & Biases: the scalars and validation images of ``metrics.jsonl``, from the main process."""

    project: str = ""
    run_name: str | None = None
    """Default: the output folder's name."""
    mode: Literal["online", "offline"] = "online"
    """``online`` needs an API key (``WANDB_API_KEY`` or ``wandb login``), checked before anything
    loads; ``offline`` writes ``<output_dir>/wandb/offline-run-*`` only (``wandb sync`` sends it later)."""


@dataclass
class LoggingConfig:
    log_every_n_steps: int = 1
    tensorboard: bool = True
    progress_bar: bool = True
    wandb: WandbConfig | None = None
    """Absent: no W&B logging."""


def check_step_list(name: str, steps: list[int], max_steps: int, limit: str = "training.max_steps") -> None:
    """A ``steps`` list of a schedule: optimizer steps in [1, ``max_steps``] (a later one would never run);
    ``limit`` names where ``max_steps`` comes from in the error."""
    for step in steps:
        if not 1 <= step <= max_steps:
            raise ConfigError(f"{name}: step {step} is outside 1..{limit} ({max_steps})")


@dataclass
class TrainConfig:
    output_dir: str = field(default="outputs/krea2-lora", metadata=PATH)
    """The run folder. Paths written in a YAML file are relative to the file's folder
    (:mod:`finetune.config_paths`); this default and command-line overrides, to the working directory."""
    recipe: str | None = None
    """Named defaults from :mod:`finetune.recipes`; the file's own values win."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # Post-training methods bring their own data (pairs, prompts) and leave ``data`` unset.
    requires_data: ClassVar[bool] = True
    text_fusion_default: ClassVar[bool] = True
    """``lora.train_text_fusion`` when the config leaves it out (see :class:`LoRAConfig`)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _validate_adapter(self) -> None:
        lora = self.lora
        if lora.factor == 0 or lora.factor < -1:
            raise ConfigError(f"lora.factor must be -1 (the divisor nearest the square root) or a positive integer, got {lora.factor}")
        if lora.factor != -1 and lora.type != "lokr":
            raise ConfigError(f"lora.factor={lora.factor} applies to lora.type lokr only (lora.type is {lora.type!r})")
        if lora.type == "lora":
            return
        if lora.use_dora:
            raise ConfigError(f"lora.use_dora applies to lora.type lora only (lora.type is {lora.type!r})")
        if lora.dropout:
            raise ConfigError(f"lora.dropout={lora.dropout} applies to lora.type lora only (PEFT's {lora.type} has none)")
        if self.training.method == "lora" and self.model.quantize == "nf4":
            # PEFT's LoKr/LoHa build their weight delta in the base weight's shape, which a packed
            # 4-bit layer does not have; fp8 and int8 keep the (out, in) shape.
            raise ConfigError(f"lora.type={lora.type!r} cannot train over model.quantize 'nf4' (PEFT's {lora.type} "
                              "needs the base weight's (out, in) shape, which packed 4-bit weights lose); use fp8 or int8")

    def _validate_references(self) -> None:
        pairs, validation = self.data.references, self.validation
        if pairs is None:
            if self.training.reference_kv_cache:
                raise ConfigError("training.reference_kv_cache needs data.references (paired samples); "
                                  "style references choose theirs with data.style_references.attention")
            if validation.reference_images:
                raise ConfigError("validation.reference_images needs data.references (paired samples)")
            return
        if validation.reference_images and len(validation.reference_images) != len(validation.prompts):
            raise ConfigError(f"validation.reference_images needs one list of images per prompt: {len(validation.prompts)} "
                              f"prompt(s), {len(validation.reference_images)} list(s)")
        if any(not 1 <= len(refs) <= pairs.max_references for refs in validation.reference_images):
            raise ConfigError(f"validation.reference_images: each prompt takes 1 to data.references.max_references="
                              f"{pairs.max_references} images, got {[len(refs) for refs in validation.reference_images]}")
        from krea2_diffusers.conditioning.reference_images import MAX_REFERENCE_IMAGES

        if self.data.style_references.enabled:
            raise ConfigError("data.references (paired samples) and data.style_references cannot be combined")
        if not 1 <= pairs.max_references <= MAX_REFERENCE_IMAGES:
            raise ConfigError(f"data.references.max_references must be in [1, {MAX_REFERENCE_IMAGES}] (the pipeline's "
                              f"reference_images take at most {MAX_REFERENCE_IMAGES}), got {pairs.max_references}")
        if pairs.max_pixels < 256:
            raise ConfigError(f"data.references.max_pixels must be at least 256 (one 16x16 token), got {pairs.max_pixels}")
        if not (pairs.vision_tokens or pairs.latents):
            raise ConfigError("data.references: vision_tokens and latents are both false, the references would not enter the model")
        if self.training.reference_kv_cache and not pairs.latents:
            raise ConfigError("training.reference_kv_cache needs data.references.latents (it masks the reference latent tokens)")
        shuffled = [f"data.datasets[{i}].shuffle_tags" for i, entry in enumerate(self.data.datasets) if entry.shuffle_tags]
        if pairs.vision_tokens and shuffled:
            # The instruction is encoded once with its references as vision tokens (a Qwen3-VL pass
            # per caption and its images): a new tag order per epoch would need one such pass each.
            raise ConfigError(f"{', '.join(shuffled)} with data.references.vision_tokens: the instruction is encoded once "
                              "with the reference images, in one tag order; set shuffle_tags: false, or "
                              "data.references.vision_tokens: false (the references as latents only, the tags shuffled)")

    def _validate_training_options(self) -> None:
        """EMA, optimizer, timestep sampler and W&B values (packages are checked by the trainer,
        still before any model loads: :func:`finetune.optimization.optim.check_optimizer_package`)."""
        ema, optimizer, objective = self.training.ema, self.optimizer, self.objective
        if ema is not None:
            if not 0.0 < ema.decay < 1.0:
                raise ConfigError(f"training.ema.decay must be in (0, 1), got {ema.decay}")
            if ema.every_n_steps <= 0:
                raise ConfigError(f"training.ema.every_n_steps must be positive, got {ema.every_n_steps}")
            if ema.warmup is not True and ema.warmup is not False and ema.warmup < shortest_warmup(ema):
                raise ConfigError(
                    f"training.ema.warmup={ema.warmup}: a warm-up reaching decay {ema.decay} must last at least "
                    f"{shortest_warmup(ema)} steps (its window, 1 / (1 - decay) updates, would be longer than the run "
                    "so far and the average would keep part of the starting weights); use warmup: true, a longer "
                    "warm-up or a lower decay")
            if optimizer.name == "adamw_schedulefree":
                raise ConfigError("training.ema with optimizer.name adamw_schedulefree: schedule-free already averages "
                                  "its iterates (its eval-mode weights are what the run exports); use one or the other")
        if optimizer.name == "adamw_schedulefree" and self.lr_scheduler.name != "constant":
            raise ConfigError(f"optimizer.name adamw_schedulefree replaces the schedule: lr_scheduler.name must be "
                              f"'constant' (lr_scheduler.warmup_steps still applies), got {self.lr_scheduler.name!r}")
        if optimizer.d_coef <= 0:
            raise ConfigError(f"optimizer.d_coef must be positive, got {optimizer.d_coef}")
        mode_limit = 2 / (math.pi - 2)
        positive = {"objective.sigmoid_scale": objective.sigmoid_scale, "objective.beta_alpha": objective.beta_alpha,
                    "objective.beta_beta": objective.beta_beta, "objective.logit_std": objective.logit_std}
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{key} must be positive, got {value}")
        if not -1.0 <= objective.mode_scale <= mode_limit:
            raise ConfigError(f"objective.mode_scale must be in [-1, 2 / (pi - 2) = {mode_limit:.4f}] (SD3's mode map is "
                              f"monotone in [0, 1] there), got {objective.mode_scale}")
        wandb = self.logging.wandb
        if wandb is not None and not wandb.project.strip():
            raise ConfigError("logging.wandb.project is required (the W&B project the run is logged to)")

    def _validate_datasets(self) -> None:
        data = self.data
        if data.datasets and (data.path is not None or data.synthetic is not None):
            raise ConfigError("give data.datasets or data.path (or data.synthetic), not both")
        if data.datasets and data.repeats != 1:
            raise ConfigError("data.repeats applies to data.path; give each entry of data.datasets its own repeats")
        if self.training.prior_loss_weight < 0:
            raise ConfigError(f"training.prior_loss_weight must be >= 0, got {self.training.prior_loss_weight}")
        for i, entry in enumerate(data.datasets):
            where = f"data.datasets[{i}]"
            if not entry.path:
                raise ConfigError(f"{where}.path is required")
            if entry.repeats <= 0:
                raise ConfigError(f"{where}.repeats must be positive, got {entry.repeats}")
            if not (entry.weight > 0 and math.isfinite(entry.weight)):
                raise ConfigError(f"{where}.weight must be a positive number (its share of the samples drawn), got {entry.weight}")
            if entry.resolution is not None and entry.resolution < 16:
                raise ConfigError(f"{where}.resolution must be >= 16 pixels or null, got {entry.resolution}")
            if entry.keep_tags < 0:
                raise ConfigError(f"{where}.keep_tags must be >= 0, got {entry.keep_tags}")
            if entry.caption_dropout is not None and not 0.0 <= entry.caption_dropout < 1.0:
                raise ConfigError(f"{where}.caption_dropout must be in [0, 1), got {entry.caption_dropout}")
        if data.datasets and all(entry.is_regularization for entry in data.datasets):
            raise ConfigError("every entry of data.datasets is_regularization: at least one must hold the images to learn")
        if data.masks is True or data.masks is False:
            return
        if not data.masks.strip():
            raise ConfigError("data.masks must be true, false or a folder of masks, got an empty string")

    def validate(self) -> None:
        """Checks that need more than one field (types are checked while parsing), and the
        defaults that depend on the command."""
        if self.lora.train_text_fusion is None:
            self.lora.train_text_fusion = self.text_fusion_default
        positive = {
            "training.max_steps": self.training.max_steps,
            "training.batch_size": self.training.batch_size,
            "training.gradient_accumulation_steps": self.training.gradient_accumulation_steps,
            "lora.rank": self.lora.rank,
            "data.resolution": self.data.resolution,
            "data.repeats": self.data.repeats,
            "checkpointing.keep_last": self.checkpointing.keep_last,
            "model.max_sequence_length": self.model.max_sequence_length,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        check_step_list("checkpointing.steps", self.checkpointing.steps, self.training.max_steps)
        check_step_list("validation.steps", self.validation.steps, self.training.max_steps)
        if self.data.bucket_step % 16 or self.data.bucket_step <= 0:
            raise ConfigError(f"data.bucket_step must be a positive multiple of 16 (VAE 8 x patch 2), got {self.data.bucket_step}")
        if not 0.0 <= self.data.caption_dropout < 1.0:
            raise ConfigError(f"data.caption_dropout must be in [0, 1), got {self.data.caption_dropout}")
        if not 0 < self.data.min_aspect_ratio <= 1.0 <= self.data.max_aspect_ratio:
            raise ConfigError("data.min_aspect_ratio <= 1 <= data.max_aspect_ratio must hold")
        if self.requires_data and self.data.path is None and self.data.synthetic is None and not self.data.datasets:
            raise ConfigError("data.path is required (or data.datasets, or data.synthetic for a self-made dataset)")
        self._validate_datasets()
        if self.training.method == "full" and self.model.quantize != "none":
            raise ConfigError(f"model.quantize={self.model.quantize!r} needs training.method=lora (a full fine-tune trains every weight)")
        if self.training.offload_blocks < 0:
            raise ConfigError(f"training.offload_blocks must be >= 0, got {self.training.offload_blocks}")
        if self.training.method == "full" and self.training.offload_blocks:
            raise ConfigError("training.offload_blocks is for LoRA; a full fine-tune shards the model over processes instead")
        if self.training.offload_blocks and self.training.compile:
            raise ConfigError("training.offload_blocks and training.compile cannot be combined (the swap hooks run outside compiled code)")
        if self.data.num_workers < 0 or self.data.prefetch_factor <= 0:
            raise ConfigError("data.num_workers must be >= 0 and data.prefetch_factor > 0")
        refs = self.data.style_references
        if refs.enabled:
            from krea2_diffusers.conditioning.references import MAX_STYLE_REFERENCES

            if not 1 <= refs.max_references <= MAX_STYLE_REFERENCES:
                raise ConfigError(f"data.style_references.max_references must be in [1, {MAX_STYLE_REFERENCES}], got {refs.max_references}")
            if len(refs.strength_range) != 2 or not 0 < refs.strength_range[0] <= refs.strength_range[1]:
                raise ConfigError(f"data.style_references.strength_range must be [low, high] with 0 < low <= high, got {refs.strength_range}")
            if refs.resolution is not None and refs.resolution < 16:
                raise ConfigError(f"data.style_references.resolution must be >= 16 pixels or null, got {refs.resolution}")
        self._validate_references()
        self._validate_adapter()
        self._validate_training_options()
        if len(self.optimizer.betas) != 2:
            raise ConfigError(f"optimizer.betas needs two values, got {self.optimizer.betas}")
        if self.training.method == "full" and any(f in ("comfyui", "kohya") for f in self.export.formats):
            # LoRA formats make no sense for a full fine-tune; pick the weight formats instead.
            self.export.formats = ["diffusers", "original"]
        for size_name in ("height", "width"):
            if getattr(self.validation, size_name) % 16:
                raise ConfigError(f"validation.{size_name} must be a multiple of 16")
        validation = self.validation
        if validation.seeds_per_prompt < 1:
            raise ConfigError(f"validation.seeds_per_prompt must be >= 1, got {validation.seeds_per_prompt}")
        if validation.metrics and not validation.prompts:
            raise ConfigError("validation.metrics needs validation.prompts (the report measures their samples)")
        if validation.metrics and self.data.references is not None:
            raise ConfigError("validation.metrics: the report does not measure data.references runs (their samples are edits)")


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_config(raw: dict[str, Any], overrides: list[str] = (), cls: type = TrainConfig) -> TrainConfig:
    """Parse a raw mapping (from YAML) plus ``key=value`` overrides into a validated config
    (``cls``: :class:`TrainConfig` or a subclass, e.g. the post-training config)."""
    from .recipes import UnknownRecipe, recipe_defaults

    raw = copy.deepcopy(raw or {})
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    if raw.get("recipe"):
        try:
            defaults = recipe_defaults(raw["recipe"])
        except UnknownRecipe as err:
            raise ConfigError(err.message) from None
        raw = _deep_merge(defaults, raw)
    config = config_from_dict(cls, raw)
    config.validate()
    return config


def load_config(path: str | Path, overrides: list[str] = (), cls: type = TrainConfig) -> TrainConfig:
    """The config of a YAML file plus ``key=value`` overrides. A relative path in the file is resolved
    against the file's directory, and said so on stderr (:mod:`finetune.config_paths`); the overrides'
    paths are the shell's (relative to the working directory)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    with path.open() as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    base = Path(os.path.abspath(path)).parent
    # Keys an override replaces (``--output-dir`` is one) are not announced: the file's value is not used.
    replaced = {".".join(parse_override(text)[0]) for text in overrides}
    report([(key, value) for key, value in resolve_config_paths(cls, raw, base) if key not in replaced], base)
    return build_config(raw, overrides, cls)
