#!/usr/bin/env python
"""How much of a frontier verdict is the sampling block: the same models' accuracy and FD on several
blocks of 200 samples (issue 39; ``bench/proving/HISTORY.md``, "The frontier gate's 10% is inside the FD's
sampling spread").

    python bench/proving/fd_spread.py --run DIR [--seed S] [--blocks 0,1,2,5,6] [--guidance 0,0.5,1]
                                      [--lora NAME=FILE ...] [--json OUT]

Each block is a sampling block of :class:`proving.seeds.Seeds` (0: the tuning block at seed 0, 1: the
report's evaluation block, 2: the selection block; 5 and up: blocks no stage samples). The base is
sampled at every ``--guidance`` scale, each ``--lora`` at guidance 0 (as the post-trained stages are
judged), ``per_digit`` samples of each digit and the run's sampler; the judge is the run's (rebuilt
from its seed). Prints per model its range and mean over the blocks, and the block-averaged frontier's
FD at each LoRA's mean accuracy (:func:`proving.frontier.frontier_fd` over the means).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))


def measure(pipe, judge, settings, seeds, blocks: list[int], guidance: float, resolution: int) -> list[dict]:
    """[{"block", "accuracy", "fd"}] of ``pipe`` at ``guidance`` on each sampling block."""
    from proving.sampling import generate

    rows = []
    for block in blocks:
        images, labels = generate(None, range(10), settings.per_digit, guidance, settings.sampling_steps,
                                  seed=seeds.block(block), resolution=resolution, pipe=pipe)
        scores = judge.evaluate(images, labels)
        rows.append({"block": block, "accuracy": scores["accuracy"], "fd": scores["fd"]})
    return rows


def summary(rows: list[dict]) -> dict:
    """Range and mean of accuracy and FD over the blocks."""
    acc, fd = np.array([r["accuracy"] for r in rows]), np.array([r["fd"] for r in rows])
    return {"accuracy": [float(acc.min()), float(acc.max()), float(acc.mean())],
            "fd": [float(fd.min()), float(fd.max()), float(fd.mean())]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished proving-ground run folder")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed")
    parser.add_argument("--blocks", default="0,1,2,5,6", help="sampling blocks (comma-separated)")
    parser.add_argument("--guidance", default="0,0.5,1", help="the base's CFG scales (comma-separated)")
    parser.add_argument("--lora", action="append", default=[], help="NAME=FILE: a LoRA sampled at guidance 0")
    parser.add_argument("--json", help="write the rows and summaries here")
    args = parser.parse_args(argv)
    loras = dict(item.split("=", 1) for item in args.lora)
    for name, path in loras.items():  # before any sampling
        if not Path(path).is_file():
            raise SystemExit(f"--lora {name}={path}: no such file")

    import proving_ground as pg
    from krea2_diffusers.cpu_threads import choose_cpu_threads
    from proving import digits
    from proving.frontier import frontier_fd
    from proving.judge import run_judge
    from proving.sampling import load_pipeline
    from proving.seeds import Seeds

    choose_cpu_threads(width=pg.WIDTH)
    run, seeds, settings = Path(args.run), Seeds(args.seed), pg.FULL
    blocks = [int(b) for b in args.blocks.split(",")]
    splits = digits.load_splits(pg.RESOLUTION, seeds.split)
    judge = run_judge(splits, seeds, settings.judge_epochs)
    pipe = load_pipeline(run / "models" / "base")
    results = {}
    for g in (float(x) for x in args.guidance.split(",")):
        results[f"base, guidance {g}"] = measure(pipe, judge, settings, seeds, blocks, g, pg.RESOLUTION)
    sweep = [{"guidance": float(name.split()[-1]), **{k: v[2] for k, v in summary(rows).items()}}
             for name, rows in results.items()]
    frontier = {}
    for name, path in loras.items():
        pipe.load_lora_weights(path)
        try:
            results[name] = measure(pipe, judge, settings, seeds, blocks, 0.0, pg.RESOLUTION)
        finally:
            pipe.unload_lora_weights()
        mean = summary(results[name])
        frontier[name] = {"frontier_fd": frontier_fd(sweep, mean["accuracy"][2])["fd"]}
        frontier[name]["ratio"] = mean["fd"][2] / frontier[name]["frontier_fd"]
    print(f"seed {args.seed}, blocks {blocks}, {settings.per_digit} samples per digit:")
    for name, rows in results.items():
        s = summary(rows)
        extra = (f"; block-averaged frontier FD {frontier[name]['frontier_fd']:.1f}, ratio {frontier[name]['ratio']:.2f}"
                 if name in frontier else "")
        print(f"  {name}: accuracy {s['accuracy'][0]:.3f}-{s['accuracy'][1]:.3f} ({s['accuracy'][2]:.3f}), "
              f"FD {s['fd'][0]:.1f}-{s['fd'][1]:.1f} ({s['fd'][2]:.1f}){extra}", flush=True)
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(Path(args.json), "w") as handle:
            handle.write(json.dumps({"seed": args.seed, "blocks": blocks, "rows": results, "frontier": frontier}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
