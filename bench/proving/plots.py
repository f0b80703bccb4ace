"""The report's plots, drawn with PIL (matplotlib is not a dependency): post-training curves (reward,
judge accuracy and FD against steps) and the base's CFG frontier (FD against accuracy) with the
post-trained models on it."""

from __future__ import annotations

from pathlib import Path

CURVE_COLOURS = {"dpo": (44, 160, 44), "grpo": (31, 119, 180), "draft": (214, 39, 40), "student_4": (148, 103, 189)}


def plot_curves(curves: dict[str, list[dict]], path: Path, width: int = 960, height: int = 300) -> Path:
    """Three panels side by side, reward, judge accuracy and FD against optimizer steps, one line per
    method (``curves``: {method: [{"step", "reward", "accuracy", "fd"}]}); written atomically as PNG."""
    from PIL import Image, ImageDraw

    from krea2_diffusers.files import atomic_path

    keys = ("reward", "accuracy", "fd")
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    panel = width // len(keys)
    left, right, top, bottom = 50, 15, 30, 40
    last = max([p["step"] for c in curves.values() for p in c] or [1]) or 1
    for index, key in enumerate(keys):
        values = [p[key] for c in curves.values() for p in c if p.get(key) is not None]
        low, high = (min(values + [0.0]), max(values + [1.0])) if values else (0.0, 1.0)
        x0, x1, y0, y1 = index * panel + left, (index + 1) * panel - right, top, height - bottom
        draw.rectangle((x0, y0, x1, y1), outline="black")
        draw.text((x0, 8), f"{key} (guidance 0, selection seeds)", fill="black")
        for fraction in (0.0, 0.5, 1.0):
            y = y1 - fraction * (y1 - y0)
            draw.text((x0 - 46, y - 6), f"{low + fraction * (high - low):.2f}", fill="black")
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


def plot_frontier(sweep: list[dict], points: dict[str, dict], path: Path, bound: float, width: int = 480,
                  height: int = 360) -> Path:
    """FD against accuracy: the base's CFG sweep (``sweep``: [{"guidance", "accuracy", "fd"}], a black line
    labelled by guidance, with its ``bound`` x FD dashed above) and each post-trained model at guidance 0
    (``points``: {stage: {"accuracy", "fd"}}); written atomically as PNG."""
    from PIL import Image, ImageDraw

    from krea2_diffusers.files import atomic_path

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    x0, x1, y0, y1 = 55, width - 20, 30, height - 40
    line = sorted(sweep, key=lambda p: p["guidance"])
    accuracies = [p["accuracy"] for p in line] + [p["accuracy"] for p in points.values()]
    fds = [p["fd"] for p in line] + [bound * p["fd"] for p in line] + [p["fd"] for p in points.values()]
    a_low, a_high = min(accuracies + [1.0]) - 0.02, 1.0 + 0.01
    f_low, f_high = 0.0, max(fds + [1.0]) * 1.05

    def xy(accuracy, fd):
        return (x0 + (accuracy - a_low) / (a_high - a_low) * (x1 - x0), y1 - (fd - f_low) / (f_high - f_low) * (y1 - y0))

    draw.rectangle((x0, y0, x1, y1), outline="black")
    draw.text((x0, 8), "FD against accuracy: base CFG sweep (black), post-trained at guidance 0", fill="black")
    for fraction in (0.0, 0.5, 1.0):
        draw.text((x0 - 50, y1 - fraction * (y1 - y0) - 6), f"{f_low + fraction * (f_high - f_low):.0f}", fill="black")
        draw.text((x0 + fraction * (x1 - x0) - 14, y1 + 6), f"{a_low + fraction * (a_high - a_low):.2f}", fill="black")
    draw.text(((x0 + x1) // 2 - 25, height - 16), "accuracy", fill="black")
    base = [xy(p["accuracy"], p["fd"]) for p in line]
    if len(base) > 1:
        draw.line(base, fill="black", width=2)
    upper = [xy(p["accuracy"], bound * p["fd"]) for p in line]
    for (xa, ya), (xb, yb) in zip(upper, upper[1:]):
        for t in range(0, 10, 2):  # dashed: five pieces per segment
            draw.line((xa + (xb - xa) * t / 10, ya + (yb - ya) * t / 10, xa + (xb - xa) * (t + 1) / 10,
                       ya + (yb - ya) * (t + 1) / 10), fill=(120, 120, 120), width=1)
    for (x, y), p in zip(base, line):
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill="black")
        draw.text((x + 4, y + 2), f"g{p['guidance']:g}", fill="black")
    for stage, p in points.items():
        x, y = xy(p["accuracy"], p["fd"])
        colour = CURVE_COLOURS.get(stage, (0, 0, 0))
        draw.rectangle((x - 4, y - 4, x + 4, y + 4), fill=colour)
        draw.text((x + 6, y - 12), stage, fill=colour)
    path = Path(path)
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")
    return path
