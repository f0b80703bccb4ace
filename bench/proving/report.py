"""The proving ground's report: ``DIR/report.md`` (one table of every stage, the issue's
thresholds checked one by one, a sample grid per stage, the GRPO + DRaFT reward / accuracy
against steps plot) and the pinned JSON.

Grids are built from the pinned samples ``DIR/samples/<stage>/<digit>_<k>.png`` (ten rows, one per
digit), so the report shows exactly what was measured. The plot is drawn with PIL (matplotlib is
not a dependency).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

STAGE_ORDER = ("base_nocfg", "base", "lora", "lora_off", "dpo", "grpo", "draft", "teacher_4", "teacher_28", "student_4")
GRID_COLUMNS = 10
CURVE_COLOURS = {"grpo": (31, 119, 180), "draft": (214, 39, 40)}


def sample_grid(samples_dir: Path, columns: int = GRID_COLUMNS):
    """``<digit>_<k>.png`` files -> one PIL image, row d = digit d's first ``columns`` samples
    (blank cells where a digit has fewer)."""
    from PIL import Image

    files = {}
    for path in Path(samples_dir).glob("*.png"):
        match = re.fullmatch(r"(\d)_(\d+)", path.stem)
        if match:
            files[(int(match[1]), int(match[2]))] = path
    if not files:
        raise FileNotFoundError(f"no <digit>_<k>.png samples in {samples_dir}")
    size = Image.open(next(iter(files.values()))).size
    grid = Image.new("RGB", (columns * size[0], 10 * size[1]), (128, 128, 128))
    for digit in range(10):
        ks = sorted(k for d, k in files if d == digit)[:columns]
        for column, k in enumerate(ks):
            grid.paste(Image.open(files[(digit, k)]).convert("RGB"), (column * size[0], digit * size[1]))
    return grid


def plot_curves(curves: dict[str, list[dict]], path: Path, width: int = 720, height: int = 300) -> Path:
    """Two panels side by side, reward and judge accuracy against optimizer steps, one line per
    method (``curves``: {method: [{"step", "reward", "accuracy"}]}); written atomically as PNG."""
    from PIL import Image, ImageDraw

    from krea2_diffusers.files import atomic_path

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    panel = width // 2
    left, right, top, bottom = 50, 15, 30, 40
    last = max([p["step"] for c in curves.values() for p in c] or [1]) or 1
    for index, key in enumerate(("reward", "accuracy")):
        values = [p[key] for c in curves.values() for p in c if p.get(key) is not None]
        low, high = (min(values + [0.0]), max(values + [1.0])) if values else (0.0, 1.0)
        x0, x1, y0, y1 = index * panel + left, (index + 1) * panel - right, top, height - bottom
        draw.rectangle((x0, y0, x1, y1), outline="black")
        draw.text((x0, 8), f"{key} (guidance-free eval samples)", fill="black")
        for fraction in (0.0, 0.5, 1.0):
            y = y1 - fraction * (y1 - y0)
            draw.text((x0 - 42, y - 6), f"{low + fraction * (high - low):.2f}", fill="black")
            draw.text((x0 + fraction * (x1 - x0) - 8, y1 + 6), f"{fraction * last:.0f}", fill="black")
        draw.text(((x0 + x1) // 2 - 15, height - 16), "step", fill="black")
        for row, (method, curve) in enumerate(curves.items()):
            colour = CURVE_COLOURS.get(method, (0, 0, 0))
            points = [(x0 + p["step"] / last * (x1 - x0), y1 - (p[key] - low) / ((high - low) or 1) * (y1 - y0))
                      for p in curve if p.get(key) is not None]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for x, y in points:
                draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
            draw.text((x1 - 60, y0 + 6 + 14 * row), method, fill=colour)
    path = Path(path)
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")
    return path


def checks(stages: dict[str, dict], vae: dict, classifier: dict) -> list[tuple[str, bool | None]]:
    """The issue's "Done when" thresholds, each (claim with its numbers, met?); None = not measured."""
    s = {name: row for name, row in stages.items() if row.get("accuracy") is not None}
    out = []

    def claim(text: str, needs: tuple[str, ...], test):
        out.append((text, test() if all(n in s for n in needs) else None))

    error = {name: 1 - row["accuracy"] for name, row in s.items()}
    recon = vae.get("judge_accuracy")
    out.append((f"autoencoder: judge accuracy on held-out reconstructions {recon} >= 0.95",
                None if recon is None else recon >= 0.95))
    claim(f"base accuracy {s.get('base', {}).get('accuracy')} >= 0.90 and > base_nocfg "
          f"{s.get('base_nocfg', {}).get('accuracy')}", ("base", "base_nocfg"),
          lambda: s["base"]["accuracy"] >= 0.90 and s["base"]["accuracy"] > s["base_nocfg"]["accuracy"])
    lora, off, base = s.get("lora", {}), s.get("lora_off", {}), s.get("base", {})
    claim(f"lora: concept share {lora.get('concept')} >= 0.90 and accuracy {lora.get('accuracy')} >= base - 0.05; "
          f"lora_off: concept share {off.get('concept')} <= 0.10", ("lora", "lora_off", "base"),
          lambda: lora.get("concept") is not None and off.get("concept") is not None and lora["concept"] >= 0.90
          and lora["accuracy"] >= base["accuracy"] - 0.05 and off["concept"] <= 0.10)
    for name in ("dpo", "grpo", "draft"):
        claim(f"{name}: error {error.get(name, float('nan')):.3f} <= 0.6 x base_nocfg error "
              f"{0.6 * error.get('base_nocfg', float('nan')):.3f}; diversity {s.get(name, {}).get('diversity', float('nan')):.2f} "
              f">= 0.5 x base_nocfg {0.5 * s.get('base_nocfg', {}).get('diversity', float('nan')):.2f}",
              (name, "base_nocfg"),
              lambda name=name: error[name] <= 0.6 * error["base_nocfg"]
              and s[name]["diversity"] >= 0.5 * s["base_nocfg"]["diversity"])
    claim(f"student_4: error {error.get('student_4', float('nan')):.3f} <= 0.6 x teacher_4 error "
          f"{0.6 * error.get('teacher_4', float('nan')):.3f}; FD {s.get('student_4', {}).get('fd', float('nan')):.2f} "
          f"< teacher_4 {s.get('teacher_4', {}).get('fd', float('nan')):.2f}; accuracy >= teacher_28 - 0.05 = "
          f"{s.get('teacher_28', {}).get('accuracy', float('nan')) - 0.05:.3f}",
          ("student_4", "teacher_4", "teacher_28"),
          lambda: error["student_4"] <= 0.6 * error["teacher_4"] and s["student_4"]["fd"] < s["teacher_4"]["fd"]
          and s["student_4"]["accuracy"] >= s["teacher_28"]["accuracy"] - 0.05)
    return out


