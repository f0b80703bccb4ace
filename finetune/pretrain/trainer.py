"""The pretraining loop: stages over packs, on the training engine's runtime, sharding and DCP
checkpoints (:mod:`finetune.engine`).

Each stage is set up fresh (transformer built, fp8 conversion, activation checkpointing, FSDP2,
optimizers) and then restored from the latest checkpoint: a resume inside a stage and the move to
the next stage are the same code path. The last step of every stage is checkpointed, so the next
stage starts from its weights (and, with ``keep_optimizer_state``, its optimizer state).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.checkpoint import Checkpointer, clean_staging, latest_checkpoint, list_checkpoints, read_train_state
from ..config import ConfigError
from ..engine.parallel import fully_shard_blocks, prepare_blocks
from ..metrics import MetricsLogger, check_wandb
from ..optimization.objective import add_noise, flow_matching_loss
from ..optimization.optim import lr_multiplier
from ..rundir import RunDirectoryError, config_changes, config_fingerprint
from ..stop import StopRequest
from ..trainer import NonFiniteLossError
from . import repa as repa_mod
from .architecture import build_meta_transformer, check_fp8_available, convert_to_fp8_, materialize_, transformer_config
from .batches import StageBatches, StepData, open_stage_pack
from .config import PretrainConfig
from .optimizers import make_optimizers, set_learning_rate
from .pma import BackgroundPMA
from .runtime import PretrainRuntime, make_runtime, model_only_load

logger = logging.getLogger("finetune")

RUN_FILE = "run.json"
# Settings that may change between a run and its resumption (they do not change the maths).
RESUMABLE = ("output_dir", "checkpointing", "logging", "pma", "training.num_workers")


@dataclass
class PretrainResult:
    output_dir: Path
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    interrupted: bool = False


def fingerprint(config: PretrainConfig) -> dict:
    return config_fingerprint(config, RESUMABLE)


def run_world_size(out: Path, default: int) -> int:
    """W of the run in ``out`` (fixes the global batch), or ``default`` for a new run."""
    run_file = out / RUN_FILE
    return json.loads(run_file.read_text())["world_size"] if run_file.exists() else default


class Pretrainer:
    def __init__(self, config: PretrainConfig, resume: bool = False):
        self.config = config
        self.resume = resume
        self.out = Path(config.output_dir)
        self.runtime: PretrainRuntime = make_runtime(config.training.mixed_precision)
        self.ckpt_dir = self.out / "checkpoints"
        self.pma_writer = BackgroundPMA()
        check_wandb(config.logging.wandb)  # before any model loads

    # ------------------------------------------------------------------ checks before any model loads
    def _check_run_dir(self) -> None:
        run_file = self.out / RUN_FILE
        if not self.resume:
            if run_file.exists() or self.ckpt_dir.exists():
                raise RunDirectoryError(f"{self.out} already holds a run; pass --resume to continue it, or choose another --output-dir")
            return
        if run_file.exists():
            changes = config_changes(json.loads(run_file.read_text())["fingerprint"], fingerprint(self.config))
            if changes:
                raise RunDirectoryError(f"--resume: the config differs from the run in {self.out}: " + "; ".join(changes[:5]))

    def prepare(self) -> None:
        config, runtime = self.config, self.runtime
        self._check_run_dir()
        check_fp8_available(config.stages, runtime.device)
        self.world = run_world_size(self.out, runtime.world_size)
        self.stage_batches = [StageBatches(s, open_stage_pack(s), self.world, config.training.seed) for s in config.stages]
        runtime.barrier()
        if runtime.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if not (self.out / RUN_FILE).exists():
                run = {"fingerprint": fingerprint(config), "config": config.to_dict(), "world_size": self.world}
                (self.out / RUN_FILE).write_text(json.dumps(run, indent=2))
            clean_staging(self.ckpt_dir)
        runtime.barrier()
        self.checkpointer = Checkpointer(self.ckpt_dir, runtime, config.checkpointing.keep_last)
        self._load_encoders()

    def _load_encoders(self) -> None:
        from ..components import load_text_encoder, load_vae
        from ..packs.text_features import FEATURE_COLUMNS

        device, dtype = self.runtime.device, self.runtime.encoder_dtype
        self.vae = load_vae(self.config.model.vae, dtype, device)
        needs_text = any(FEATURE_COLUMNS["caption_long"] not in b.reader.columns for b in self.stage_batches)
        self.text_encoder = load_text_encoder(self.config.model.text_encoder, dtype, device) if needs_text else None

    # ------------------------------------------------------------------ one stage's model
    def setup_stage(self, index: int) -> None:
        """meta build -> (REPA projector) -> fp8 -> activation checkpointing -> compile -> FSDP2 per
        block then root -> ``to_empty`` + init or own rows of the weights -> restore the checkpoint."""
        config, runtime = self.config, self.runtime
        stage = config.stages[index]
        transformer = build_meta_transformer(config.model)
        self.vision = None
        if stage.repa is not None:
            if stage.repa.block >= len(transformer.transformer_blocks):
                raise ConfigError(f"stage {stage.name!r}: repa.block {stage.repa.block} but the model has "
                                  f"{len(transformer.transformer_blocks)} blocks")
            self.vision = repa_mod.VisionTarget(stage.repa.encoder, runtime.device, runtime.encoder_dtype)
            dim = transformer.config.attention_head_dim * transformer.config.num_attention_heads
            with torch.device("meta"):
                transformer.add_module(repa_mod.PROJECTOR_NAME, repa_mod.make_projector(dim, self.vision.dim))
        if stage.precision == "fp8":
            convert_to_fp8_(transformer, stage.fp8_scaling)
        blocks = list(transformer.transformer_blocks)
        prepare_blocks(blocks, stage.activation_checkpointing, config.training.compile)
        if runtime.world_size > 1:
            if stage.repa is not None:  # called outside the root's forward: its own FSDP unit
                from torch.distributed.fsdp import fully_shard

                fully_shard(getattr(transformer, repa_mod.PROJECTOR_NAME), mp_policy=runtime.mp_policy())
            fully_shard_blocks(transformer, blocks, runtime.mixed_precision)
        materialize_(transformer, config.model, config.training.seed, runtime.device)
        if stage.repa is not None:
            torch.manual_seed(config.training.seed + 1)
            getattr(transformer, repa_mod.PROJECTOR_NAME).reset_parameters()
        self.model = transformer.train()
        self.blocks = blocks
        self.optimizers, split = make_optimizers(transformer, config.optimizer)
        if runtime.is_main:  # printed, not logged: the split must be visible whatever the log level
            print(f"[krea2 pretrain] stage {stage.name}: {split.describe()}", flush=True)
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        self._restore(index)

    def _restore(self, index: int) -> None:
        latest = latest_checkpoint(self.ckpt_dir)
        if latest is None:
            return
        state = read_train_state(latest)
        stage = self.config.stages[index]
        same_stage = state.get("stage") == stage.name
        if same_stage or stage.keep_optimizer_state:
            self.checkpointer.load(latest, self.model, self.optimizers, trainable_only=False,
                                   expected={"fingerprint": fingerprint(self.config)})
        else:
            model_only_load(latest, self.model)

    # ------------------------------------------------------------------ one step
    def _text(self, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.runtime.device
        if micro["text_features"] is not None:
            from krea2_diffusers.conditioning.text import pad_conditioning

            feats = micro["text_features"]
            embeds, masks = pad_conditioning([f[None] for f in feats], [torch.ones(1, f.shape[0], dtype=torch.bool) for f in feats])
            return embeds.to(device, torch.float32), masks.to(device)
        return self.text_encoder.encode(micro["captions"], self.config.model.max_sequence_length, device)

    def train_step(self, item: dict) -> dict:
        from krea2_diffusers.latents import encode_images, pack_latents, position_ids

        runtime, config = self.runtime, self.config
        stage = config.stages[item["stage"]]
        repa_on = item["repa"] and self.vision is not None
        local_ok = sum(int(m["valid"].sum()) for m in item["micro"])
        global_ok = runtime.sum(float(local_ok))
        failures = runtime.sum(float(item["failures"]))
        total_loss = total_repa = 0.0
        scale = runtime.world_size / max(global_ok, 1.0)  # FSDP averages gradients over processes
        for number, micro in enumerate(item["micro"]):
            if runtime.world_size > 1:
                self.model.set_requires_gradient_sync(number == len(item["micro"]) - 1)
            pixels = micro["pixels"].to(runtime.device)
            with torch.no_grad():
                latents = encode_images(self.vae, pixels).float()  # one VAE call per one-bucket batch
            x0 = pack_latents(latents)
            noise, t = micro["noise"].to(runtime.device), micro["t"].to(runtime.device)
            embeds, mask = self._text(micro)
            gh, gw = latents.shape[2] // 2, latents.shape[3] // 2
            positions = position_ids(embeds.shape[1], gh, gw, device=runtime.device)
            noisy = add_noise(x0, noise, t)
            capture = repa_mod.capture_block_output(self.blocks[stage.repa.block]) if repa_on else contextlib.nullcontext()
            with runtime.autocast(), capture as box:
                pred = self.model(hidden_states=noisy, encoder_hidden_states=embeds, timestep=t, position_ids=positions,
                                  encoder_attention_mask=mask, return_dict=False)[0]
            valid = micro["valid"].to(runtime.device)
            count = int(valid.sum())
            # Rows that failed to decode ran as stand-ins; only the others count. `pred.sum() * 0`
            # keeps the graph (and FSDP's gradient hooks) whole when none is left.
            loss = (flow_matching_loss(pred[valid], x0[valid], noise[valid], t[valid], config.objective.loss_weighting) * count
                    if count else pred.sum() * 0.0)
            objective = loss
            if repa_on:
                rows = valid if count else torch.ones_like(valid)  # (the projector runs on every process)
                target = self.vision.features(pixels[rows], (gh, gw))
                tokens = box[0][rows, embeds.shape[1]:embeds.shape[1] + x0.shape[1]]
                projector = getattr(self.model, repa_mod.PROJECTOR_NAME)
                repa_loss = repa_mod.alignment_loss(tokens, (gh, gw), projector, target) * count
                objective = loss + stage.repa.weight * repa_loss
                total_repa += float(repa_loss.detach())
            (objective * scale).backward()
            total_loss += float(loss.detach())
        mean_loss = runtime.sum(total_loss) / max(global_ok, 1.0)
        if not math.isfinite(mean_loss):
            raise NonFiniteLossError(f"loss is {mean_loss} at step {item['step']} (stage {stage.name}); replay its rows "
                                     f"with --replay {item['step']}; the last good checkpoint is kept in {self.ckpt_dir}")
        max_norm = config.optimizer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        row = {"stage": stage.name, "loss": mean_loss, "grad_norm": float(grad_norm), "samples": global_ok,
               "decode_failures": failures}
        if repa_on:
            row["repa_loss"] = runtime.sum(total_repa) / max(global_ok, 1.0)
        return row

    # ------------------------------------------------------------------ the loop
    def step_loader(self, start_step: int, stop_step: int):
        """The loader of the set-up stage's steps ``start_step + 1 .. stop_step``, one item a step
        (what ``train_step`` takes)."""
        data = StepData(self.config, self.stage_batches, self.runtime.rank, self.runtime.world_size)
        workers = self.config.training.num_workers
        return torch.utils.data.DataLoader(
            data, sampler=range(start_step + 1, stop_step + 1), batch_size=None, num_workers=workers,
            pin_memory=self.runtime.device.type == "cuda", prefetch_factor=2 if workers else None,
            persistent_workers=False,
        )

    def save(self, step: int, stage_name: str) -> None:
        """Checkpoint; then, when due, start the PMA average on the main process in the background
        (it reads finished checkpoints from disk while training goes on; the next save waits for
        it first, so pruning never deletes a checkpoint it is reading)."""
        self.pma_writer.wait()
        self.checkpointer.save(step, self.model, self.optimizers, trainable_only=False,
                               train_state={"stage": stage_name, "fingerprint": fingerprint(self.config),
                                            # what `krea2 export` reads: a pretraining checkpoint is full weights
                                            "method": "full", "base_model": self.config.model.init,
                                            "transformer_config": json.loads(json.dumps(transformer_config(self.config.model)))})
        self.checkpointer.wait()
        pma = self.config.pma
        if pma.every_n_steps and step % pma.every_n_steps == 0 and self.runtime.is_main:
            self.pma_writer.start(list_checkpoints(self.ckpt_dir), self.out, step, pma.num_checkpoints)

    def train(self) -> PretrainResult:
        # Signals are caught from the start (the command's entry point caught them earlier still):
        # a stop asked for while the run prepares ends it before its first step.
        with StopRequest() as stop:
            return self._train(stop)

    def _train(self, stop: StopRequest) -> PretrainResult:
        config, runtime = self.config, self.runtime
        self.prepare()
        latest = latest_checkpoint(self.ckpt_dir) if self.resume else None
        step = read_train_state(latest)["step"] if latest is not None else 0
        result = PretrainResult(self.out, step)
        total = config.total_steps
        metrics = MetricsLogger(self.out, runtime.is_main, step, total, config.logging.tensorboard,
                                config.logging.progress_bar, config.logging.log_every_n_steps,
                                wandb=config.logging.wandb, run_config=config.to_dict())
        try:
            # Stopped while preparing: no step ran, there is nothing new to save.
            result.interrupted = step < total and runtime.any(stop.requested)
            while not result.interrupted and step < total:
                index, _ = config.stage_at(step + 1)
                stage = config.stages[index]
                stage_end = config.stage_start(index) + stage.steps
                self.setup_stage(index)
                last = time.perf_counter()
                for item in self.step_loader(step, stage_end):
                    k = item["k"]
                    lr = set_learning_rate(self.optimizers, lr_multiplier(k, stage.lr_scheduler, stage.steps))
                    row = self.train_step(item)
                    step += 1
                    now = time.perf_counter()
                    row["samples_per_s"] = row.pop("samples") / (now - last)
                    last = now
                    result.losses[step] = row["loss"]
                    metrics.log(step, row.pop("loss"), lr, row.pop("grad_norm"), extra=row)
                    # After the last step a stop changes nothing: the run ends as done.
                    stopping = runtime.any(stop.requested) and step < total
                    if stopping or config.checkpointing.due(step) or step == stage_end:
                        self.save(step, stage.name)
                    if stopping:
                        result.interrupted = True
                        break
            result.final_step = step
        finally:
            metrics.close()
            self.pma_writer.wait()
        return result


def pretrain(config: PretrainConfig, resume: bool = False) -> PretrainResult:
    return Pretrainer(config, resume).train()
