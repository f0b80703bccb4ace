#!/usr/bin/env python
"""Does the packaged ``krea2-digits`` draw the digit it is asked for? (issue 39)

    python bench/bench_digits_model.py [--judge DIR/work/judge.safetensors] [--seed 0] [--per-digit 20]
        [--lora] [--min-accuracy 0.9] [--device cpu|cuda]

Loads the model by name (``Krea2Pipeline.from_pretrained("krea2-digits")``, its own defaults: 64 px,
16 steps, CFG 3), samples ``--per-digit`` seeds of every caption (``a handwritten digit seven`` ...)
with the proving ground's sampler (:func:`proving.sampling.generate`: sample k of digit d from seed
``base + 1000 d + k``, base = the run's report block, :attr:`proving.seeds.Seeds.eval`) and reads
them with the proving ground's judge: the run's saved one (``--judge``, its reader beside it), or
one trained again exactly as ``bench/proving_ground.py --seed S`` trains it (same split, half and
seed: the same reader). Prints the accuracy per digit and overall; exits 1 when a digit reads below
``--min-accuracy``. ``--lora``: the shipped concept LoRA with its trigger (accuracy and red-ink share).
About a minute on a 2-core CPU (most of it the judge, when retrained).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))


def load_judge(path: str | None, seed: int):
    """The proving ground's judge reader: the one saved at ``path`` (``Judge.save``'s file), or trained
    again as ``proving_ground.classifiers`` trains it for ``--seed seed``."""
    from proving import digits
    from proving.judge import reader_path, run_judge
    from proving.reader import load_reader
    from proving.seeds import Seeds
    from proving_ground import FULL, RESOLUTION

    if path is not None:
        reader = reader_path(path)
        if not reader.is_file():
            raise FileNotFoundError(f"{reader}: no judge reader beside {path} (expected DIR/work/judge_reader.safetensors)")
        return load_reader(reader)
    seeds = Seeds(seed)
    splits = digits.load_splits(RESOLUTION, seeds.split)
    return run_judge(splits, seeds, FULL.judge_epochs).reader


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judge", default=None, help="a run's DIR/work/judge.safetensors (default: train it again)")
    parser.add_argument("--seed", type=int, default=0, help="the proving-ground run seed: judge and sampling block (default 0)")
    parser.add_argument("--per-digit", type=int, default=20, help="samples per digit (default 20)")
    parser.add_argument("--lora", action="store_true", help="with the shipped red-ink LoRA and its trigger")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 when a digit reads below this (default 0.9)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.cpu_threads import choose_cpu_threads
    from krea2_diffusers.models.digits import FOLDER, KREA2_DIGITS
    from proving.digits import NAMES, shows_red_ink
    from proving.lora import TRIGGER
    from proving.sampling import generate
    from proving.seeds import Seeds

    if args.device == "cpu":
        choose_cpu_threads(KREA2_DIGITS)
    start = time.perf_counter()
    reader = load_judge(args.judge, args.seed)
    judge_seconds = time.perf_counter() - start
    pipe = Krea2Pipeline.from_pretrained(KREA2_DIGITS).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    if args.lora:
        pipe.load_lora_weights(str(FOLDER / "lora" / "red_ink.safetensors"))
    preset = pipe.preset
    start = time.perf_counter()
    images, labels = generate(None, range(10), args.per_digit, preset.guidance_scale, preset.num_inference_steps,
                              seed=Seeds(args.seed).eval, trigger=TRIGGER if args.lora else None, device=args.device,
                              resolution=preset.resolution, pipe=pipe)
    sample_seconds = time.perf_counter() - start
    correct = reader.predict(images) == labels
    per_digit = {NAMES[d]: float(correct[labels == d].mean()) for d in range(10)}
    result = {"model": KREA2_DIGITS, "lora": args.lora, "per_digit": per_digit, "accuracy": float(correct.mean()),
              "samples": int(len(labels)), "sampling_seed_base": Seeds(args.seed).eval,
              "settings": {"resolution": preset.resolution, "steps": preset.num_inference_steps,
                           "guidance": preset.guidance_scale},
              "judge": args.judge or f"retrained (seed {args.seed})", "judge_seconds": round(judge_seconds, 1),
              "sample_seconds": round(sample_seconds, 1)}
    if args.lora:
        result["red_ink"] = float(np.mean(shows_red_ink(images)))
    for name, accuracy in per_digit.items():
        print(f"{name:>6}: {accuracy:.2f}")
    print(f"all: {result['accuracy']:.3f} of {len(labels)} samples"
          + (f", red ink {result['red_ink']:.2f}" if args.lora else "")
          + f" ({sample_seconds:.0f} s sampling, judge {judge_seconds:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    low = [name for name, accuracy in per_digit.items() if accuracy < args.min_accuracy]
    if low:
        print(f"below {args.min_accuracy}: {', '.join(low)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
