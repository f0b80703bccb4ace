"""``report.html``: one self-contained page that opens offline: the metric curves as inline SVG (no
script, nothing fetched), the table of checkpoints, the samples of each checkpoint with and without
the trigger (images linked relatively, from the run folder), the recommended checkpoint marked,
and the run's config and timing."""

from __future__ import annotations

import html
import json
from pathlib import Path

from .layout import FOLDER, image_name
from .plan import ReportPrompt

CURVES = (("concept", "concept (best match to a training image)"), ("concept_share", "concept share"),
          ("leak", "leak (1 = a new seed's change)"), ("copying", "copying (largest match)"),
          ("diversity", "diversity (pairwise distance across seeds)"))
BASE_LEVEL = {"concept": "base_concept", "copying": "base_copying", "diversity": "base_diversity"}
WIDTH, HEIGHT, PAD = 360, 170, 34

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
.curves { display: flex; flex-wrap: wrap; gap: 12px; }
svg.curve { background: #fafafa; border: 1px solid #ddd; }
svg .line { fill: none; stroke: #1f6feb; stroke-width: 2; }
svg .base { stroke: #999; stroke-dasharray: 4 3; }
svg .recommended-marker { stroke: #d4380d; stroke-width: 2; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
tr.recommended { background: #fff1e6; font-weight: bold; }
.badge { color: #d4380d; font-weight: bold; }
.recommendation { border-left: 4px solid #d4380d; padding: 0.5em 1em; background: #fff8f3; }
section.checkpoint { margin: 1em 0; padding: 0.5em; border: 1px solid #eee; }
section.checkpoint.recommended { border: 2px solid #d4380d; }
.samples img { width: 128px; height: auto; margin: 2px; image-rendering: pixelated; }
pre { background: #f6f6f6; padding: 0.6em; overflow: auto; max-height: 30em; }
"""


def _fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def curve(key: str, title: str, rows: list[dict], base: float | None, recommended: int | None) -> str:
    """One metric over the steps as an inline SVG: the line, the base's level dashed, the recommended step marked."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    parts = [f'<svg class="curve" id="curve-{key}" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{PAD}" y="14" font-size="12">{html.escape(title)}</text>']
    if points:
        steps = [s for s, _ in points] + ([recommended] if recommended is not None else [])
        values = [v for _, v in points] + ([base] if base is not None else [])
        x0, x1 = min(steps), max(steps)
        y0, y1 = min(values), max(values)
        if y1 - y0 < 1e-12:
            y0, y1 = y0 - 0.5, y1 + 0.5
        x = lambda s: PAD + (s - x0) / ((x1 - x0) or 1) * (WIDTH - 2 * PAD)  # noqa: E731
        y = lambda v: HEIGHT - PAD + 10 - (v - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)  # noqa: E731
        if base is not None:
            parts.append(f'<line class="base" x1="{PAD}" x2="{WIDTH - PAD}" y1="{y(base):.1f}" y2="{y(base):.1f}"><title>base '
                         f'{base:.4f}</title></line>')
        if recommended is not None:
            parts.append(f'<line class="recommended-marker" x1="{x(recommended):.1f}" x2="{x(recommended):.1f}" y1="20" '
                         f'y2="{HEIGHT - PAD + 10}"><title>recommended: step {recommended}</title></line>')
        parts.append('<polyline class="line" points="' + " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points) + '"/>')
        parts += [f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="#1f6feb"><title>step {s}: {v:.4f}</title></circle>'
                  for s, v in points]
        parts.append(f'<text x="2" y="{y(y1) + 4:.1f}" font-size="10">{y1:.3g}</text>'
                     f'<text x="2" y="{y(y0) + 4:.1f}" font-size="10">{y0:.3g}</text>'
                     f'<text x="{PAD}" y="{HEIGHT - 4}" font-size="10">step {x0}</text>'
                     f'<text x="{WIDTH - PAD}" y="{HEIGHT - 4}" font-size="10" text-anchor="end">step {x1}</text>')
    else:
        parts.append(f'<text x="{PAD}" y="{HEIGHT // 2}" font-size="11">not measured</text>')
    return "".join(parts) + "</svg>"


def _table(report: dict, rows: list[dict], run_dir: Path) -> str:
    recommended = (report["recommended"] or {}).get("step")
    head = ("<tr><th>step</th><th>concept</th><th>concept share</th><th>leak</th><th>leak (features)</th>"
            "<th>leak (pixels)</th><th>copying</th><th>diversity</th><th>seconds</th><th>metrics seconds</th>"
            "<th>checkpoint</th></tr>")
    body = []
    for row in rows:
        step = row["step"]
        kept = (run_dir / "checkpoints" / f"step-{step}").is_dir()
        mark = ' <span class="badge">★ recommended</span>' if step == recommended else ""
        body.append(f'<tr class="{"recommended" if step == recommended else ""}" data-step="{step}"><td>{step}{mark}</td>'
                    + "".join(f"<td>{_fmt(row.get(k))}</td>" for k in ("concept", "concept_share", "leak", "leak_feature",
                                                                      "leak_pixel", "copying", "diversity"))
                    + f"<td>{_fmt(row.get('seconds'), 1)}</td><td>{_fmt(row.get('metrics_seconds'), 1)}</td>"
                    + f"<td>{'kept: checkpoints/step-' + str(step) if kept else 'not kept'}</td></tr>")
    return f'<table id="checkpoints">{head}{"".join(body)}</table>'


def _images(paths: list[list[str]], prompts: list[dict], label: str) -> str:
    if not paths:
        return ""
    out = [f"<div class='samples'><b>{label}</b><br>"]
    for group, prompt in zip(paths, prompts):
        out += [f'<img src="{html.escape(path)}" alt="{html.escape(prompt["text"])}" title="{html.escape(prompt["text"])} '
                f'(copy {k})" loading="lazy">' for k, path in enumerate(group)]
    return "".join(out) + "</div>"


def _grids(report: dict, rows: list[dict], saved: dict) -> str:
    plan = saved["plan"]
    prompts = {kind: [p for p in plan["prompts"] if p["kind"] == kind] for kind in ("concept", "plain")}
    recommended = (report["recommended"] or {}).get("step")
    base = {kind: [[f"{FOLDER}/base/{image_name(ReportPrompt(**p), k)}" for k in range(plan["base_copies"])]
                   for p in prompts[kind]] for kind in ("concept", "plain")}
    out = ["<section class='checkpoint base' id='step-base'><h3>base model</h3>",
           _images(base["concept"], prompts["concept"], "with the trigger"),
           _images(base["plain"], prompts["plain"], "without the trigger"), "</section>"]
    for row in rows:
        step, images = row["step"], row.get("images", {})
        marked = step == recommended
        out += [f"<section class='checkpoint{' recommended' if marked else ''}' id='step-{step}' data-step='{step}'>",
                f"<h3>step {step}{' <span class=badge>★ recommended</span>' if marked else ''}</h3>",
                _images(images.get("concept", []), prompts["concept"], "with the trigger"),
                _images(images.get("plain", []), prompts["plain"], "without the trigger"), "</section>"]
    return "".join(out)


def render(report: dict, rows: list[dict], saved: dict, run: dict, run_dir: Path) -> str:
    """The page of a report (:func:`~finetune.report.writer.build_report`), its rows, the saved
    ``reference.json`` and ``run.json``."""
    recommended = report["recommended"]
    step = recommended["step"] if recommended else None
    reference = report["reference"]
    curves = "".join(curve(key, title, rows, reference.get(BASE_LEVEL.get(key, "")), step) for key, title in CURVES)
    prompts = "".join(f"<li>{html.escape(p['kind'])}: {html.escape(p['text'])}</li>" for p in saved["plan"]["prompts"])
    total = rows[-1].get("seconds") if rows else None
    spent = sum(r.get("metrics_seconds") or 0.0 for r in rows)
    summary = (f"<p id='recommended' data-step='{step}' class='recommendation'><b>Recommended: step {step}</b> — "
               f"{html.escape(recommended['reason'])}<br><code>krea2 export {html.escape(str(run_dir))}/checkpoints/step-{step} "
               f"OUT</code></p>" if recommended else "<p id='recommended'>No checkpoint measured yet.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Checkpoint report: {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head><body>
<h1>Checkpoint report: {html.escape(run_dir.name)}</h1>
{summary}
<p>Encoder: <code>{html.escape(report['encoder'])}</code>; {saved.get('training_images', 0)} training images;
rule: {html.escape(report['rule'])}.</p>
<h2>Curves</h2><div class="curves">{curves}</div>
<h2>Checkpoints</h2>{_table(report, rows, run_dir)}
<p>Timing: {_fmt(total, 1)} s of run up to the last measured step, of which {spent:.1f} s were the report's
(its extra samples and features).</p>
<h2>Samples</h2><ul>{prompts}</ul>{_grids(report, rows, saved)}
<h2>Reference levels</h2><pre>{html.escape(json.dumps(reference, indent=2))}</pre>
<h2>Config</h2><details><summary>run.json</summary><pre>{html.escape(json.dumps(run.get('config', {}), indent=2))}</pre></details>
</body></html>
"""
