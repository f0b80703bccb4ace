"""Ours + each step cache vs ``diffusers.Krea2Pipeline`` + cache-dit on the same weights, and compiled blocks vs eager.

Used by bench/bench_cache.py (tiny-random's and a proportioned config on the CPU) and
bench/device/bench_cache_full.py (the full-size model at 1024 px on a GPU). Every figure comes from
the final packed latents (``callback_on_step_end``, before decoding) of the same noise:

* :func:`compare`: wall time (best of ``repeats``, all configurations round-robin in this process)
  of ours uncached and with each preset (``caching.presets``), and of diffusers' pipeline uncached
  and with cache-dit's DBCache at the same preset; per configuration of ours the full transformer
  forwards per image (``caching.forwards``), the ratio to diffusers + cache-dit and the relative
  difference ``||a - b|| / ||b||`` to it and to ours uncached.
* :func:`peer_check`: the same cache-dit settings on both pipelines with identical text tokens (diffusers pads prompts
  to 512 tokens, which changes cache-dit's residual statistics, so the check passes prompt embeddings):
  ours with ``batch_cfg=False`` (separate CFG calls, like diffusers') must match diffusers + cache-dit
  closely; ours batched decides for both branches at once, so it may cache other steps.
* :func:`forward_parity`: one transformer forward of each on identical inputs, both against ours in
  float32: whether a difference of the final latents is the low precision's rounding (each as far from
  float32 as the other) or a defect (one far from float32).
* :func:`compile_check`: ``compile_blocks`` vs eager on the same pipeline (``torch.compiler.set_stance``),
  across calls with CFG on and off and two prompt lengths: max difference, wall ratio, and the frames
  compiled by the first call of each layout and by every later call (recompilations).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_pipeline import FinalLatents, relative_diff  # noqa: E402

from krea2_diffusers.caching.apply import compile_blocks, step_cache  # noqa: E402
from krea2_diffusers.caching.forwards import ForwardCounter  # noqa: E402
from krea2_diffusers.models.transformer import Krea2Transformer2DModel  # noqa: E402

OURS_METHODS = ("none", "fbcache", "taylorseer", "magcache", "dbcache")


def compiled_frames() -> int:
    """How many frames ``torch.compile`` has compiled in this process so far, recompilations included
    (dynamo's own counter): the difference around a call is what that call (re)compiled."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def final_latents(pipe, call: dict) -> tuple[torch.Tensor, float]:
    """One call: its final latents (float32, CPU) and wall seconds; the noise is copied (a pipeline may update it in place)."""
    final = FinalLatents()
    sync = torch.cuda.synchronize if call["latents"].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    pipe(**dict(call, latents=call["latents"].clone()), callback_on_step_end=final, callback_on_step_end_tensor_inputs=["latents"])
    sync()
    return final.latents.cpu(), time.perf_counter() - start


def timed_runs(runs: dict, call: dict, steps: int, repeats: int) -> dict:
    """``runs``: label -> (pipe, cache method). Round-robin ``repeats`` times after one warm-up round;
    label -> (latents, best seconds, full transformer forwards per image: ours only, else None)."""
    out: dict = {}
    for repeat in range(repeats + 1):
        for label, (pipe, method) in runs.items():
            ours = isinstance(pipe.transformer, Krea2Transformer2DModel)
            with step_cache(pipe, method, num_inference_steps=steps, distilled=False), \
                    (ForwardCounter(pipe.transformer) if ours else contextlib.nullcontext()) as counter:
                latents, seconds = final_latents(pipe, call)
            if repeat and (label not in out or seconds < out[label][1]):
                out[label] = (latents, seconds, counter.forwards / latents.shape[0] if ours else None)
    return out


def compare(ours, theirs, call: dict, repeats: int, methods=OURS_METHODS) -> dict:
    """Ours + each method and diffusers + cache-dit (see the module docstring)."""
    steps = call["num_inference_steps"]
    runs = {f"ours_{m}": (ours, m) for m in methods}
    runs.update(diffusers_none=(theirs, "none"), diffusers_dbcache=(theirs, "dbcache"))
    done = timed_runs(runs, call, steps, repeats)
    peer, peer_seconds, _ = done["diffusers_dbcache"]
    result = {"seconds_diffusers": done["diffusers_none"][1], "seconds_diffusers_cache_dit": peer_seconds,
              "diffusers_cache_dit_rel_diff_to_uncached": relative_diff(peer, done["diffusers_none"][0]), "ours": {}}
    for method in methods:
        latents, seconds, forwards = done[f"ours_{method}"]
        result["ours"][method] = {"seconds": seconds, "forwards": forwards, "ratio_to_diffusers_cache_dit": seconds / peer_seconds,
                                  "rel_diff_to_diffusers_cache_dit": relative_diff(latents, peer),
                                  "rel_diff_to_ours_uncached": relative_diff(latents, done["ours_none"][0])}
    return result


def same_tokens_call(ours, call: dict, prompt: str) -> dict:
    """``call`` with prompt embeddings instead of text: the negative ("") padded (masked) to the prompt's length."""
    embeds, mask = ours.encode_prompt(prompt)
    negative, negative_mask = ours.encode_prompt("")
    pad = embeds.shape[1] - negative.shape[1]
    negative = torch.cat([negative, negative.new_zeros(negative.shape[0], pad, *negative.shape[2:])], 1)
    negative_mask = torch.cat([negative_mask, negative_mask.new_zeros(negative_mask.shape[0], pad)], 1)
    call = {k: v for k, v in call.items() if k != "prompt"}
    return dict(call, prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative,
                negative_prompt_embeds_mask=negative_mask)


def peer_check(ours, theirs, call: dict, **cache) -> dict:
    """cache-dit's DBCache (``step_cache`` "dbcache", ``cache`` e.g. threshold) on ours, separate and batched
    CFG, and on diffusers', with identical tokens (``call`` holds prompt embeddings: :func:`same_tokens_call`).
    Relative differences to diffusers + cache-dit and the cached steps each counted."""
    import cache_dit

    steps = call["num_inference_steps"]
    out, stats = {}, {}
    for label, pipe, batched in (("diffusers", theirs, None), ("ours_separate", ours, False), ("ours_batched", ours, True)):
        saved = getattr(pipe, "batch_cfg", None)
        if batched is not None:
            pipe.batch_cfg = batched
        try:
            with step_cache(pipe, "dbcache", num_inference_steps=steps, distilled=False, **cache):
                out[label] = final_latents(pipe, call)[0]
                summary = cache_dit.summary(pipe, details=False, logging=False)[0]
        finally:
            if batched is not None:
                pipe.batch_cfg = saved
        stats[label] = {"cached_steps": list(summary.cached_steps), "cfg_cached_steps": list(summary.cfg_cached_steps),
                        "steps_counted": summary.accumulated_executed_steps}
    return {"rel_diff_separate": relative_diff(out["ours_separate"], out["diffusers"]),
            "rel_diff_batched": relative_diff(out["ours_batched"], out["diffusers"]), "cache_dit": stats}


def forward_parity(ours, theirs, call: dict) -> dict:
    """One conditional forward of ``ours`` and ``theirs`` (transformers in a low precision, same weights)
    at t = 0.5 on ``call``'s noise and prompt embeddings, and of ours cast to float32 in place (it stays
    float32: run this last). Relative differences ``||a - b|| / ||b||``."""
    from krea2_diffusers.latents import position_ids

    latents, embeds = call["latents"], call["prompt_embeds"]
    grid = int(round(latents.shape[1] ** 0.5))
    inputs = dict(hidden_states=latents.to(embeds.dtype), encoder_hidden_states=embeds, timestep=torch.full((1,), 0.5, device=latents.device),
                  position_ids=position_ids(embeds.shape[1], grid, grid, latents.device),
                  encoder_attention_mask=call["prompt_embeds_mask"], return_dict=False)
    low_ours, low_theirs = (model(**inputs)[0].float() for model in (ours, theirs))
    reference = ours.float()(**{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                for k, v in inputs.items()})[0]
    return {"ours_vs_diffusers": relative_diff(low_ours, low_theirs), "ours_vs_float32": relative_diff(low_ours, reference),
            "diffusers_vs_float32": relative_diff(low_theirs, reference)}


def prompt_variants(call: dict) -> dict:
    """A text call with CFG, without, and with a longer prompt: the layouts :func:`compile_check` runs."""
    return {"cfg": call, "no_cfg": dict(call, guidance_scale=0.0),
            "cfg_long_prompt": dict(call, prompt=call["prompt"] + ", a longer prompt with more tokens in it")}


def compile_check(pipe, variants: dict, repeats: int) -> dict:
    """Compiled blocks vs eager on ``pipe`` (compiled in place; eager runs under ``set_stance("force_eager")``).
    ``variants``: name -> call (e.g. :func:`prompt_variants`); the first is the one timed."""
    eager = {name: final_latents(pipe, v)[0] for name, v in variants.items()}
    compile_blocks(pipe.transformer)
    frames, first = compiled_frames(), {}
    for name, v in variants.items():  # the first call of each: compiles a layout, or reuses one
        latents, _ = final_latents(pipe, v)
        first[name] = {"frames_compiled": compiled_frames() - frames, "max_abs_diff": float((latents - eager[name]).abs().max())}
        frames = compiled_frames()
    timed = next(iter(variants.values()))
    seconds = {"eager": float("inf"), "compiled": float("inf")}
    for _ in range(repeats):  # alternating, same process
        with torch.compiler.set_stance("force_eager"):
            seconds["eager"] = min(seconds["eager"], final_latents(pipe, timed)[1])
        seconds["compiled"] = min(seconds["compiled"], final_latents(pipe, timed)[1])
    for v in variants.values():  # every layout again: nothing may compile now
        final_latents(pipe, v)
    return {"seconds_eager": seconds["eager"], "seconds_compiled": seconds["compiled"],
            "ratio_compiled_to_eager": seconds["compiled"] / seconds["eager"], "first_calls": first,
            "max_abs_diff": max(v["max_abs_diff"] for v in first.values()),
            "recompiles_after_first_calls": compiled_frames() - frames}
