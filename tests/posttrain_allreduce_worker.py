"""Run by tests/test_posttrain_distributed.py under torchrun (gloo, DDP): ``python -m finetune.posttrain
CONFIG`` as is, with DDP's gradient all-reduces recorded. A comm hook notes each bucket's index, then
calls DDP's default all-reduce (the gradients are unchanged); before each optimizer step the indices
of that step are appended to ``PROBE_DIR/allreduce-<rank>.json``. One all-reduce of the gradients per
optimizer step is: each bucket's index exactly once per step (DDP may split the gradients into
several buckets, each its own all-reduce call)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from finetune.posttrain.cli import main
from finetune.posttrain.trainer import PosttrainTrainer

BUCKETS: list[int] = []  # bucket indices all-reduced since the last optimizer step


def counting_allreduce(state, bucket):
    BUCKETS.append(bucket.index())
    return allreduce_hook(state, bucket)


def record(steps: list[list[int]]) -> None:
    path = Path(os.environ["PROBE_DIR"]) / f"allreduce-{dist.get_rank()}.json"
    path.write_text(json.dumps(steps))


def install() -> None:
    setup, optimizer_step, steps = PosttrainTrainer.setup, PosttrainTrainer.optimizer_step, []

    def counted_setup(self):
        setup(self)
        self.model.register_comm_hook(None, counting_allreduce)  # before the first forward, as DDP requires

    def counted_optimizer_step(self):
        steps.append(sorted(BUCKETS))
        BUCKETS.clear()
        record(steps)
        return optimizer_step(self)

    PosttrainTrainer.setup, PosttrainTrainer.optimizer_step = counted_setup, counted_optimizer_step


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
