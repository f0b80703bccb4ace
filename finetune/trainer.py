"""The training loop. Everything it calls lives in a module named after what it does:
``engine`` (processes, sharded setup, DCP checkpoints, the DataLoader), ``data`` (samples and the
feature cache), ``methods`` (LoRA / full), ``objective``, ``optim``, ``export``."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from .config import ConfigError, TrainConfig
from .data.cache import build_cache
from .data.datasets import SampleRules
from .data.encoding import position_ids
from .data.samples import prepare_samples
from .engine import checkpoint as ckpt
from .engine.loader import CachedFeatures, GlobalBatch, ResumableSampler, make_loader, step_layout
from .engine.parallel import full_state_dict, no_sync, trainable_state, unwrap, wrap_model
from .engine.runtime import setup_runtime
from .metrics import MetricsLogger, check_wandb
from .methods import add_lora, check_quantize, quantize_base, trainable_parameter_count
from .optimization.objective import add_noise, flow_matching_loss
from .optimization.optim import check_optimizer_package, eval_weights, has_eval_weights, make_lr_scheduler, make_optimizer
from .rundir import RunDirectoryError, check_output_dir, config_fingerprint
from .run_requests import between_steps
from .stop import StopRequest

# ``KREA2_STEP_SPLIT=1``: each metrics.jsonl row gains ``step_split``, where the step's time went (see
# Trainer.train_step). Off by default: its values differ run to run, and rows compared across runs
# (resume, process counts) would differ with them.
STEP_SPLIT_ENV = "KREA2_STEP_SPLIT"

__all__ = ["NonFiniteLossError", "RunDirectoryError", "StopRequest", "TrainResult", "Trainer", "check_output_dir", "prepare_samples", "train"]

logger = logging.getLogger("finetune")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the message names the step and the batch's images."""


@dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    exported: list[Path] = field(default_factory=list)
    interrupted: bool = False


def _json_roundtrip(value):
    return json.loads(json.dumps(value))


