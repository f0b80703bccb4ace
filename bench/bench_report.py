"""What the checkpoint report (``validation.metrics``, issue 41) adds to a run's time.

    python bench/bench_report.py [--config examples/train_lora_tiny.yaml] [--repeats 2] [--json OUT]

Runs ``krea2 train CONFIG`` with ``validation.metrics`` true and false, at the config's own
validation settings and the report's defaults (two seeds per prompt, the Qwen3-VL vision tower),
alternating, ``--repeats`` times each, in fresh output folders (one shared feature cache, filled
by a warm-up run first). Two cases: the config as written (no trigger word: every validation
prompt measures the concept, nothing the leak) and with a trigger word in front of every prompt
(the prompts without it are sampled too, for the leak). Wall seconds and CPU seconds (the
process's user + system) of the best run of each; the overhead is metrics / no metrics - 1. On a
machine shared with other jobs the CPU seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIGGER = "tinystyle"


def run(config: Path, out: Path, cache: Path, overrides: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``krea2 train`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "krea2_diffusers.cli", "train", str(config), "--output-dir", str(out),
                           f"data.cache_dir={cache}", "logging.progress_bar=false", *overrides],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "train_lora_tiny.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import yaml

    prompts = yaml.safe_load(args.config.read_text())["validation"]["prompts"]
    triggered = json.dumps([f"{TRIGGER}, {p}" for p in prompts])
    cases = {"as written": [], "with a trigger": [f"validation.prompts={triggered}", f"export.trigger_words=[{TRIGGER}]"]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run(args.config, tmp / "warm-up", tmp / "cache", ["validation.metrics=false"])
        for name, overrides in cases.items():
            best = {}
            for i in range(args.repeats):
                for metrics in ("false", "true"):
                    wall, cpu = run(args.config, tmp / f"{name}-{metrics}-{i}".replace(" ", "-"), tmp / "cache",
                                    [*overrides, f"validation.metrics={metrics}"])
                    old = best.get(metrics, (float("inf"), float("inf")))
                    best[metrics] = (min(old[0], wall), min(old[1], cpu))
            (wall_off, cpu_off), (wall_on, cpu_on) = best["false"], best["true"]
            results[name] = {"wall_off": wall_off, "wall_on": wall_on, "cpu_off": cpu_off, "cpu_on": cpu_on,
                             "wall_overhead": wall_on / wall_off - 1, "cpu_overhead": cpu_on / cpu_off - 1}
            print(f"{name}: wall {wall_off:.1f} s -> {wall_on:.1f} s ({results[name]['wall_overhead']:+.1%}), "
                  f"CPU {cpu_off:.1f} s -> {cpu_on:.1f} s ({results[name]['cpu_overhead']:+.1%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"config": str(args.config), "repeats": args.repeats, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
