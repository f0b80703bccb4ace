"""Cost of style references: 1, 3 and 10 references vs none, per denoising step and per image.

Runs ``pipe(prompt, style_images=[...], style_strengths=[...])`` on the tiny random pipeline (or the
proportioned one of ``bench_pipeline.py`` with ``--proportioned``) and times every call with a
step callback, so the numbers split into

* per step: median time between consecutive step ends (the transformer pass; CFG batched);
* setup: time before the first step minus one step (text + vision encoding, reference VAE
  encoding, the transformer's step-independent preparation);
* per image: the whole call, decode included.

References are random images; the default strength 0.7 keeps the log-strength attention bias on
(``--strength 1`` takes the bias-free path). Reference latents are encoded at the target's pixel area, so each
reference adds about as many tokens as the target image: expect the per-step cost to grow
faster than linearly (attention) with the number of references.

    python bench/bench_references.py [--size 256] [--steps 4] [--refs 0 1 3 10] [--mode reference]
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
        pipe = Krea2Pipeline.from_pretrained("tiny-random", torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def check_support(pipe) -> None:
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    missing = [name for name in ("style_images", "style_strengths") if name not in params]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="target (and reference) side in pixels")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=3.5, help="Krea convention; 0 = off (Turbo)")
    parser.add_argument("--refs", type=int, nargs="+", default=[0, 1, 3, 10])
    parser.add_argument("--mode", choices=("reference", "describe"), default="reference")
    parser.add_argument("--strength", type=float, default=REFERENCE_STRENGTH,
                        help="every reference's strength (1 = the bias-free path)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N per setting (after one warm-up)")
    parser.add_argument("--proportioned", action="store_true", help="bench_pipeline.py's 1/16-width proportions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (tiny models on a busy CPU: 1 is steadier)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pipe = build(args.proportioned, args.device, getattr(torch, args.dtype))
    check_support(pipe)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    base = dict(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,
                guidance_scale=args.guidance, output_type="np")
    images = reference_images(max(args.refs), args.size)
    kind = "proportioned" if args.proportioned else "tiny-random"
    print(f"{kind} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads): {args.size}x{args.size}, "
          f"{args.steps} steps, CFG {args.guidance}, mode {args.mode}, strength {args.strength}")
    print(f"{'refs':>4} {'per step ms':>12} {'x none':>7} {'setup ms':>9} {'per image s':>12} {'x none':>7}")
    baseline = None
    with torch.inference_mode():
        for count in args.refs:
            kwargs = dict(base)
            if count:
                kwargs.update(style_images=images[:count], style_strengths=[args.strength] * count, style_mode=args.mode)
            timed_call(pipe, sync, generator=torch.Generator().manual_seed(0), **kwargs)  # warm-up (and describe's cache)
            runs = [timed_call(pipe, sync, generator=torch.Generator().manual_seed(0), **kwargs) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["total"])
            step = min(r["per_step"] for r in runs)
            if count == 0:
                baseline = (step, best["total"])
            ratio_step = f"{step / baseline[0]:7.2f}" if baseline else f"{'-':>7}"
            ratio_total = f"{best['total'] / baseline[1]:7.2f}" if baseline else f"{'-':>7}"
            print(f"{count:>4} {step * 1e3:>12.1f} {ratio_step} {best['setup'] * 1e3:>9.1f} {best['total']:>12.3f} {ratio_total}")


if __name__ == "__main__":
    main()
