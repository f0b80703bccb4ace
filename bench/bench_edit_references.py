"""Per-step cost of general reference images (edit LoRAs) with and without the kv cache: 1 and 3
references in "joint" reference attention (the reference tokens join every step's sequence) and
"cached" (their keys/values computed once per generation; every step attends to them), in the same
process, printed as ratios.

Runs ``pipe(prompt, reference_images=[...], reference_attention=...)`` on the tiny random pipeline
(or ``bench_pipeline.py``'s proportioned one with ``--proportioned``); each reference is a random
image of the target's size, kept at its own size (``reference_max_pixels``), so R = N tokens per
reference. Timing as ``bench_references.py``: median time between step ends (per step), setup
(encoders, reference VAE encoding and, when cached, the references' own pass), whole call.

    python bench/bench_edit_references.py --proportioned --size 256 --threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_references import bench_parser, bench_setup, reference_images, timed_rounds  # noqa: E402


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0], refs=[1, 3]).parse_args()
    pipe, sync, base = bench_setup(args)
    images = reference_images(max(args.refs), args.size)
    calls = {"none": base}
    for count in args.refs:
        for attention in ("joint", "cached"):
            calls[f"{count} refs {attention}"] = dict(base, reference_images=images[:count], reference_attention=attention)
    runs = timed_rounds(pipe, sync, calls, args.repeats)
    step = {name: min(r["per_step"] for r in results) for name, results in runs.items()}
    setup = {name: min(r["setup"] for r in results) for name, results in runs.items()}
    kind = "proportioned" if args.proportioned else "tiny-random"
    tokens = (args.size // 16) ** 2
    print(f"{kind} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads): {args.size}x{args.size} "
          f"({tokens} image tokens, {tokens} per reference), {args.steps} steps, CFG {args.guidance}")
    print(f"{'setting':>16} {'per step ms':>12} {'x none':>7} {'setup ms':>9}")
    for name in calls:
        print(f"{name:>16} {step[name] * 1e3:>12.1f} {step[name] / step['none']:7.2f} {setup[name] * 1e3:>9.1f}")
    for count in args.refs:
        joint, cached = step[f"{count} refs joint"], step[f"{count} refs cached"]
        print(f"{count} reference(s): cached per step is {joint / cached:.2f}x faster than joint")


if __name__ == "__main__":
    main()
