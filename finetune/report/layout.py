"""Where a run's report lives: ``<output_dir>/report/`` holds ``metrics.jsonl`` (one row per
checkpoint) and the sample images, named by prompt and copy. Shared by the collector that writes them
and the writer / HTML that read them (its own module, so neither imports the other)."""

from __future__ import annotations

import json
from pathlib import Path

from .plan import ReportPrompt

FOLDER = "report"


def image_name(prompt: ReportPrompt, copy: int) -> str:
    return f"{prompt.kind}-{prompt.index:02d}-{copy}.png"


def read_rows(folder: Path) -> list[dict]:
    path = folder / FOLDER / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
