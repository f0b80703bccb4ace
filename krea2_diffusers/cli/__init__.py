"""``krea2`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules under krea2_diffusers.cli, in help order.
COMMANDS = ("generate", "convert", "quantize", "expand", "train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="krea2", description="Krea 2 (RAW / Turbo) tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"krea2_diffusers.cli.{name}")
        command = module.add_parser(sub)
        command.set_defaults(_run=module.run)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"krea2 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
