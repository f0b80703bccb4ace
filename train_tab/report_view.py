"""The run's checkpoint report (``report.json``, :mod:`finetune.report`) as the Train tab shows it:
the curves of its measures per checkpoint and the recommended checkpoint in a line of text."""

from __future__ import annotations

MEASURES = ("concept", "leak", "copying", "diversity")
"""The curves drawn (``report.json``'s per-checkpoint measures; concept: towards the training images,
leak: the prompts without the trigger drifting, copying: towards a training image, diversity: across seeds)."""


def curves(report: dict | None) -> dict[str, list]:
    """Long-form columns ``{"step": [...], "measure": [...], "value": [...]}``, one row per
    checkpoint and measure taken (a measure the run could not take is left out), for a line plot
    coloured by measure. Empty columns without a report."""
    columns: dict[str, list] = {"step": [], "measure": [], "value": []}
    for row in (report or {}).get("checkpoints", []):
        for measure in MEASURES:
            if row.get(measure) is not None:
                columns["step"].append(row["step"])
                columns["measure"].append(measure)
                columns["value"].append(float(row[measure]))
    return columns


def recommendation(report: dict | None, kept: list[int]) -> str:
    """Markdown: the recommended checkpoint and why, and whether it can still be exported (``kept``:
    the steps the run keeps a checkpoint of)."""
    if report is None:
        return "Checkpoint report: after the first sample set (each one measures concept, leak, copying, diversity)."
    chosen = report.get("recommended")
    if not chosen:
        return "Checkpoint report: no checkpoint measured yet."
    step = chosen["step"]
    where = ("its checkpoint is kept: export it below" if step in kept
             else "its checkpoint is no longer kept: export the nearest kept one")
    return f"**Recommended checkpoint: step {step}** ({where}).  \n{chosen['reason']}"
