"""``krea2`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand -> the module that defines it (``add_parser(subparsers)`` and ``run(args)``), in help
# order. Named by string and imported only here, so the library never imports the training or
# curation packages (they import the library, not the other way round) and each module keeps its
# heavy imports inside ``run``: ``krea2 --help`` stays fast.
COMMANDS = {
    "generate": "krea2_diffusers.cli.generate",
    "convert": "krea2_diffusers.cli.convert",
    "quantize": "krea2_diffusers.cli.quantize",
    "expand": "krea2_diffusers.cli.expand",
    "train": "finetune.cli",
    "posttrain": "finetune.posttrain.cli",
    "export": "finetune.export.cli",
    "report": "finetune.report.cli",
    "pack": "finetune.packs.cli",
    "pretrain": "finetune.pretrain.cli",
    "curate": "curation.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="krea2", description="Krea 2 (RAW / Turbo) tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMANDS.values():
        module = importlib.import_module(module_name)
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
