"""Cost of style references: 1, 3 and 10 references vs none, per denoising step and per image,
in "joint" and "cached" reference attention, and moodboards of 2 and 16 images.

Runs ``pipe(prompt, style_images=[...], style_strengths=[...])`` on the tiny random pipeline (or the
proportioned one of ``bench_pipeline.py`` with ``--proportioned``) and times every call with a
step callback, so the numbers split into

* per step: median time between consecutive step ends (the transformer pass; CFG batched);
* setup: time before the first step minus one step (text + vision encoding, reference VAE
  encoding, the transformer's step-independent preparation);
* per image: the whole call, decode included.

References are random images; the default strength 0.7 keeps the log-strength attention bias on
(``--strength 1`` takes the bias-free path). All references share one budget of
``--style-resolution``^2 pixels (default 512: 1024 tokens in total; 0 = each at the target's area,
the unbounded community workflow). "joint" puts the reference tokens into every step's sequence;
"cached" runs them once per image and every step only attends to their stored keys/values.
A moodboard is one board image of the budget: 2 and 16 images should cost the same.

    python bench/bench_references.py --proportioned --size 512 --attention cached joint --moodboards 2 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

REFERENCE_STRENGTH = 0.7
PROMPT = "a lighthouse on a cliff at dusk"


def reference_images(count: int, size: int) -> list[PIL.Image.Image]:
    rng = np.random.default_rng(0)
    return [PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def build(proportioned: bool, device: str, dtype: torch.dtype):
    from krea2_diffusers import Krea2Pipeline

    if proportioned:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_pipeline import build as build_pair

        pipe, _ = build_pair()
        if dtype != torch.float32:
            pipe = pipe.to(dtype=dtype)
    else:
        pipe = Krea2Pipeline.from_pretrained("tiny-random", dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def check_support(pipe) -> None:
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    missing = [name for name in ("style_images", "style_strengths", "reference_attention") if name not in params]
    if missing:
        raise SystemExit(f"Krea2Pipeline.__call__ has no {missing} yet: the pipeline's style-reference support has not landed")


def timed_call(pipe, sync, **kwargs) -> dict:
    """One generation, with the time of every step end."""
    ends: list[float] = []

    def on_step_end(_pipe, _step, _timestep, tensors):
        sync()
        ends.append(time.perf_counter())
        return tensors

    sync()
    start = time.perf_counter()
    pipe(callback_on_step_end=on_step_end, **kwargs)
    sync()
    total = time.perf_counter() - start
    steps = np.diff(ends).tolist()
    per_step = statistics.median(steps) if steps else ends[0] - start
    return dict(total=total, per_step=per_step, setup=max(0.0, ends[0] - start - per_step), decode=total - (ends[-1] - start))


def bench_parser(description: str, refs: list[int]) -> argparse.ArgumentParser:
    """The arguments of every reference bench (this one and ``bench_edit_references.py``): target
    size, steps, guidance, reference counts (default ``refs``), repeats, pipeline, device, dtype,
    threads. Each bench adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", type=int, default=256, help="target and reference side in pixels")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=3.5, help="Krea convention; 0 = off (Turbo)")
    parser.add_argument("--refs", type=int, nargs="+", default=refs)
    parser.add_argument("--repeats", type=int, default=2, help="best of N per setting (after one warm-up)")
    parser.add_argument("--proportioned", action="store_true", help="bench_pipeline.py's 1/16-width proportions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (tiny models on a busy CPU: 1 is steadier)")
    return parser


def bench_setup(args):
    """``(pipe, sync, base)`` for parsed :func:`bench_parser` arguments: the pipeline, the device
    synchronisation the timings wait on, and the keyword arguments every call shares."""
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = build(args.proportioned, args.device, getattr(torch, args.dtype))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    base = dict(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,
                guidance_scale=args.guidance, output_type="np")
    return pipe, sync, base


def timed_rounds(pipe, sync, calls: dict[str, dict], repeats: int) -> dict[str, list[dict]]:
    """:func:`timed_call` results of every setting of ``calls`` (name -> keyword arguments), ``repeats`` each."""
    runs = {name: [] for name in calls}
    with torch.inference_mode():
        # One warm-up each (and describe's cache), then rounds that visit every setting in turn, so
        # that load drifting on a shared machine hits every setting alike; best of the rounds.
        for round_index in range(repeats + 1):
            for name, kwargs in calls.items():
                result = timed_call(pipe, sync, generator=torch.Generator().manual_seed(0), **kwargs)
                if round_index:
                    runs[name].append(result)
    return runs


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0], refs=[0, 1, 3, 10])
    parser.add_argument("--mode", choices=("reference", "describe"), default="reference")
    parser.add_argument("--strength", type=float, default=REFERENCE_STRENGTH,
                        help="every reference's strength (1 = the bias-free path)")
    parser.add_argument("--attention", nargs="+", choices=("joint", "cached"), default=["cached", "joint"],
                        help="reference attention modes to time")
    parser.add_argument("--style-resolution", type=int, default=512, help="reference budget side in px (0 = unbounded)")
    parser.add_argument("--moodboards", type=int, nargs="*", default=[2, 16], help="moodboard sizes to time (cached)")
    args = parser.parse_args()

    pipe, sync, base = bench_setup(args)
    check_support(pipe)
    images = reference_images(max(args.refs), args.size)
    kind = "proportioned" if args.proportioned else "tiny-random"
    print(f"{kind} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads): {args.size}x{args.size}, "
          f"{args.steps} steps, CFG {args.guidance}, mode {args.mode}, strength {args.strength}")
    budget = args.style_resolution or None
    print(f"reference budget: {'target area per reference' if budget is None else f'{budget}^2 px shared'}")
    print(f"{'setting':>16} {'per step ms':>12} {'x none':>7} {'setup ms':>9} {'per image s':>12} {'x none':>7}")
    settings = [("none", {})]
    for count in (c for c in args.refs if c):
        for attention in args.attention:
            settings.append((f"{count} refs {attention}", dict(
                style_images=images[:count], style_strengths=[args.strength] * count, reference_attention=attention)))
    for count in args.moodboards:
        board = reference_images(count, args.size)
        settings.append((f"board {count} cached", dict(style_images=board, style_strengths=args.strength,
                                                        style_moodboard=True, reference_attention="cached")))
    calls = {}
    for name, extra in settings:
        kwargs = dict(base, **extra)
        if extra:
            kwargs.update(style_mode=args.mode, style_resolution=budget)
        calls[name] = kwargs
    runs = timed_rounds(pipe, sync, calls, args.repeats)
    baseline = None
    for name, results in runs.items():
        best = min(results, key=lambda r: r["total"])
        step = min(r["per_step"] for r in results)
        if baseline is None:
            baseline = (step, best["total"])
        print(f"{name:>16} {step * 1e3:>12.1f} {step / baseline[0]:7.2f} {best['setup'] * 1e3:>9.1f} "
              f"{best['total']:>12.3f} {best['total'] / baseline[1]:7.2f}", flush=True)


if __name__ == "__main__":
    main()
