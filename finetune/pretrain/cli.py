"""``krea2 pretrain CONFIG.yaml [--output-dir DIR] [--resume] [--dry-run] [--replay STEP] [key=value ...]``.

One process, or several under ``torchrun`` / ``accelerate launch`` with ``python -m finetune.pretrain``
(the same arguments).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..cli import allow_intermixed
from ..stop import STOPPED_CODE, StopRequest


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pretrain",
        help="pretrain a Krea 2 transformer from scratch (or continue) over krea2-pack-v1 stages",
        description="Krea 2 pretraining recipe: progressive-resolution stages over krea2-pack-v1 packs, WSD schedule, "
                    "AdamW or Muon, PMA, iREPA (see examples/pretrain_tiny.yaml).",
    )
    parser.add_argument("config", help="YAML pretraining config")
    parser.add_argument("--output-dir", help="run folder (overrides output_dir in the config)")
    parser.add_argument("--resume", action="store_true", help="continue the run in the output folder from its last checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="check the config and packs, print the plan, train nothing")
    parser.add_argument("--replay", type=int, metavar="STEP",
                        help='print {"stage", "step", "sample_ids"} of global step STEP as JSON (last line) and exit')
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. stages.0.steps=100")
    return allow_intermixed(parser)


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def run(args: argparse.Namespace) -> int:
    """A stop (SIGTERM / SIGINT, in any phase: :mod:`finetune.stop`) ends it with 130 before the last step, 0 after."""
    with StopRequest() as stop:  # first thing: from here on a stop is a stop, never a kill
        return _run(args, stop)


def _run(args: argparse.Namespace, stop: StopRequest) -> int:
    from .config import load_pretrain_config

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={Path(args.output_dir).resolve()}")
    config = load_pretrain_config(args.config, overrides)
    logging.getLogger("finetune").setLevel(logging.INFO)
    if args.replay is not None:
        from .batches import replay_line
        from .trainer import run_world_size

        print(replay_line(config, args.replay, run_world_size(Path(config.output_dir), _world_size())))
        return 0
    if args.dry_run:
        from .plan import print_plan

        print_plan(config, _world_size())
        return 0
    if stop.requested:  # while the command started: nothing was trained, nothing to save
        print("stopped before training started", file=sys.stderr)
        return STOPPED_CODE
    from krea2_diffusers.cpu_threads import choose_cpu_threads
    from krea2_diffusers.heap import hold_freed_chunks

    from ..trainer import NonFiniteLossError
    from .architecture import transformer_config
    from .trainer import pretrain

    architecture = transformer_config(config.model)
    hold_freed_chunks()
    choose_cpu_threads(width=architecture["num_attention_heads"] * architecture["attention_head_dim"])

    try:
        result = pretrain(config, resume=args.resume)
    except NonFiniteLossError as err:
        print(f"krea2 pretrain: {err}", file=sys.stderr)
        return 3
    if result.interrupted:
        print(f"stopped at step {result.final_step}; continue with --resume", file=sys.stderr)
        return STOPPED_CODE
    return 0


def main(argv=None) -> int:
    """``python -m finetune.pretrain`` (for torchrun / accelerate launch)."""
    parser = argparse.ArgumentParser(prog="python -m finetune.pretrain")
    command = add_parser(parser.add_subparsers(dest="command"))
    command.prog = "python -m finetune.pretrain"
    args = command.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..config import ConfigError
    from ..packs import PackError
    from ..rundir import RunDirectoryError

    try:
        return run(args)
    except (ConfigError, PackError, RunDirectoryError) as err:
        print(f"krea2 pretrain: error: {err}", file=sys.stderr)
        return 2
