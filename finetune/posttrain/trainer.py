"""What the three post-training methods share, on top of the training engine.

:class:`PosttrainTrainer` is a :class:`finetune.trainer.Trainer`: the loop, signals, DCP
checkpoints (``--resume``, on any number of processes), ``metrics.jsonl`` and the exports streamed
from the last checkpoint are the engine's. A method supplies its inputs (pairs or prompts, checked
before any model loads), optionally what it trains, and one optimizer step.

A full fine-tune builds what it trains and its frozen reference / teacher with the engine's
sharded-from-meta build (:func:`finetune.model.build_sharded_transformer`): on several processes
no rank ever holds a whole copy. LoRA loads the base once; the reference is that base with the
adapters switched off.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable

import torch

from ..dryrun import ModelCopies
from ..engine.loader import step_generator, step_layout
from ..engine.parallel import unwrap, wrap_model
from ..methods import add_lora, quantize_base, trainable_parameter_count
from ..optimization.optim import make_lr_scheduler, make_optimizer
from ..rundir import check_output_dir
from ..trainer import Trainer
from .config import PosttrainConfig
from .reference import Reference

logger = logging.getLogger("finetune")


class PosttrainTrainer(Trainer):
    config: PosttrainConfig
    # LoRA on several processes: True where a backward reaches only some adapters (DDP must not wait for the rest).
    partial_backward = False

    # ---------------------------------------------------------------- hooks
    @classmethod
    def model_copies(cls, config: PosttrainConfig, forward_batch: int | None = None,
                     image_size: tuple[int, int] | None = None) -> ModelCopies:
        """What one process holds, for ``--dry-run``: the trained model and, full, the frozen
        reference (LoRA: the base with the adapter off). ``forward_batch`` / ``image_size``: the
        method's largest forward with gradients (default: ``training.batch_size`` squares of the
        method's ``resolution``)."""
        size = config.section.resolution
        full = config.training.method == "full"
        what = f"{config.method}: model trained, reference frozen" if full else f"{config.method}: reference = base, adapter off"
        return ModelCopies(frozen=int(full), forward_batch=forward_batch, image_size=image_size or (size, size), what=what)

    def prepare_inputs(self) -> None:
        """Read and check the method's inputs; runs before any model loads."""

    def encode_inputs(self) -> None:
        """Encode what needs the text encoder / VAE (the pipeline is loaded)."""

    def encode_prompts(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each prompt's (embeds (1, L, D), mask (1, L)) on the CPU, encoded once: the text encoder
        can leave the GPU afterwards."""
        device, length = self.runtime.device, self.config.model.max_sequence_length
        encoded = []
        for prompt in prompts:
            embeds, mask = self.pipe.encode_prompt(prompt, device=device, max_sequence_length=length)
            encoded.append((embeds.cpu(), mask.cpu()))
        return encoded

    def trainable_module(self, transformer: torch.nn.Module) -> torch.nn.Module:
        """LoRA: attach the adapters to the loaded base; returns the module the engine trains."""
        compute = torch.float32 if self.config.model.dtype == "float32" else torch.bfloat16
        quantize_base(transformer, self.config.model.quantize, compute)
        add_lora(transformer, self.config.lora)
        return transformer

    def assemble_full(self, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Full: the trained root from a factory of meta-device transformers (default: one)."""
        return make()

    def sampling_transformer(self, module: torch.nn.Module) -> torch.nn.Module:
        """The transformer the pipeline samples with (validation) out of the full trained root."""
        return module

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

        # A full run builds its transformers sharded below; the pipeline only brings the encoders.
        self.pipe = load_pipeline(config.model, runtime.device, **({} if self.lora else {"transformer": None}))
        self.encode_inputs()
        if runtime.device.type == "cuda":  # every prompt is encoded: the text encoder leaves the GPU
            self.pipe.text_encoder.to("cpu")
            torch.cuda.empty_cache()
        torch.manual_seed(config.training.seed)  # LoRA A init: the same on every process
        self.build_models()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.param_groups(), config.optimizer)
        self.lr_scheduler = make_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.max_steps)
        self.start_step = self._restore() if self.resume else 0
        if runtime.is_main:
            logger.info("%s: training %d parameters, %d process(es)", config.method,
                        trainable_parameter_count(unwrap(self.model)), runtime.world_size)

    def build_models(self) -> None:
        """``self.model`` (wrapped for training) and ``self.reference``.

        LoRA: adapters on the loaded base, DDP on several processes. Full: the trained root and
        the frozen reference each built from the meta device and sharded (FSDP2) before any
        weight is read, every rank reading only its own rows.
        """
        config, runtime, t = self.config, self.runtime, self.config.training
        if self.lora:
            self.reference = Reference(runtime.autocast)
            module = self.trainable_module(self.pipe.transformer)
            module.train()
            self.model = wrap_model(module, self.trained_blocks(module), runtime, activation_checkpointing=t.activation_checkpointing,
                                    compile=t.compile, mixed_precision=runtime.mixed_precision, offloaded_blocks=t.offload_blocks,
                                    find_unused_parameters=self.partial_backward)
            return
        from ..model import build_sharded_transformer

        self.reference = Reference(runtime.autocast, build_sharded_transformer(config, runtime, trainable=False))
        self.model = build_sharded_transformer(config, runtime, assemble=self.assemble_full)
        self.pipe.register_modules(transformer=self.sampling_transformer(self.model))

    def step_inputs(self):
        """GRPO and distillation make their own inputs each step (rollouts, prompts); DPO overrides this."""
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
