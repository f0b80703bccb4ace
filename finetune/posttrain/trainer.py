"""What the three post-training methods share, on top of the training engine.

:class:`PosttrainTrainer` is a :class:`finetune.trainer.Trainer`: the loop, signals, DCP
checkpoints (``--resume``, on any number of processes), ``metrics.jsonl`` and the exports streamed
from the last checkpoint are the engine's. A method supplies its inputs (pairs or prompts, checked
before any model loads), optionally what it trains, and one optimizer step.

A full fine-tune here loads the transformer whole (the reference / teacher is a frozen copy of
it) instead of the engine's sharded-from-meta build.
"""

from __future__ import annotations

import itertools
import logging

import torch

from ..engine.loader import step_generator, step_layout
from ..engine.parallel import wrap_model
from ..methods import add_lora, prepare_full_finetune, quantize_base, trainable_parameter_count
from ..optim import make_lr_scheduler, make_optimizer
from ..rundir import check_output_dir
from ..trainer import Trainer
from .config import PosttrainConfig
from .reference import Reference

logger = logging.getLogger("finetune")


class PosttrainTrainer(Trainer):
    config: PosttrainConfig

    # ---------------------------------------------------------------- hooks
    def prepare_inputs(self) -> None:
        """Read and check the method's inputs; runs before any model loads."""

    def encode_inputs(self) -> None:
        """Encode what needs the text encoder / VAE (the pipeline is loaded)."""

    def trainable_module(self, transformer: torch.nn.Module) -> torch.nn.Module:
        """Attach LoRA adapters or prepare every weight; returns the module the engine trains."""
        if self.lora:
            compute = torch.float32 if self.config.model.dtype == "float32" else torch.bfloat16
            quantize_base(transformer, self.config.model.quantize, compute)
            add_lora(transformer, self.config.lora)
        else:
            prepare_full_finetune(transformer)
        return transformer

    def param_groups(self) -> list:
        return self.params

    def trained_blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks the engine checkpoints / compiles / shards one by one."""
        return list(module.transformer_blocks)

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        config, runtime = self.config, self.runtime
        check_output_dir(self.out, config, self.resume)
        self.prepare_inputs()
        self.global_batch = self._global_batch()
        self.layout = step_layout(self.global_batch, runtime.rank, runtime.world_size)
        runtime.barrier()
        self.record_run()

        from ..model import load_pipeline

        self.pipe = load_pipeline(config.model, runtime.device)
        self.encode_inputs()
        if runtime.device.type == "cuda":  # every prompt is encoded: the text encoder leaves the GPU
            self.pipe.text_encoder.to("cpu")
            torch.cuda.empty_cache()
        transformer = self.pipe.transformer
        torch.manual_seed(config.training.seed)
        self.reference = Reference(transformer, lora=self.lora)
        if not self.lora:
            self.reference.copy.to(runtime.device)
        module = self.trainable_module(transformer)
        module.train()
        t = config.training
        self.model = wrap_model(module, self.trained_blocks(module), runtime, activation_checkpointing=t.activation_checkpointing,
                                compile=t.compile, mixed_precision=t.mixed_precision, offloaded_blocks=t.offload_blocks)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.param_groups(), config.optimizer)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.max_steps)
        self.start_step = self._restore() if self.resume else 0
        if runtime.is_main:
            logger.info("%s: training %d parameters, %d process(es)", config.method,
                        trainable_parameter_count(module), runtime.world_size)

    def _loader(self):
        """Post-training methods make their own inputs each step (rollouts, pairs from the cache)."""
        return itertools.repeat(None)

    # ---------------------------------------------------------------- shared pieces
    def generator(self, index: int | str) -> torch.Generator:
        """Noise of step/micro-batch ``index`` (or a named stream): the same after a resume."""
        return step_generator(self.config.training.seed, index)

    def optimizer_step(self) -> float:
        """Clip, step the optimizer and the schedule, clear gradients; returns the gradient norm."""
        max_norm = self.config.optimizer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def eval_due(self, step: int, every: int) -> bool:
        """``step`` is 0-based; evaluation runs after optimizer steps ``every``, ``2 every`` ... and the last."""
        done = step + 1
        return every > 0 and (done % every == 0 or done == self.config.training.max_steps)
