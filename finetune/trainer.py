"""The training loop. Everything it calls lives in a module named after what it does."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .buckets import BucketBatches
from .cache import build_cache
from .config import TrainConfig
from .encoding import pack_latents, position_ids
from .methods import add_lora, prepare_full_finetune, trainable_parameter_count
from .metrics import MetricsLogger
from .objective import add_noise, flow_matching_loss, sample_timesteps
from .optim import make_lr_scheduler, make_optimizer
from .parallel import (full_state_dict, load_full_state_dict, load_optimizer_state, no_sync, optimizer_state,
                       setup_runtime, unwrap, wrap_model)
from .rundir import RunDirectoryError, check_output_dir, config_fingerprint
from .samples import prepare_samples

__all__ = ["NonFiniteLossError", "RunDirectoryError", "TrainResult", "Trainer", "check_output_dir", "prepare_samples", "train"]

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


class _StopRequest:
    """SIGTERM / SIGINT ask for a checkpoint and a clean exit after the current step; a second
    SIGINT aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("signal %s: saving a checkpoint after this step, then stopping", signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _step_generator(seed: int, index: int) -> torch.Generator:
    """Noise, timesteps and caption dropout of micro-batch ``index`` come from here: identical for
    every process count and after a resume."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class Trainer:
    def __init__(self, config: TrainConfig, resume: bool = False):
        self.config = config
        self.resume = resume
        self.runtime = setup_runtime(config)
        self.out = Path(config.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        # Further scalars of the last step for metrics.jsonl (post-training's rewards, margins ...).
        self.extra_metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        config, runtime = self.config, self.runtime
        check_output_dir(self.out, config, self.resume)
        self.samples, self.buckets, _ = prepare_samples(config, self.out, runtime)
        runtime.barrier()
        self.record_run()

        from .model import load_pipeline

        self.pipe = load_pipeline(config.model.pretrained_model_name_or_path, config.model.dtype, runtime.device)
        self.cache = build_cache(
            self.pipe, self.samples, self.buckets, config.data.cache_dir or self.out / "cache",
            config.model.max_sequence_length, runtime.device, runtime.rank, runtime.world_size, runtime.barrier,
        )
        if runtime.device.type == "cuda":
            # Everything is cached: the 4B text encoder only comes back for validation prompts.
            self.pipe.text_encoder.to("cpu")
            torch.cuda.empty_cache()
        transformer = self.pipe.transformer
        torch.manual_seed(config.training.seed)  # LoRA A init: same on every process
        if config.training.method == "lora":
            add_lora(transformer, config.lora)
        else:
            prepare_full_finetune(transformer)
        transformer.train()
        self.model = wrap_model(transformer, config, runtime)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, config.optimizer)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.max_steps)
        global_batch = config.training.batch_size * runtime.world_size
        self.batches = BucketBatches(self.buckets, global_batch, seed=config.training.seed, shuffle=config.data.shuffle)
        self.start_step = self._restore() if self.resume else 0
        if runtime.is_main:
            logger.info("training %d parameters on %d samples, %d process(es), strategy %s",
                        trainable_parameter_count(transformer), len(self.samples), runtime.world_size, runtime.strategy)

    def record_run(self) -> None:
        """Main process: the run folder, ``run.json`` (on the first start) and no stale staging folders."""
        if not self.runtime.is_main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        run = {"fingerprint": config_fingerprint(self.config), "config": self.config.to_dict(),
               "world_size": self.runtime.world_size}
        if not (self.out / "run.json").exists():
            (self.out / "run.json").write_text(json.dumps(run, indent=2))
        ckpt.clean_staging(self.ckpt_dir)

    def _restore(self) -> int:
        latest = ckpt.latest_checkpoint(self.ckpt_dir)
        if latest is None:
            if (self.out / "run.json").exists() and self.runtime.is_main:
                logger.warning("--resume: no checkpoint in %s yet, starting from step 0", self.ckpt_dir)
            return 0
        model_state, optim_state, state = ckpt.load_checkpoint(latest)
        load_full_state_dict(self.model, model_state, self.runtime)
        load_optimizer_state(self.model, self.optimizer, optim_state, self.runtime)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        ckpt.load_rng(latest, self.runtime.rank)
        return int(state["step"])

    # ---------------------------------------------------------------- one step
    def _micro_batch(self, index: int):
        config, runtime = self.config, self.runtime
        local = self.batches.local_batch(index, runtime.rank, runtime.world_size)
        global_ids = self.batches.global_batch(index)
        latents = self.cache.latents(local)  # (B, 16, h, w)
        _, _, h, w = latents.shape
        x0 = pack_latents(latents)  # (B, N, 64)
        generator = _step_generator(config.training.seed, index)
        n_global, tokens, features = len(global_ids), x0.shape[1], x0.shape[2]
        noise = torch.randn((n_global, tokens, features), generator=generator)
        t = sample_timesteps(n_global, tokens, config.objective, generator)
        drop = (torch.rand(n_global, generator=generator) < config.data.caption_dropout).tolist()
        mine = slice(runtime.rank * len(local), (runtime.rank + 1) * len(local))
        embeds, mask = self.cache.text(local, drop[mine])
        device = runtime.device
        return dict(
            x0=x0.to(device), noise=noise[mine].to(device), t=t[mine].to(device),
            embeds=embeds.to(device), mask=mask.to(device),
            positions=position_ids(embeds.shape[1], h // 2, w // 2, device), ids=global_ids,
        )

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step (``gradient_accumulation_steps`` micro-batches); returns (loss, grad norm)."""
        config, runtime = self.config, self.runtime
        accumulation = config.training.gradient_accumulation_steps
        total = 0.0
        for micro in range(accumulation):
            batch = self._micro_batch(step * accumulation + micro)
            noisy = add_noise(batch["x0"], batch["noise"], batch["t"])
            with runtime.autocast():
                pred = self.model(
                    hidden_states=noisy, encoder_hidden_states=batch["embeds"], timestep=batch["t"],
                    position_ids=batch["positions"], encoder_attention_mask=batch["mask"], return_dict=False,
                )[0]
            loss = flow_matching_loss(pred, batch["x0"], batch["noise"], batch["t"], config.objective.loss_weighting)
            mean_loss = float(runtime.mean(loss))
            if not math.isfinite(mean_loss):
                names = [self.samples[i].image_path.name for i in batch["ids"]]
                raise NonFiniteLossError(
                    f"loss is {mean_loss} at step {step + 1} (micro-batch {micro}) on images {names}; "
                    f"stopped without saving, the last good checkpoint is kept in {self.ckpt_dir}"
                )
            with no_sync(self.model, runtime, sync=micro == accumulation - 1):
                (loss / accumulation).backward()
            total += mean_loss / accumulation
        max_norm = config.optimizer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, float(grad_norm)

    # ---------------------------------------------------------------- checkpoints and export
    def save(self, step: int) -> None:
        runtime = self.runtime
        lora = self.config.training.method == "lora"
        model_state = full_state_dict(self.model, runtime, trainable_only=lora)
        optim_state = optimizer_state(self.model, self.optimizer, runtime)
        tmp = ckpt.staging_dir(self.ckpt_dir, step)
        if runtime.is_main:
            ckpt.clean_staging(self.ckpt_dir)
            tmp.mkdir(parents=True)
        runtime.barrier()
        ckpt.write_rng(tmp, runtime.rank)
        if runtime.is_main:
            state = {"step": step, "lr_scheduler": self.lr_scheduler.state_dict(), "world_size": runtime.world_size}
            ckpt.write_main(tmp, model_state, optim_state, state)
        runtime.barrier()
        if runtime.is_main:
            ckpt.publish(tmp, step, self.config.checkpointing.keep_last)
        runtime.barrier()

    def export(self, step: int) -> list[Path]:
        from .export import export_full, export_lora

        lora = self.config.training.method == "lora"
        state = full_state_dict(self.model, self.runtime, trainable_only=lora)
        if not self.runtime.is_main:
            return []
        if lora:
            return export_lora(state, self.config, self.out, step)
        return export_full(state, dict(unwrap(self.model).config), self.config, self.out, step)

    def lora_layers(self):
        from krea2_diffusers.lora import lora_layers_from_diffusers_state_dict

        state = full_state_dict(self.model, self.runtime, trainable_only=True)
        return lora_layers_from_diffusers_state_dict(state, self.config.lora.alpha, self.config.lora.rank)

    # ---------------------------------------------------------------- the loop
    def train(self) -> TrainResult:
        config, runtime = self.config, self.runtime
        self.setup()
        from .validation import Validator

        validator = Validator(config, self.pipe, runtime, self.out)
        metrics = MetricsLogger(self.out, runtime.is_main, self.start_step, config.training.max_steps,
                                config.logging.tensorboard, config.logging.progress_bar, config.logging.log_every_n_steps)
        result = TrainResult(self.out, self.start_step)
        lora = config.training.method == "lora"
        every = config.checkpointing.every_n_steps
        step = self.start_step
        try:
            with _StopRequest() as stop:
                while step < config.training.max_steps:
                    loss, grad_norm = self.train_step(step)
                    step += 1
                    result.losses[step] = loss
                    metrics.log(step, loss, self.lr_scheduler.get_last_lr()[0], grad_norm, self.extra_metrics)
                    stopping = runtime.any(stop.requested)
                    if stopping or (every > 0 and step % every == 0) or step == config.training.max_steps:
                        self.save(step)
                    if validator.due(step):
                        validator.run(self.model, step, metrics, self.lora_layers() if lora else None)
                    if stopping:
                        result.interrupted = True
                        break
            result.final_step = step
            if not result.interrupted:
                if validator.enabled and not validator.due(step):
                    validator.run(self.model, step, metrics, self.lora_layers() if lora else None)
                result.exported = self.export(step)
        finally:
            metrics.close()
        return result


def train(config: TrainConfig, resume: bool = False) -> TrainResult:
    """Run (or, with ``resume``, continue) the training described by ``config``."""
    return Trainer(config, resume).train()
