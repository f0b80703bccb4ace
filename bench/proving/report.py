"""The proving ground's report: ``DIR/report.md`` (the judge and the reward, one table of every stage,
the gates checked one by one (:mod:`proving.gates`), the base's CFG frontier with the post-trained
models on it, the post-training curves, the edit grid, a sample grid per stage) and the pinned JSON.

Grids are built from the pinned samples ``DIR/samples/<stage>/<digit>_<k>.png`` (ten rows, one per
digit), so the report shows exactly what was measured. The plot is drawn with PIL (matplotlib is
not a dependency; :mod:`proving.plots`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

STAGE_ORDER = ("base_nocfg", "base", "lora", "lora_off", "lora_off_nocfg", "lora_default", "lora_default_off",
               "lora_default_off_nocfg", "lora_ema", "lora_ema_off", "lora_ema_off_nocfg", "dpo", "grpo", "draft",
               "teacher_4", "teacher_28", "student_4")
POST_TRAINED = ("dpo", "grpo", "draft")
GRID_COLUMNS = 10


def sample_files(samples_dir: Path) -> dict[tuple[int, int], Path]:
    """{(digit, k): path} of a stage's ``<digit>_<k>.png`` samples (other files ignored); refuses a folder
    without any."""
    files = {}
    for path in Path(samples_dir).glob("*.png"):
        match = re.fullmatch(r"(\d)_(\d+)", path.stem)
        if match:
            files[(int(match[1]), int(match[2]))] = path
    if not files:
        raise FileNotFoundError(f"no <digit>_<k>.png samples in {samples_dir}")
    return files


def sample_grid(samples_dir: Path, columns: int = GRID_COLUMNS):
    """``<digit>_<k>.png`` files -> one PIL image, row d = digit d's first ``columns`` samples
    (blank cells where a digit has fewer)."""
    from PIL import Image

    files = sample_files(samples_dir)
    size = Image.open(next(iter(files.values()))).size
    grid = Image.new("RGB", (columns * size[0], 10 * size[1]), (128, 128, 128))
    for digit in range(10):
        ks = sorted(k for d, k in files if d == digit)[:columns]
        for column, k in enumerate(ks):
            grid.paste(Image.open(files[(digit, k)]).convert("RGB"), (column * size[0], digit * size[1]))
    return grid


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


def edit_grid(out_dir: Path, pairs: int = 5):
    """``samples/edit_source`` | ``samples/edit`` side by side: row d = digit d's first ``pairs`` (source,
    output) pairs, a white gap between pairs."""
    from PIL import Image

    sources, outputs = (sample_grid(Path(out_dir) / "samples" / name, pairs) for name in ("edit_source", "edit"))
    cell = sources.size[1] // 10
    grid = Image.new("RGB", (pairs * (2 * cell + cell // 4), 10 * cell), (255, 255, 255))
    for k in range(pairs):
        for side, image in enumerate((sources, outputs)):
            grid.paste(image.crop((k * cell, 0, (k + 1) * cell, 10 * cell)), (k * (2 * cell + cell // 4) + side * cell, 0))
    return grid


def stage_table(names, stages: dict[str, dict]) -> list[str]:
    lines = ["| stage | what ran | steps | seconds | sampling steps | guidance | accuracy | FD | frontier FD | diversity | concept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        row = stages[name]
        lines.append(f"| {name} | {row.get('what', '')} | {fmt(row.get('steps'))} | {fmt(row.get('seconds'), 1)} | "
                     f"{fmt(row.get('num_inference_steps'))} | {fmt(row.get('guidance'), 1)} | {fmt(row.get('accuracy'))} | "
                     f"{fmt(row.get('fd'), 2)} | {fmt(row.get('frontier_fd'), 2)} | {fmt(row.get('diversity'), 2)} | "
                     f"{fmt(row.get('concept'))} |")
    return lines


def classifier_lines(extra: dict) -> list[str]:
    judge, reward = extra.get("judge") or {}, extra.get("reward") or {}
    if not judge:
        return []
    attack = reward.get("attack", {})
    lines = [f"Judge ({judge['kind']}): held-out accuracy {fmt(judge['heldout_accuracy'])} (its feature CNN "
             f"{fmt(judge.get('features_heldout_accuracy'))}), trained on {judge['train_scans']} scans. Reward "
             f"({reward['kind']}): held-out accuracy {fmt(reward['heldout_accuracy'])}, trained on the other "
             f"{reward['train_scans']} ({reward['scans_shared_with_judge']} shared). Sign-gradient attack on the reward "
             f"({attack.get('steps')} steps, L-inf budget per pixel), read by the judge:", "",
             "| budget | reward fooled | judge's reading changed | changed, of those fooling the reward |", "|---|---|---|---|"]
    lines += [f"| {r['budget']} | {fmt(r['reward_fooled'])} | {fmt(r['judge_flipped'])} | {fmt(r['judge_flipped_when_fooled'])} |"
              for r in attack.get("by_budget", [])]
    return lines + [""]


def write_report(out_dir, stages: dict[str, dict], vae: dict, classifier: dict, curves: dict[str, list[dict]],
                 json_path=None, extra: dict | None = None) -> Path:
    """``DIR/report.md``, ``DIR/grids/<stage>.png``, ``DIR/curves.png``, ``DIR/frontier.png``, ``DIR/grids/edit.png``
    and the pinned JSON (``json_path``, default ``DIR/report.json``). ``stages``: {stage: {"what", "steps",
    "seconds", "accuracy", "fd", "diversity", "num_inference_steps", "guidance"[, "concept", "frontier_fd",
    "checkpoint"]}}; ``vae``: {"steps", "seconds", "mse", "psnr", "judge_accuracy" (on held-out
    reconstructions), ...}; ``classifier``: {"judge_heldout_accuracy", "judge_heldout_diversity",
    "reward_heldout_accuracy"}; ``curves``: {method: [{"step", "reward", "accuracy", "fd", "diversity"}]};
    ``extra``: more top-level JSON fields ("judge", "reward", "cfg_sweep", "edit", "seed", ...)."""
    from krea2_diffusers.files import atomic_path, atomic_write

    from .frontier import FD_BOUND, guidance_name
    from .gates import checks
    from .plots import plot_curves, plot_frontier

    out_dir, extra = Path(out_dir), extra or {}
    names = [n for n in STAGE_ORDER if n in stages] + [n for n in stages if n not in STAGE_ORDER]
    seeds = extra.get("eval_seeds") or {}
    lines = ["# Proving ground report", "",
             f"Seed {extra.get('seed', 0)}; the samples below come from noise seeds {seeds.get('eval_base')} + 1000 digit + k, "
             "which no tuning run sampled. Accuracy is the judge's reading of the prompted digit; the Frechet distance "
             "(FD, to the real held-out digits) and per-digit diversity (mean pairwise distance within a digit's "
             "samples) are measured in the judge's feature CNN. The judge is not the post-training reward.", ""]
    lines += classifier_lines(extra)
    lines += ["Autoencoder: " + ", ".join(f"{k} {fmt(v)}" for k, v in vae.items()), ""]
    lines += stage_table(names, stages)
    lines += ["", "## Gates (issues 32 and 39)", ""]
    results = checks(stages, vae, extra)
    lines += [f"- {'MET' if ok else 'NOT MET' if ok is False else 'not measured'}: {text}" for text, ok in results]
    sweep = extra.get("cfg_sweep") or []
    if sweep:
        points = {n: stages[n] for n in POST_TRAINED if n in stages}
        plot_frontier(sweep, points, out_dir / "frontier.png", FD_BOUND)
        lines += ["", "## Realism against CFG", "",
                  "The base at guidance 0 and each CFG scale (same seeds and steps): what guidance buys in accuracy and "
                  f"costs in FD. Each post-trained model (guidance 0) against it: the frontier's FD at its accuracy "
                  f"(dashed: {FD_BOUND} x).", "", "![FD against accuracy](frontier.png)", "",
                  "| guidance | accuracy | FD | diversity |", "|---|---|---|---|"]
        lines += [f"| {guidance_name(p['guidance'])} | {fmt(p['accuracy'])} | {fmt(p['fd'], 2)} | {fmt(p['diversity'], 2)} |"
                  for p in sweep]
    if any(curves.values()):
        plot_curves(curves, out_dir / "curves.png")
        lines += ["", "## Post-training: reward, accuracy and FD against steps", "",
                  "Every kept checkpoint sampled at guidance 0 from the selection seeds (not the report's); step 0 is the "
                  "base. The published checkpoint: the last whose FD is within "
                  f"{FD_BOUND} x the frontier's FD at its accuracy (stated in advance, `proving.frontier.choose_checkpoint`).", "",
                  "![reward, accuracy and FD against steps](curves.png)", "",
                  "| method | step | reward | accuracy | FD | diversity | chosen |", "|---|---|---|---|---|---|---|"]
        for method, curve in curves.items():
            chosen = (stages.get(method, {}).get("checkpoint") or {}).get("step")
            lines += [f"| {method} | {p['step']} | {fmt(p.get('reward'))} | {fmt(p.get('accuracy'))} | {fmt(p.get('fd'), 2)} | "
                      f"{fmt(p.get('diversity'), 2)} | {'yes' if p['step'] == chosen else ''} |" for p in curve]
    edit = extra.get("edit")
    if edit and (out_dir / "samples" / "edit").is_dir():
        (out_dir / "grids").mkdir(parents=True, exist_ok=True)
        with atomic_path(out_dir / "grids" / "edit.png") as tmp:
            edit_grid(out_dir).save(tmp, format="PNG")
        lines += ["", "## Edit LoRA on real pairs", "",
                  f"\"{edit['instruction']}\" on {edit['n']} held-out scans (reference | output): concept {fmt(edit['concept'])}, "
                  f"the source's digit read in {fmt(edit['accuracy'])}, ink IoU with the source {fmt(edit['iou_source'])} "
                  f"against {fmt(edit['iou_other'])} with another scan of the same digit.", "", "![edit](grids/edit.png)"]
    lines += ["", "## Samples (one row per digit, 0 at the top)", ""]
    folders = names + [f"base_cfg/{guidance_name(p['guidance'])}" for p in sweep]
    for name in folders:
        folder = out_dir / "samples" / name
        if folder.is_dir():
            grid_path = out_dir / "grids" / f"{name.replace('/', '_')}.png"
            grid_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(grid_path) as tmp:
                sample_grid(folder).save(tmp, format="PNG")
            lines += [f"### {name}", "", f"![{name}](grids/{grid_path.name})", ""]
    if names and (out_dir / "samples").is_dir():
        with atomic_path(out_dir / "grids" / "all.png") as tmp:
            contact_sheet(out_dir, names).quantize(64).save(tmp, format="PNG", optimize=True)
        at = lines.index("## Samples (one row per digit, 0 at the top)") + 1
        lines[at:at] = ["", "Every stage at a glance (four samples per digit, 32 px): ![all stages](grids/all.png)"]
    report = out_dir / "report.md"
    with atomic_write(report, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    keys = ("accuracy", "fd", "diversity", "steps", "seconds", "num_inference_steps", "guidance", "what", "concept",
            "frontier_fd", "frontier_reached", "checkpoint")
    payload = {"stages": {n: {k: stages[n][k] for k in keys if k in stages[n]} for n in names},
               "vae": vae, "classifier": classifier, "curves": curves,
               "checks": [{"claim": text, "met": ok} for text, ok in results], **extra}
    with atomic_write(Path(json_path) if json_path else out_dir / "report.json", "w") as handle:
        json.dump(payload, handle, indent=2, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    return report