class Trainer:
    def __init__(self, config: TrainConfig, resume: bool = False):
        self.config = config
        self.resume = resume
        self.runtime = setup_runtime(config)
        check_quantize(config.model.quantize, self.runtime.device)  # before any model loads
        check_optimizer_package(config.optimizer, self.runtime.strategy)
        check_wandb(config.logging.wandb)
        self.ema = None  # the trainable parameters' EMA (training.ema), made once they exist
        self.out = Path(config.output_dir)
        self.lora = config.training.method == "lora"
        # Further scalars of the last step for metrics.jsonl (post-training's rewards, margins ...).
        self.extra_metrics: dict[str, float] = {}
        # The input iterator when setup opened it early (its workers forked before the model loaded).
        self.early_inputs = None
        self.step_split = None  # the last train_step's SplitTimer (with KREA2_STEP_SPLIT=1, logged)

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        config, runtime = self.config, self.runtime
        check_output_dir(self.out, config, self.resume)
        self.samples, self.buckets, _ = prepare_samples(config, self.out, runtime)
        # The reference source of each forward (style groups, or paired samples' cached references)
        # and the batching key: rows of one forward share a bucket and, for pairs, reference sizes.
        self.references, self.batch_keys = None, self.buckets
        if config.data.style_references.enabled:
            from .data.style_groups import StyleGroups

            self.references = StyleGroups(self.samples, config.data.style_references)
        if config.data.references is not None:
            from .data.pairs import batch_keys, check_reference_files

            check_reference_files(config.validation.reference_images, "validation.reference_images")
            self.batch_keys = batch_keys(self.samples, self.buckets, config.data.references.max_pixels)
        self.global_batch = self._global_batch()
        self.layout = step_layout(self.global_batch, runtime.rank, runtime.world_size)
        runtime.barrier()
        self.record_run()
        self.sample_rules = SampleRules.of(config, self.samples, self._batches(),
                                           config.training.max_steps * self.global_batch.accumulation, self.out, runtime.is_main)

        from krea2_diffusers.loaders.assembly import check_text_width

        from .model import build_sharded_transformer, load_pipeline, load_transformer, release_encoders

        # The pipeline brings the encoders only: the features are cached, the encoders leave (or go
        # altogether when no validation samples need them) and only then does the transformer load,
        # so a 12.8B base and an 8 GB text encoder never share host memory.
        self.pipe = load_pipeline(config.model, runtime.device, transformer=None)
        self.cache = build_cache(
            self.pipe, self.samples, self.buckets, config.data.cache_dir or self.out / "cache",
            config.model.max_sequence_length, runtime.device, runtime.rank, runtime.world_size, runtime.barrier,
            captions=self.sample_rules.captions,
        )
        if config.data.references is not None:
            from .data.pair_features import build_pair_cache

            dropout = max([config.data.caption_dropout] + [d.caption_dropout or 0.0 for d in config.data.datasets])
            self.references = build_pair_cache(
                self.pipe, self.samples, config.data.references, config.data.cache_dir or self.out / "cache", dropout,
                config.model.max_sequence_length, runtime.device, runtime.rank, runtime.world_size, runtime.barrier,
                captions=[variants[0] for variants in self.sample_rules.captions])
        text_encoder = SimpleNamespace(config=self.pipe.text_encoder.config)  # its width, checked once the transformer is there
        release_encoders(self.pipe, keep=bool(config.validation.prompts))
        # The data-loader workers fork now, while this process is small: forked later, they would
        # share the base's and the LoRA's pages, and every page this process rewrites afterwards (the
        # LoRA weights at each optimizer step, reused heap) would be held twice (measured at full
        # size on the CPU: +0.5 GiB over the trainer's own peak). The data position comes from the
        # checkpoint's train_state.json; _restore checks it against the state it loads.
        self.start_step = self._resume_position() if self.resume else 0
        self.early_inputs = iter(self.step_inputs())
        if self.lora:
            started = time.perf_counter()
            transformer = load_transformer(config.model)
            logger.info("transformer loaded in %.1f s", time.perf_counter() - started)
            check_text_width(transformer, text_encoder, config.model.text_encoder or config.model.pretrained_model_name_or_path)
            self.pipe.register_modules(transformer=transformer)
            self.model = self._lora_model(transformer)
        else:
            self.model = build_sharded_transformer(config, runtime)
            self.pipe.register_modules(transformer=self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, config.optimizer)
        if config.training.ema is not None:
            from .optimization.ema import EMA

            self.ema = EMA(trainable_state(self.model), config.training.ema)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.max_steps)
        restored = self._restore() if self.resume else 0
        if restored != self.start_step:
            raise RuntimeError(f"the checkpoint's data position changed while loading: {self.start_step} -> {restored}")
        if runtime.is_main:
            logger.info("training %d parameters on %d samples, %d process(es), strategy %s, %d forward(s) of %d per step",
                        trainable_parameter_count(unwrap(self.model)), len(self.samples), runtime.world_size,
                        runtime.strategy, len(self.layout), self.layout[0].stop - self.layout[0].start)

    def record_run(self) -> None:
        """The checkpointer; on the main process the run folder, ``run.json`` (first start) and no
        stale staging folders."""
        config, runtime = self.config, self.runtime
        self.checkpointer = ckpt.Checkpointer(self.out / "checkpoints", runtime, config.checkpointing.keep_last,
                                              config.checkpointing.async_save)
        if runtime.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if not (self.out / "run.json").exists():
                run = {"fingerprint": config_fingerprint(config), "config": config.to_dict(),
                       "world_size": runtime.world_size, "global_batch": self.global_batch.to_dict()}
                (self.out / "run.json").write_text(json.dumps(run, indent=2))
            ckpt.clean_staging(self.checkpointer.folder)

    def _global_batch(self) -> GlobalBatch:
        """Fixed at the run's start; a resumed run (on any number of processes) keeps it."""
        run_file = self.out / "run.json"
        if self.resume and run_file.exists():
            saved = json.loads(run_file.read_text()).get("global_batch")
            if saved:
                return GlobalBatch(**saved)
        t = self.config.training
        return GlobalBatch(t.batch_size * self.runtime.world_size, t.gradient_accumulation_steps, t.batch_size)

    def _lora_model(self, transformer):
        config = self.config
        compute = torch.float32 if config.model.dtype == "float32" else torch.bfloat16
        quantize_base(transformer, config.model.quantize, compute)
        if self.runtime.is_main:
            from krea2_diffusers.quantization.gguf import resident_bytes

            logger.info("transformer: %d bytes resident (model.quantize %s)", resident_bytes(transformer), config.model.quantize)
        torch.manual_seed(config.training.seed)  # LoRA A init: same on every process
        add_lora(transformer, config.lora)
        transformer.train()
        blocks = list(transformer.transformer_blocks)
        if config.training.offload_blocks > len(blocks):
            raise ConfigError(f"training.offload_blocks={config.training.offload_blocks} but the transformer has {len(blocks)} blocks")
        return wrap_model(transformer, blocks, self.runtime, activation_checkpointing=config.training.activation_checkpointing,
                          compile=config.training.compile, mixed_precision=self.runtime.mixed_precision,
                          offloaded_blocks=config.training.offload_blocks)

    def _expected_state(self) -> dict:
        return _json_roundtrip({"fingerprint": config_fingerprint(self.config), "global_batch": self.global_batch.to_dict()})

    def _resume_position(self) -> int:
        """The step a resumed run starts from (its data position), read before any model loads."""
        latest = ckpt.latest_checkpoint(self.checkpointer.folder)
        return 0 if latest is None else int(ckpt.read_train_state(latest)["data"]["next_step"])

    def _restore(self) -> int:
        latest = ckpt.latest_checkpoint(self.checkpointer.folder)
        if latest is None:
            if (self.out / "run.json").exists() and self.runtime.is_main:
                logger.warning("--resume: no checkpoint in %s yet, starting from step 0", self.checkpointer.folder)
            return 0
        state = self.checkpointer.load(latest, self.model, self.optimizer, trainable_only=self.lora,
                                       expected=self._expected_state(), extra=self.extra_state())
        if has_eval_weights(self.optimizer):  # the checkpoint holds the eval-mode weights (see save): train from them
            self.optimizer.train()
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if state["world_size"] != self.runtime.world_size and self.runtime.is_main:
            logger.info("resuming %s (written by %d process(es)) on %d: the global batch of %d samples is kept",
                        latest.name, state["world_size"], self.runtime.world_size, self.global_batch.samples_per_step)
        return int(state["data"]["next_step"])

    # ---------------------------------------------------------------- one step
    def _to_device(self, item: dict) -> dict:
        device = self.runtime.device
        batch = {k: v.to(device, non_blocking=True) for k, v in item.items() if k not in ("ids", "grid", "reference_ids")}
        grid = item["grid"].tolist()
        batch["positions"] = position_ids(item["embeds"].shape[1], grid[0], grid[1], device)
        batch["ids"] = item["ids"].tolist()
        if "references" in batch:  # reference training: [text, image, references]
            batch["positions"] = torch.cat([batch["positions"], batch.pop("reference_positions")])
        if "reference_ids" in item:  # style references: which samples served as references
            batch["reference_ids"] = item["reference_ids"].tolist()
        return batch

    def reference_kwargs(self, batch: dict) -> dict:
        """The transformer's reference arguments for a batch (none without reference latents); the
        references are modulated as timestep 0 (the transformer's default ``index_timestep_zero``)."""
        if "references" not in batch:
            return {}
        cached = self.config.training.reference_kv_cache or self.config.data.style_references.attention == "cached"
        return dict(reference_hidden_states=batch["references"], key_bias=batch.get("key_bias"),
                    reference_attention="cached" if cached else "joint", reference_method="index_timestep_zero")

    def train_step(self, step: int, items) -> tuple[float, float]:
        """One optimizer step over this process's forwards; returns (loss, grad norm).

        Each forward's summed per-sample loss is scaled by ``world_size / samples_per_step`` so the
        gradient averaged by DDP/FSDP is the mean over the whole global batch, however the step's
        samples are split over processes.

        ``self.step_split`` records where the step's time went (wall, user / system CPU, minor page
        faults of this process): ``data`` (the loader's next batch onto the device), ``forward``
        (through the loss), ``backward`` (activation checkpointing's recompute included),
        ``optimizer`` (clipping, the step, zeroing). A GPU's queued kernels land in the part that
        waits for them (the loss's ``float`` waits for the forward).
        """
        from krea2_diffusers.cpu_usage import SplitTimer

        config, runtime = self.config, self.runtime
        total_samples = self.global_batch.samples_per_step
        local_sum = 0.0
        split = SplitTimer()
        for j in range(len(self.layout)):
            batch = self._to_device(next(items))
            split.mark("data")
            noisy = add_noise(batch["x0"], batch["noise"], batch["t"])
            # Forward and backward inside: DDP prepares its gradient all-reduce in the forward.
            with no_sync(self.model, runtime, sync=j == len(self.layout) - 1):
                with runtime.autocast():
                    pred = self.model(
                        hidden_states=noisy, encoder_hidden_states=batch["embeds"], timestep=batch["t"],
                        position_ids=batch["positions"], encoder_attention_mask=batch["mask"], return_dict=False,
                        **self.reference_kwargs(batch),
                    )[0]
                size = len(batch["ids"])
                loss_sum = flow_matching_loss(pred, batch["x0"], batch["noise"], batch["t"], config.objective.loss_weighting,
                                              batch.get("loss_mask"), batch.get("sample_weights")) * size
                value = float(loss_sum.detach())
                if not math.isfinite(runtime.sum(0.0 if math.isfinite(value) else math.inf)):
                    names = [self.samples[i].image_path.name for i in batch["ids"]]
                    raise NonFiniteLossError(
                        f"loss is {value} at step {step + 1} (forward {j}) on images {names}; "
                        f"stopped without saving, the last good checkpoint is kept in {self.checkpointer.folder}"
                    )
                split.mark("forward")
                (loss_sum * (runtime.world_size / total_samples)).backward()
                split.mark("backward")
            local_sum += value
        max_norm = config.optimizer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = float(grad_norm)
        split.mark("optimizer")
        self.step_split = split
        return runtime.sum(local_sum) / total_samples, grad_norm

    # ---------------------------------------------------------------- checkpoints and export
    def save(self, step: int) -> None:
        """A checkpoint of step ``step``, holding the weights to evaluate (:func:`~.optim.eval_weights`)."""
        ema = self.config.training.ema
        state = {**self._expected_state(), "lr_scheduler": self.lr_scheduler.state_dict(), "data": {"next_step": step},
                 "method": self.config.training.method,
                 "transformer_config": _json_roundtrip({k: v for k, v in dict(unwrap(self.model).config).items()
                                                        if not k.startswith("_")}),
                 "base_model": self.config.export.base_model or self.config.model.pretrained_model_name_or_path,
                 "lora": _json_roundtrip(vars(self.config.lora)) if self.lora else None,
                 "export": self.export_hints(),
                 "ema": {"decay": ema.decay, "every_n_steps": ema.every_n_steps, "export": ema.export,
                         "warmup": ema.warmup} if ema else None}
        with eval_weights(self.optimizer):
            self.checkpointer.save(step, self.model, self.optimizer, trainable_only=self.lora, train_state=state,
                                   extra=self.extra_state())

    def extra_state(self) -> dict:
        """Checkpoint sections beside the model and optimizer: the EMA's (``ema.<name>``)."""
        return {"ema": self.ema.state} if self.ema is not None else {}

    def run_validation(self, validator, step: int, metrics: MetricsLogger) -> None:
        """Sample the validation prompts with the weights the run delivers: the EMA when there is
        one, schedule-free's eval-mode weights, else the trained weights."""
        averaged = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
        with eval_weights(self.optimizer), averaged:
            validator.run(self.model, step, metrics, self.lora_layers() if self.lora else None)

    def report_collector(self):
        """The checkpoint report's collector (:mod:`finetune.report`), None when ``validation.metrics`` is off."""
        from .report.collector import collector_for

        return collector_for(self.config, getattr(self, "samples", None), self.out, self.runtime.is_main, self.start_step)

    def export_hints(self) -> dict:
        """What the export takes from the checkpoint: ``model_prefix`` (the part of the model that
        is the exported transformer), ``exclude_adapters``, extra file ``metadata``."""
        return {}

    def export(self, step: int) -> list[Path]:
        """Written from the final DCP checkpoint by the main process, streaming tensor by tensor."""
        from .export.writer import export_checkpoint

        self.checkpointer.wait()
        written = []
        if self.runtime.is_main:
            path = self.checkpointer.folder / ckpt.checkpoint_name(step)
            written = export_checkpoint(path, self.out, self.config.export.formats, self.config.export.trigger_words)
            ema = self.config.training.ema
            if ema is not None and ema.export == "both":  # the average above, the trained weights beside it
                (self.out / "raw").mkdir(exist_ok=True)
                written += export_checkpoint(path, self.out / "raw", self.config.export.formats,
                                             self.config.export.trigger_words, weights="raw")
        self.runtime.barrier()
        return written

    def lora_layers(self):
        from krea2_diffusers.loaders.lora import lora_layers_from_diffusers_state_dict

        state = full_state_dict(self.model, self.runtime, trainable_only=True)
        return lora_layers_from_diffusers_state_dict(state, self.config.lora.alpha, self.config.lora.rank)

    def forward_batch(self, step: int, forward: int = 0) -> dict:
        """The device tensors of one of this process's forward passes, as the loader makes them."""
        return self._to_device(self._dataset()[(step, self.layout[forward])])

    # ---------------------------------------------------------------- the loop
    def _dataset(self) -> CachedFeatures:
        config, rules = self.config, self.sample_rules  # per-dataset caption dropout and loss weights
        return CachedFeatures(self.cache, self._batches(), self.global_batch, config.training.seed,
                              rules.caption_dropout, config.objective, self.references,
                              sample_weights=rules.sample_weights, masked=bool(config.data.masks))

    def step_inputs(self):
        """What ``train_step`` draws its inputs from, from the resumed step on (the engine's DataLoader)."""
        config = self.config
        dataset = self._dataset()
        sampler = ResumableSampler(self.layout, self.start_step, config.training.max_steps)
        return make_loader(dataset, sampler, num_workers=config.data.num_workers, prefetch_factor=config.data.prefetch_factor,
                           pin_memory=self.runtime.device.type == "cuda")

    def _batches(self):
        from .data.datasets import sample_batches

        return sample_batches(self.config, self.samples, self.batch_keys, self.global_batch.micro_batch, self.out)

    def train(self) -> TrainResult:
        # Signals are caught from the start (the command's entry point caught them earlier still):
        # a stop asked for while the run sets up (loading, caching) ends it before its first step.
        with StopRequest() as stop:
            return self._train(stop)

    def _train(self, stop: StopRequest) -> TrainResult:
        config, runtime = self.config, self.runtime
        self.setup()
        from .validation import Validator

        validator = Validator(config, self.pipe, runtime, self.out, report=self.report_collector())
        metrics = MetricsLogger(self.out, runtime.is_main, self.start_step, config.training.max_steps,
                                config.logging.tensorboard, config.logging.progress_bar, config.logging.log_every_n_steps,
                                wandb=config.logging.wandb, run_config=config.to_dict())
        result = TrainResult(self.out, self.start_step)
        step = self.start_step
        sampled = None  # the last step sampled (asked for, or due)
        items = self.early_inputs if self.early_inputs is not None else iter(self.step_inputs())
        self.early_inputs = None
        try:
            # Stopped while setting up: no step ran, there is nothing new to save.
            result.interrupted = step < config.training.max_steps and runtime.any(stop.requested)
            if not result.interrupted and validator.report is not None:
                validator.sample_base(self.model, self.lora, self.start_step)
            while not result.interrupted and step < config.training.max_steps:
                lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step runs with (the step moves the schedule on)
                loss, grad_norm = self.train_step(step, items)
                step += 1
                result.losses[step] = loss
                extra = self.extra_metrics
                if self.step_split is not None and os.environ.get(STEP_SPLIT_ENV) == "1":
                    extra = {**extra, "step_split": {k: v.as_dict() for k, v in self.step_split.parts.items()}}
                if self.ema is not None:
                    decay = self.ema.update(step)  # before this step's checkpoint, which holds the average
                    extra = extra if decay is None else {**extra, "ema_decay": decay}
                metrics.log(step, loss, lr, grad_norm, extra)
                # After the last step a stop changes nothing: the run finishes its export, as done.
                last = step == config.training.max_steps
                # A stop signal, and "Sample now" / "Save now" (output_dir/requests/), decided together.
                asked = between_steps(runtime, stop.requested, self.out, step)
                stopping = asked.stop and not last
                saving = stopping or asked.save or config.checkpointing.due(step) or last
                sampling = validator.due(step) or (asked.sample and validator.enabled)
                if runtime.is_main and asked.sample and not validator.enabled:
                    logger.warning("step %d: samples asked for, but the run has no validation.prompts", step)
                # One switch to the eval-mode weights for the checkpoint and the samples after it: a
                # run resumed from the checkpoint switches back from the same weights (schedule-free).
                if saving or sampling:
                    with eval_weights(self.optimizer):
                        if saving:
                            self.save(step)
                        if sampling:
                            self.run_validation(validator, step, metrics)
                            sampled = step
                result.interrupted = stopping
            self.checkpointer.wait()
            result.final_step = step
            if not result.interrupted:
                if validator.enabled and not validator.due(step) and sampled != step:
                    self.run_validation(validator, step, metrics)
                if ckpt.latest_checkpoint(self.checkpointer.folder) is not None:
                    result.exported = self.export(step)
        finally:
            metrics.close()
        return result


def train(config: TrainConfig, resume: bool = False) -> TrainResult:
    """Run (or, with ``resume``, continue) the training described by ``config``."""
    return Trainer(config, resume).train()
