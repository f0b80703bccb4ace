#!/usr/bin/env python
"""Issue 39's table over seeds: each stage's mean and range across proving-ground runs, and how many
runs met each gate.

    python bench/proving/across_seeds.py runs/pg0.json runs/pg1.json runs/pg2.json > table.md

Reads each run's JSON (``--json`` of ``bench/proving_ground.py``); prints Markdown: one row per stage
(accuracy, FD, diversity, concept share where measured: mean and [min, max]), the edit's measures, and
one row per gate with the seeds that met it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

from proving.report import STAGE_ORDER  # noqa: E402

MEASURES = ("accuracy", "fd", "diversity", "concept")
EDIT_MEASURES = ("concept", "accuracy", "iou_source", "iou_other", "iou_ratio", "target_iou_ratio")


def spread(values: list, digits: int = 3) -> str:
    """``mean [min, max]`` of the numbers in ``values`` (None skipped); empty when none."""
    numbers = [v for v in values if isinstance(v, (int, float))]
    if not numbers:
        return ""
    mean = statistics.fmean(numbers)
    if len(numbers) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(numbers):.{digits}f}, {max(numbers):.{digits}f}]"


def gate_name(claim: str) -> str:
    """A gate's name across runs: its claim up to the first colon, or its words before the first number."""
    if ":" in claim:
        return claim.split(":", 1)[0]
    return re.split(r"\s[(\-\d.]", claim, maxsplit=1)[0]


def gate_results(runs: list[dict]) -> dict[str, list[tuple]]:
    """{gate name: [(seed, met), ...]} over the runs' ``checks``, in the order the gates first appear."""
    names: dict[str, list] = {}
    for run in runs:
        for check in run.get("checks", []):
            names.setdefault(gate_name(check["claim"]), []).append((run.get("seed"), check["met"]))
    return names


def seeds_met(results: list[tuple]) -> str:
    """``0, 2 (of 3)``: the seeds of ``[(seed, met), ...]`` that met, out of how many were read."""
    met = [str(seed) for seed, ok in results if ok]
    return f"{', '.join(met) if met else 'none'} (of {len(results)})"


def table(runs: list[dict]) -> str:
    seeds = [run.get("seed") for run in runs]
    lines = [f"Seeds {', '.join(map(str, seeds))}: mean [min, max] over {len(runs)} runs.", "",
             "| stage | accuracy | FD | diversity | concept share |", "|---|---|---|---|---|"]
    for stage in STAGE_ORDER:
        rows = [run["stages"].get(stage) or {} for run in runs]
        if not any(rows):
            continue
        lines.append(f"| {stage} | " + " | ".join(spread([r.get(m) for r in rows], 1 if m in ("fd", "diversity") else 3)
                                                    for m in MEASURES) + " |")
    edits = [run.get("edit") or {} for run in runs]
    if any(edits):
        lines.append("| edit: " + ", ".join(EDIT_MEASURES) + " | " + "; ".join(spread([e.get(m) for e in edits], 3)
                                                                           for m in EDIT_MEASURES) + " | | | |")
    lines += ["", "| gate | met at seeds |", "|---|---|"]
    lines += [f"| {name} | {seeds_met(results)} |" for name, results in gate_results(runs).items()]
    minutes = [run.get("total_seconds", 0) / 60 for run in runs]
    lines += ["", "Wall time per run (min): " + ", ".join(f"seed {s}: {m:.1f}" for s, m in zip(seeds, minutes))]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="proving-ground JSON files (one per seed)")
    args = parser.parse_args(argv)
    print(table([json.loads(Path(p).read_text()) for p in args.runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
