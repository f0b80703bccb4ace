"""Run by tests/test_posttrain_distributed.py under torchrun (gloo, DDP): ``python -m finetune.posttrain
CONFIG`` as is, for each of several configs one after the other in the same processes (one launch, one
import of the heavy modules), with DDP's gradient all-reduces recorded for the configs named after
``--count``.

``python tests/posttrain_allreduce_worker.py [--count] CONFIG [[--count] CONFIG ...]``: each run is the CLI's
``main([CONFIG])``; the main process prints ``=== CONFIG exit CODE`` after each, and the worker stops at
the first run that fails (its exit code). A counted run's comm hook notes each bucket's index, then
calls DDP's default all-reduce (the gradients are unchanged); before each optimizer step the indices
of that step are appended to ``allreduce-<rank>.json`` beside that run's CONFIG. One all-reduce of the
gradients per optimizer step is: each bucket's index exactly once per step (DDP may split the gradients
into several buckets, each its own all-reduce call)."""

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


def install(record: Path):
    """Count the all-reduces of the runs started from now on into ``record``-<rank>.json; returns the
    function that puts the trainer back as it was."""
    setup, optimizer_step, steps = PosttrainTrainer.setup, PosttrainTrainer.optimizer_step, []
    BUCKETS.clear()

    def counted_setup(self):
        setup(self)
        self.model.register_comm_hook(None, counting_allreduce)  # before the first forward, as DDP requires

    def counted_optimizer_step(self):
        steps.append(sorted(BUCKETS))
        BUCKETS.clear()
        Path(f"{record}-{dist.get_rank()}.json").write_text(json.dumps(steps))
        return optimizer_step(self)

    PosttrainTrainer.setup, PosttrainTrainer.optimizer_step = counted_setup, counted_optimizer_step

    def uninstall():
        PosttrainTrainer.setup, PosttrainTrainer.optimizer_step = setup, optimizer_step

    return uninstall


def run_all(argv: list[str]) -> int:
    runs, count = [], False  # (config, counted), in the order given
    for arg in argv:
        if arg == "--count":
            count = True
        else:
            runs.append((arg, count))
            count = False
    for config, counted in runs:
        uninstall = install(Path(config).parent / "allreduce") if counted else None
        try:
            code = main([config])
        finally:
            if uninstall:
                uninstall()
        if os.environ.get("RANK", "0") == "0":
            print(f"=== {config} exit {code}", flush=True)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1:]))
