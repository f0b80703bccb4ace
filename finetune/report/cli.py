"""``krea2 report RUN_DIR``: rebuild ``report.json`` and ``report.html`` of a finished or stopped
run from what its validations measured (``RUN_DIR/report/``); no model is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="rebuild a training run's checkpoint report (report.json, report.html)",
        description="Rebuild RUN_DIR/report.json and RUN_DIR/report.html (metric curves, samples per checkpoint, "
                    "the recommended checkpoint) from the measurements of a krea2 train run's validations.",
    )
    parser.add_argument("run_dir", help="the run's output folder (holding report/ and run.json)")
    return parser


def run(args: argparse.Namespace) -> int:
    from .writer import HTML_NAME, JSON_NAME, write_report

    run_dir = Path(args.run_dir)
    report = write_report(run_dir)
    print(run_dir / JSON_NAME)
    print(run_dir / HTML_NAME)
    recommended = report["recommended"]
    if recommended:
        print(f"recommended: step {recommended['step']}: {recommended['reason']}")
    return 0
