"""``krea2 train CONFIG.yaml [--output-dir DIR] [--resume] [--dry-run] [key=value ...]``: LoRA or full fine-tune.

Runs in one process, or in several under ``accelerate launch`` / ``torchrun`` (the same command
with ``python -m finetune``).
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune RAW (LoRA or full) from a YAML config",
        description="Fine-tune Krea 2 RAW from a YAML config (see examples/train_lora_tiny.yaml).",
    )
    parser.add_argument("config", help="YAML training config")
    parser.add_argument("--output-dir", help="run folder (overrides output_dir in the config)")
    parser.add_argument("--resume", action="store_true", help="continue the run in the output folder from its last checkpoint")
    parser.add_argument("--dry-run", action="store_true",
                        help="set the run up on the meta device and print the memory plan per process; trains nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. training.max_steps=500 optimizer.learning_rate=3e-4")
    return allow_intermixed(parser)


def allow_intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let options sit between the config and the overrides (`train cfg.yaml --resume k=v`):
    plain argparse stops collecting positionals at the first option. The intermixed parser calls
    parse_known_args itself, so the re-entrant call gets the original method."""
    original = parser.parse_known_args
    busy = []

    def parse_known_args(args=None, namespace=None):
        if busy:
            return original(args, namespace)
        busy.append(True)
        try:
            return parser.parse_known_intermixed_args(args, namespace)
        finally:
            busy.pop()

    parser.parse_known_args = parse_known_args
    return parser


def run(args: argparse.Namespace) -> int:
    from .config import load_config
    from .trainer import NonFiniteLossError, train

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    config = load_config(args.config, overrides)
    logging.getLogger("finetune").setLevel(logging.INFO)
    if getattr(args, "dry_run", False):
        from .dryrun import dry_run

        dry_run(config)
        return 0
    try:
        result = train(config, resume=args.resume)
    except NonFiniteLossError as err:  # not a usage error: its own exit code, no traceback
        print(f"krea2 train: {err}", file=sys.stderr)
        return 3
    if result.interrupted:
        print(f"stopped at step {result.final_step}; continue with --resume", file=sys.stderr)
        return 130
    for path in result.exported:
        print(path)
    return 0


def main(argv=None) -> int:
    """Standalone entry point (``python -m finetune``), for launchers that start a module."""
    parser = argparse.ArgumentParser(prog="python -m finetune")
    sub = parser.add_subparsers(dest="command")
    train_parser = add_parser(sub)
    train_parser.prog = "python -m finetune"
    args = train_parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .config import ConfigError
    from .data import DatasetError
    from .trainer import RunDirectoryError

    try:
        return run(args)
    except (ConfigError, DatasetError, RunDirectoryError) as err:
        print(f"krea2 train: error: {err}", file=sys.stderr)
        return 2
