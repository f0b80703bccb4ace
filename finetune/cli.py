"""``krea2 train CONFIG.yaml [--output-dir DIR] [--resume] [--dry-run] [key=value ...]``: LoRA or full fine-tune.

Runs in one process, or in several under ``accelerate launch`` / ``torchrun`` (the same command
with ``python -m finetune``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .stop import STOPPED_CODE, StopRequest


def add_parser(subparsers) -> argparse.ArgumentParser:
    return add_config_command(
        subparsers, "train",
        help="fine-tune RAW (LoRA or full) from a YAML config",
        description="Fine-tune Krea 2 RAW from a YAML config (see examples/train_lora_tiny.yaml).",
        dry_run=True,
    )


def add_config_command(subparsers, name: str, help: str, description: str, dry_run: bool = False) -> argparse.ArgumentParser:
    """``NAME CONFIG.yaml [--output-dir DIR] [--resume] [--dry-run] [key=value ...]`` (train and posttrain)."""
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.add_argument("config", help="YAML training config")
    parser.add_argument("--output-dir", help="run folder (overrides output_dir in the config)")
    parser.add_argument("--resume", action="store_true", help="continue the run in the output folder from its last checkpoint")
    if dry_run:
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

    return run_config_command(args, "train", load_config, train, (NonFiniteLossError,))


def run_config_command(args: argparse.Namespace, name: str, load, train_fn, stop_errors: tuple, dry_run=None) -> int:
    """Load the config (with overrides), train, report; ``stop_errors`` end the run with exit code 3
    (a problem found while training, the last checkpoint kept) instead of a traceback; a stop
    (SIGTERM / SIGINT, in any phase: :mod:`finetune.stop`) ends it with 130 before the last step, 0 after.
    ``dry_run(config)``: what ``--dry-run`` prints (default: train's plan, :func:`finetune.dryrun.dry_run`)."""
    with StopRequest() as stop:  # first thing: from here on a stop is a stop, never a kill
        return _run_config_command(args, name, load, train_fn, stop_errors, dry_run, stop)


def _run_config_command(args, name, load, train_fn, stop_errors, dry_run, stop: StopRequest) -> int:
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    config = load(args.config, overrides)
    logging.getLogger("finetune").setLevel(logging.INFO)
    if getattr(args, "dry_run", False):
        if dry_run is None:
            from .dryrun import dry_run
        dry_run(config)
        return 0
    if stop.requested:  # while the command started: nothing was trained, nothing to save
        print("stopped before training started", file=sys.stderr)
        return STOPPED_CODE
    from krea2_diffusers.cpu_threads import choose_cpu_threads
    from krea2_diffusers.heap import hold_freed_chunks

    hold_freed_chunks()
    choose_cpu_threads(*filter(None, (config.model.pretrained_model_name_or_path, config.model.turbo_model_name_or_path)))
    try:
        result = train_fn(config, resume=args.resume)
    except stop_errors as err:  # not a usage error: its own exit code, no traceback
        print(f"krea2 {name}: {err}", file=sys.stderr)
        return 3
    if result.interrupted:
        print(f"stopped at step {result.final_step}; continue with --resume", file=sys.stderr)
        return STOPPED_CODE
    for path in result.exported:
        print(path)
    return 0


def main(argv=None, add=None, run_command=None, prog: str = "python -m finetune") -> int:
    """Standalone entry point (``python -m finetune``), for launchers that start a module."""
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command")
    command_parser = (add or add_parser)(sub)
    command_parser.prog = prog
    args = command_parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .config import ConfigError
    from .data import DatasetError
    from .trainer import RunDirectoryError

    try:
        return (run_command or run)(args)
    except (ConfigError, DatasetError, RunDirectoryError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
