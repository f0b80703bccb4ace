"""``<output_dir>/report.json`` and ``report.html``, built from the run folder alone (``report/``
and ``run.json``), so the trainer (after each validation) and ``krea2 report`` write the same files.

``report.json``::

    {"checkpoints": [{"step", "concept", "concept_share", "leak", "copying", "diversity", "seconds",
                      "leak_feature", "leak_pixel", "metrics_seconds"}],
     "recommended": {"step", "reason"}, "encoder": "<name>", "reference": {...}, "rule": "<text>"}
"""

from __future__ import annotations

import json
from pathlib import Path

from krea2_diffusers.files import atomic_write

from .layout import FOLDER, read_rows
from .metrics import Reference
from .recommend import RULE, recommend

JSON_NAME = "report.json"
HTML_NAME = "report.html"
PINNED = ("step", "concept", "concept_share", "leak", "copying", "diversity", "seconds")
EXTRA = ("leak_feature", "leak_pixel", "metrics_seconds")


class NoReportError(FileNotFoundError):
    """The run folder holds no report measurements."""


def measured_rows(run_dir: Path) -> list[dict]:
    """The rows of ``report/metrics.jsonl``, one per step (the last one written wins), in step order."""
    by_step = {row["step"]: row for row in read_rows(run_dir)}
    return [by_step[step] for step in sorted(by_step)]


def read_reference(run_dir: Path) -> dict:
    path = run_dir / FOLDER / "reference.json"
    if not path.exists():
        raise NoReportError(f"{run_dir}: no {FOLDER}/reference.json (the run measured no validation: "
                            "validation.metrics off, no validation.prompts, or stopped before its first validation)")
    return json.loads(path.read_text())


def build_report(run_dir: str | Path) -> dict:
    """The ``report.json`` content of a run folder."""
    run_dir = Path(run_dir)
    saved = read_reference(run_dir)
    reference = Reference.from_dict(saved["reference"])
    rows = measured_rows(run_dir)
    return {"checkpoints": [{k: row.get(k) for k in PINNED + EXTRA} for row in rows],
            "recommended": recommend(rows, reference), "encoder": saved["encoder"], "reference": reference.to_dict(),
            "rule": RULE}


def write_report(run_dir: str | Path) -> dict:
    """Write ``report.json`` and ``report.html`` into the run folder; returns the report."""
    from .html import render

    run_dir = Path(run_dir)
    report = build_report(run_dir)
    run_file = run_dir / "run.json"
    run = json.loads(run_file.read_text()) if run_file.exists() else {}
    with atomic_write(run_dir / JSON_NAME, "w") as handle:
        json.dump(report, handle, indent=2)
    page = render(report, measured_rows(run_dir), read_reference(run_dir), run, run_dir)
    with atomic_write(run_dir / HTML_NAME, "w") as handle:
        handle.write(page)
    return report
