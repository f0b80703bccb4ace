"""``krea2 curate status --prometheus``: the status counts in Prometheus' text exposition format.

``krea2_curate_claimable{job=...}`` is the autoscaling signal: rows a new worker could take now.
"""

from __future__ import annotations

from typing import Any

JOB_GAUGES = {
    "claimable": "Rows a worker could claim now (the autoscaling signal)",
    "in_flight": "Rows claimed by a live worker",
    "done": "Rows this job has finished",
    "failed": "Rows marked failed by this job after max_attempts",
    "rows_per_s": "Rows finished per second over the status window",
}


def prometheus_text(status: dict[str, Any]) -> str:
    lines = []

    def gauge(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP krea2_curate_{name} {help_text}", f"# TYPE krea2_curate_{name} gauge"])
        lines.extend(f"krea2_curate_{name}{labels} {value}" for labels, value in samples)

    gauge("images", "Images in the warehouse", [("", status["images"])])
    gauge("images_by_status", "Images per final or pending status",
          [(f'{{status="{s}"}}', status[s]) for s in ("kept", "pending", "failed")])
    gauge("dropped", "Dropped images per reason", [(f'{{reason="{r}"}}', n) for r, n in status["dropped"].items()])
    for key, help_text in JOB_GAUGES.items():
        gauge(f"job_{key}", help_text, [(f'{{job="{job}"}}', values[key]) for job, values in status["jobs"].items()])
    return "\n".join(lines) + "\n"