def contact_sheet(out_dir: Path, names, columns: int = 4, cell: int = 32):
    """Every stage's first ``columns`` samples of each digit side by side, ``cell`` px each (ten rows,
    0 at the top, the stage's name above its block), as one small palette PNG-able PIL image: the
    README's figure (the per-stage grids are full size)."""
    from PIL import Image, ImageDraw

    gap, label = 8, 12
    names = [n for n in names if (Path(out_dir) / "samples" / n).is_dir()]
    block = columns * cell
    sheet = Image.new("RGB", (len(names) * (block + gap) - gap, label + 10 * cell), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, name in enumerate(names):
        grid = sample_grid(Path(out_dir) / "samples" / name, columns)
        sheet.paste(grid.resize((block, 10 * cell), Image.Resampling.BOX), (i * (block + gap), label))
        draw.text((i * (block + gap), 0), name, fill=(0, 0, 0))
    return sheet


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_report(out_dir, stages: dict[str, dict], vae: dict, classifier: dict, curves: dict[str, list[dict]],
                 json_path=None, extra: dict | None = None) -> Path:
    """``DIR/report.md``, ``DIR/grids/<stage>.png``, ``DIR/curves.png`` and the pinned JSON
    (``json_path``, default ``DIR/report.json``). ``stages``: {stage: {"what", "steps", "seconds",
    "accuracy", "fd", "diversity", "num_inference_steps", "guidance"[, "concept"]}} ("concept": share
    of samples showing the LoRA's concept, lora / lora_off); ``vae``: {"steps", "seconds", "mse",
    "psnr", "judge_accuracy" (on held-out reconstructions), ...}; ``classifier``:
    {"judge_heldout_accuracy", "judge_heldout_diversity", "reward_heldout_accuracy"}; ``extra``: more
    top-level JSON fields (e.g. total time)."""
    from krea2_diffusers.files import atomic_path, atomic_write

    out_dir = Path(out_dir)
    names = [n for n in STAGE_ORDER if n in stages] + [n for n in stages if n not in STAGE_ORDER]
    lines = ["# Proving ground report", "",
             "Accuracy and the Frechet distance (FD, to the real held-out digits) and per-digit diversity (mean "
             "pairwise distance within a digit's samples) are measured in the feature space of the evaluation "
             "classifier, which is not the post-training reward.", "",
             f"Evaluation classifier: held-out accuracy {fmt(classifier.get('judge_heldout_accuracy'))} "
             f"(real digits: diversity {fmt(classifier.get('judge_heldout_diversity'), 2)}); reward classifier: "
             f"held-out accuracy {fmt(classifier.get('reward_heldout_accuracy'))}.",
             "Autoencoder: " + ", ".join(f"{k} {fmt(v)}" for k, v in vae.items()), "",
             "| stage | what ran | steps | seconds | sampling steps | guidance | accuracy | FD | diversity | concept |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        row = stages[name]
        lines.append(f"| {name} | {row.get('what', '')} | {fmt(row.get('steps'))} | {fmt(row.get('seconds'), 1)} | "
                     f"{fmt(row.get('num_inference_steps'))} | {fmt(row.get('guidance'), 1)} | {fmt(row.get('accuracy'))} | "
                     f"{fmt(row.get('fd'), 2)} | {fmt(row.get('diversity'), 2)} | {fmt(row.get('concept'))} |")
    lines += ["", "## Thresholds (issue 32)", ""]
    results = checks(stages, vae, classifier)
    lines += [f"- {'MET' if ok else 'NOT MET' if ok is False else 'not measured'}: {text}" for text, ok in results]
    if any(curves.values()):
        plot_curves(curves, out_dir / "curves.png")
        lines += ["", "## GRPO and DRaFT: reward and accuracy against steps", "",
                  "Fixed-seed guidance-free samples made by `krea2 posttrain`'s own evaluation every few steps "
                  "(DRaFT's step 0 is the base on the same seeds); accuracy by the evaluation classifier.", "",
                  "![reward and accuracy against steps](curves.png)", "",
                  "| method | step | reward | accuracy |", "|---|---|---|---|"]
        lines += [f"| {m} | {p['step']} | {fmt(p['reward'])} | {fmt(p.get('accuracy'))} |" for m, c in curves.items() for p in c]
    lines += ["", "## Samples (one row per digit, 0 at the top)", ""]
    for name in names:
        folder = out_dir / "samples" / name
        if folder.is_dir():
            grid_path = out_dir / "grids" / f"{name}.png"
            grid_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(grid_path) as tmp:
                sample_grid(folder).save(tmp, format="PNG")
            lines += [f"### {name}", "", f"![{name}](grids/{name}.png)", ""]
    if names and (out_dir / "samples").is_dir():
        with atomic_path(out_dir / "grids" / "all.png") as tmp:
            contact_sheet(out_dir, names).quantize(64).save(tmp, format="PNG", optimize=True)
        at = lines.index("## Samples (one row per digit, 0 at the top)") + 1
        lines[at:at] = ["", "Every stage at a glance (four samples per digit, 32 px): ![all stages](grids/all.png)"]
    report = out_dir / "report.md"
    with atomic_write(report, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    keys = ("accuracy", "fd", "diversity", "steps", "seconds", "num_inference_steps", "guidance", "what", "concept")
    payload = {"stages": {n: {k: stages[n][k] for k in keys if k in stages[n]} for n in names},
               "vae": vae, "classifier": classifier, "curves": curves,
               "checks": [{"claim": text, "met": ok} for text, ok in results], **(extra or {})}
    with atomic_write(Path(json_path) if json_path else out_dir / "report.json", "w") as handle:
        json.dump(payload, handle, indent=2, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    return report
