#!/usr/bin/env python
"""Step caches, the guidance interval and compiled blocks on a Krea 2 model (issue 40): how much of
the transformer each one skips, how much faster it samples, and what it costs in quality.

    python bench/bench_cache.py [--model krea2-digits] [--lora FILE] [--json OUT] [--per-digit 20]
        [--repeats 2] [--quick] [--side-by-side tiny,proportioned] [--size 128] [--no-compile]

Settings: 28 steps with CFG (--guidance, RAW presets) and 8 steps without (Turbo presets). For each
method and threshold (``none`` = uncached; ``guidance_interval`` = CFG only for t in [lo, hi], its
threshold the pair; ``magcache_calibrated`` = MagCache on ratios calibrated on this model and
setting, ``caching.magcache``) one JSON row:

    method, threshold, steps, guidance, lora (bool), forwards (full transformer forwards per image,
    ``caching.forwards``: 56 for 28 uncached CFG steps), seconds (best of --repeats, every
    configuration of the setting timed round-robin in this process), speedup (uncached seconds / these),
    accuracy and fd (the proving ground's judge, bench/proving/judge.py, against the real held-out digits;
    null for tiny-random), max_abs_diff (largest pixel difference, in [0, 1], to the uncached images of
    the same seeds), concept (with the LoRA: the share of images in its red ink, else null).

Samples: --per-digit images of each digit 0-9 with the proving ground's prompts and seeds
(proving.sampling.generate). --lora FILE: every row again with the LoRA loaded and its trigger in the
prompts (lora true). --model: a model folder or id (default the proving ground's base, ``krea2-digits``),
or tiny-random (random weights: forwards and times only).

Side by side (bench/cache_side_by_side.py), on tiny-random's weights and a proportioned config at
--size px, 28 steps with CFG: ours + each preset vs diffusers.Krea2Pipeline + cache-dit (wall ratio,
output difference), the peer check with identical tokens, and compiled blocks vs eager.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from krea2_diffusers.caching.apply import step_cache  # noqa: E402
from krea2_diffusers.caching.forwards import ForwardCounter  # noqa: E402

DEFAULT_MODEL = "krea2-digits"
SETTINGS = ({"steps": 28, "cfg": True, "distilled": False}, {"steps": 8, "cfg": False, "distilled": True})
GRID = {
    "fbcache": (0.05, 0.08, 0.12, 0.2), "taylorseer": (2, 3, 4), "magcache": (0.03, 0.06, 0.12),
    "magcache_calibrated": (0.03, 0.06, 0.12), "dbcache": (0.05, 0.08, 0.12, 0.2),
    "guidance_interval": ((0.1, 0.8), (0.2, 0.7), (0.0, 0.6), (0.3, 1.0)),
}
QUICK_GRID = {"fbcache": (0.08,), "taylorseer": (3,), "magcache": (0.06,), "magcache_calibrated": (0.06,),
              "dbcache": (0.08,), "guidance_interval": ((0.2, 0.7),)}


def load(model: str, device: str):
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.models.tiny import is_tiny

    if is_tiny(model):
        pipe = Krea2Pipeline.from_pretrained(model).to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    from proving.sampling import load_pipeline

    return load_pipeline(Path(model), device)


def configurations(cfg: bool, quick: bool) -> list[tuple[str, object]]:
    grid = QUICK_GRID if quick else GRID
    return [("none", None)] + [(m, v) for m, values in grid.items() if cfg or m != "guidance_interval" for v in values]


def sampler(pipe, method: str, value, setting: dict, ratios):
    """(pipe or a partial of it, the context to sample in) for one configuration."""
    steps, distilled = setting["steps"], setting["distilled"]
    if method == "guidance_interval":
        return functools.partial(pipe, guidance_interval=value), step_cache(pipe, "none")
    if method == "magcache_calibrated":
        return pipe, step_cache(pipe, "magcache", num_inference_steps=steps, threshold=value, distilled=distilled, mag_ratios=ratios)
    return pipe, step_cache(pipe, method, num_inference_steps=steps, threshold=value, distilled=distilled)


def run_setting(pipe, setting: dict, args, judge, lora: bool, trigger: str | None) -> list[dict]:
    """Every configuration of one setting, timed round-robin; the rows."""
    from krea2_diffusers.caching.magcache import calibrate_magcache
    from proving.digits import caption, shows_red_ink
    from proving.sampling import generate

    steps, guidance = setting["steps"], args.guidance if setting["cfg"] else 0.0
    sample = lambda p: generate(None, range(10), args.per_digit, guidance, steps, seed=0, trigger=trigger, device=args.device,
                                resolution=args.resolution, pipe=p)
    ratios = calibrate_magcache(pipe, steps, prompt=[caption(d, trigger) for d in range(10)], height=args.resolution,
                                width=args.resolution, guidance_scale=guidance, output_type="latent")
    configs = configurations(setting["cfg"], args.quick)
    pipe(prompt="warm-up", height=args.resolution, width=args.resolution, num_inference_steps=2, guidance_scale=guidance,
         output_type="latent")  # first-call costs (lazy inits, kernels for new shapes) stay out of the timings
    results: dict = {}
    for repeat in range(args.repeats):
        for key in configs:
            target, context = sampler(pipe, *key, setting, ratios)
            with ForwardCounter(pipe.transformer) as counter, context:
                start = time.perf_counter()
                images, labels = sample(target)
                seconds = time.perf_counter() - start
            if key not in results:
                results[key] = {"images": images, "labels": labels, "forwards": counter.forwards / len(labels), "seconds": seconds}
            results[key]["seconds"] = min(results[key]["seconds"], seconds)
    base = results[("none", None)]
    rows = []
    for (method, value), r in results.items():
        quality = judge.evaluate(r["images"], r["labels"]) if judge is not None else {"accuracy": None, "fd": None}
        rows.append({"method": method, "threshold": list(value) if isinstance(value, tuple) else value, "steps": steps,
                     "guidance": guidance, "lora": lora, "forwards": r["forwards"], "seconds": r["seconds"],
                     "speedup": base["seconds"] / r["seconds"], "accuracy": quality["accuracy"], "fd": quality["fd"],
                     "max_abs_diff": float(np.abs(r["images"].astype(np.int16) - base["images"]).max() / 255),
                     "concept": float(shows_red_ink(r["images"]).mean()) if lora else None})
    return rows


def side_by_side(args) -> list[dict]:
    from bench_pipeline import build
    from cache_side_by_side import compare, compile_check, peer_check, prompt_variants, same_tokens_call

    out = []
    for components in args.side_by_side:
        ours, theirs = build(components=components)
        tokens = (args.size // 16) ** 2
        call = dict(prompt="a red fox in the snow", height=args.size, width=args.size, num_inference_steps=28,
                    guidance_scale=args.guidance, output_type="latent",
                    latents=torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(0)))
        with torch.inference_mode():
            entry = {"components": components, "size": args.size, "steps": 28, "guidance": args.guidance,
                     **compare(ours, theirs, call, args.repeats),
                     "peer_check": peer_check(ours, theirs, same_tokens_call(ours, call, call["prompt"]))}
            if not args.no_compile:
                entry["compile"] = compile_check(ours, prompt_variants(call), args.repeats)
        out.append(entry)
        del ours, theirs
    return out


def print_rows(rows: list[dict]) -> None:
    print(f"{'method':<20} {'threshold':>10} {'steps':>5} {'cfg':>4} {'lora':>5} {'forwards':>9} {'seconds':>8} "
          f"{'speedup':>7} {'accuracy':>8} {'fd':>8} {'max diff':>8}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        threshold = "-" if r["threshold"] is None else str(r["threshold"])
        print(f"{r['method']:<20} {threshold:>10} {r['steps']:>5} {r['guidance']:>4} {str(r['lora']):>5} {r['forwards']:>9.2f} "
              f"{r['seconds']:>8.2f} {r['speedup']:>7.2f} {fmt(r['accuracy'], '.3f'):>8} {fmt(r['fd'], '.2f'):>8} "
              f"{r['max_abs_diff']:>8.3f}")


def print_side_by_side(entries: list[dict]) -> None:
    for e in entries:
        print(f"\n{e['components']} weights, {e['size']} px, {e['steps']} steps, CFG {e['guidance']}: diffusers "
              f"{e['seconds_diffusers']:.2f} s, diffusers + cache-dit {e['seconds_diffusers_cache_dit']:.2f} s")
        for method, r in e["ours"].items():
            print(f"  ours {method:<11} {r['seconds']:7.2f} s  ratio to diffusers+cache-dit {r['ratio_to_diffusers_cache_dit']:.3f}  "
                  f"rel diff to it {r['rel_diff_to_diffusers_cache_dit']:.2e}, to ours uncached {r['rel_diff_to_ours_uncached']:.2e}")
        peer = e["peer_check"]
        print(f"  peer check (same tokens, DBCache): ours separate CFG {peer['rel_diff_separate']:.2e}, "
              f"ours batched CFG {peer['rel_diff_batched']:.2e}; cached steps {peer['cache_dit']}")
        if "compile" in e:
            c = e["compile"]
            print(f"  compiled blocks: {c['seconds_compiled']:.2f} s vs eager {c['seconds_eager']:.2f} s "
                  f"(ratio {c['ratio_compiled_to_eager']:.3f}), max diff {c['max_abs_diff']:.1e}, "
                  f"first calls {c['first_calls']}, recompiles afterwards {c['recompiles_after_first_calls']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model folder or id, or tiny-random")
    parser.add_argument("--lora", type=Path, default=None, help="also every row with this LoRA loaded (its trigger in the prompts)")
    parser.add_argument("--json", type=Path, default=None, help="write {rows, side_by_side, ...} here")
    parser.add_argument("--per-digit", type=int, default=20, help="samples per digit and configuration")
    parser.add_argument("--resolution", type=int, default=64, help="sample size in px (the proving ground's 64)")
    parser.add_argument("--guidance", type=float, default=3.0, help="CFG of the 28-step setting (Krea convention)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (best of)")
    parser.add_argument("--judge-epochs", type=int, default=40, help="the judge's training epochs (the proving ground's 40)")
    parser.add_argument("--quick", action="store_true", help="one threshold per method")
    parser.add_argument("--side-by-side", type=lambda s: [c for c in s.split(",") if c], default=["tiny", "proportioned"],
                        help="components for the ours-vs-diffusers comparison (comma list; empty to skip)")
    parser.add_argument("--size", type=int, default=128, help="side-by-side image size in px")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled-blocks check")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from krea2_diffusers.models.tiny import is_tiny

    judge = None
    if not is_tiny(args.model):
        from proving.digits import load_splits
        from proving.judge import train_judge

        judge = train_judge(load_splits(args.resolution), epochs=args.judge_epochs)
    pipe = load(args.model, args.device)
    rows = []
    with torch.inference_mode():
        for setting in SETTINGS:
            rows += run_setting(pipe, setting, args, judge, lora=False, trigger=None)
        if args.lora is not None:
            from proving.lora import TRIGGER

            pipe.load_lora_weights(str(args.lora))
            for setting in SETTINGS:
                rows += run_setting(pipe, setting, args, judge, lora=True, trigger=TRIGGER)
    del pipe
    print(f"model {args.model}, {args.per_digit} samples per digit at {args.resolution} px, torch threads {torch.get_num_threads()}")
    print_rows(rows)
    entries = side_by_side(args)
    print_side_by_side(entries)
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump({"model": args.model, "per_digit": args.per_digit, "resolution": args.resolution, "rows": rows,
                       "side_by_side": entries}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
