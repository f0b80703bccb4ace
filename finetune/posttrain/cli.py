"""``krea2 posttrain CONFIG.yaml [--output-dir DIR] [--resume] [--dry-run] [key=value ...]``: DPO, GRPO,
DRaFT or TDM distillation (``method: dpo | grpo | draft | distill``) on the training engine.

Several processes: ``accelerate launch -m finetune.posttrain CONFIG.yaml`` (or ``torchrun``).
"""

from __future__ import annotations

import argparse

from ..cli import add_config_command, main as _main, run_config_command


def add_parser(subparsers) -> argparse.ArgumentParser:
    return add_config_command(
        subparsers, "posttrain",
        help="post-train (DPO, GRPO, DRaFT, TDM distillation) from a YAML config",
        description="Post-train Krea 2: method: dpo | grpo | draft | distill (see examples/posttrain_*_tiny.yaml).",
        dry_run=True,
    )


def run(args: argparse.Namespace) -> int:
    from ..trainer import NonFiniteLossError
    from .config import load_posttrain_config
    from .rewards import RewardError
    from .run import posttrain, posttrain_dry_run

    return run_config_command(args, "posttrain", load_posttrain_config, posttrain, (NonFiniteLossError, RewardError),
                              dry_run=posttrain_dry_run)


def main(argv=None) -> int:
    return _main(argv, add_parser, run, prog="python -m finetune.posttrain")
