"""The 12.8B Krea 2 transformer for real, on this machine (CPU, or a GPU when one is there), with
random weights and the streamed quantized loader.

    python bench/full_size.py generate --quantize {fp8,int8,nf4,Q4_K} [--resolution 128] [--steps 2]
                                       [--checkpoint PATH] [--gguf PATH] [--json OUT]
    python bench/full_size.py train    --quantize {fp8,int8,nf4}      [--resolution 128] [--steps 2]
                                       [--checkpoint PATH] [--json OUT]

``--checkpoint``: the random full-size original-layout file (bench/full_size_models.py), created
there, tensor by tensor, if missing. ``generate`` makes one image (2 steps, guidance off, one
transformer forward a step) through ``krea2 generate`` with the transformer stored as fp8 / int8 /
nf4 (streamed in by block) or as a Q4_K GGUF written by ``krea2 quantize`` (streamed too; into the
temporary folder, or kept at ``--gguf PATH`` and read from there by the next run: ~4 min saved).
``train`` runs ``krea2 train``: LoRA r32 on the quantized base, batch 1, activation checkpointing,
then the LoRA export. ``--dtype auto`` (the default) computes in the project's policy's dtype
(krea2_diffusers/precision.py): bf16 on a GPU and on a CPU with bf16 units (AVX512-BF16 here: ~4x
float32's matmul rate; an earlier machine without them ran bf16 at a third of float32's), else
float32; training then runs ``model.dtype`` and ``mixed_precision`` in that dtype. ``--dtype
float32`` gives the earlier figures.

Measured: the peak anonymous RSS of the process tree (this process and its children, sampled
every 0.2 s) and the largest per-process high-water mark (``VmHWM`` / ``ru_maxrss``: catches the
short spikes sampling misses; see ``TreePeak``), the plan's host figure for the same setup
(``krea2 generate/train --dry-run``), seconds per step, the quantized transformer's bytes, the
roofline (bench/roofline.py: the machine's fp32 / bf16 matmul peaks measured in a child with the
run's thread count, and the transformer's achieved GFLOPS as a fraction of its dtype's peak; for
``train`` estimated from the step time, see ``TRAIN_FLOPS_PER_FORWARD``), and for ``train`` the
step losses and the exported LoRA files.

Recorded beside them (bench/full_size_record.py), so that two machines' figures can be told apart:
the CPU (``cpu``: its name, family and model, bf16 units, AMX flags and L3 bytes), the compute
dtype and why, the threads (torch's counts, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``,
the CPUs), the load average, memory, page cache and huge-page mode before and after, how much of
the checkpoint (and of the GGUF file loaded) was in the page cache before its load, the load's
seconds and CPU, each quantized layer class's expansion path, and the steady step split into parts
(``step_split``: generate ``forward`` / ``other``; train ``data`` / ``forward`` / ``backward`` /
``optimizer`` from the trainer's ``KREA2_STEP_SPLIT`` rows), each with wall, user and system CPU
seconds and minor page faults: CPU over wall shows idle threads, system time and faults show fresh
memory being handed out. ``generate`` also times the largest layer of each quantized class against
the matmul alone on its weight expanded beforehand (``layer_probe``).

``--small``: the same run on a 2-block transformer of the full size's head width (256 wide, SwiGLU
768: every matrix holds whole Q4_K blocks) reading the tiny text encoder, its checkpoint in the
temporary folder, written and probed in this process: seconds, for the test of the fields
(tests/test_full_size_bench.py); its figures mean nothing.
Everything besides ``--json`` and the checkpoint is written under a temporary folder that is removed.
Exit 0 only when the run completed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

from roofline import describe  # noqa: E402  (torch-free: this process imports torch only in ``generate``)
from tree_peak import TreePeak  # noqa: E402

DEFAULT_CHECKPOINT = Path.home() / ".cache" / "krea2-diffusers" / "krea2-full-size-random.safetensors"
GENERATE_MODES = ("fp8", "int8", "nf4", "Q4_K")
TRAIN_MODES = ("fp8", "int8", "nf4")
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
CLOCK_START = time.monotonic()  # the one clock of the peak sampler and the stamped log lines
GIB = 1024**3
# --small: the full size's head width and GQA ratio, 2 blocks, the tiny text encoder's width.
SMALL_CONFIG = dict(in_channels=64, num_layers=2, attention_head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=768, timestep_embed_dim=256, text_hidden_dim=32, num_text_layers=12,
                    text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
                    num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(32, 48, 48))
SMALL_PEAK_SIZE = 256  # matmul size of --small's peaks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode, choices in (("generate", GENERATE_MODES), ("train", TRAIN_MODES)):
        p = sub.add_parser(mode)
        p.add_argument("--quantize", required=True, choices=choices)
        p.add_argument("--resolution", type=int, default=128)
        p.add_argument("--steps", type=int, default=2)
        p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
        p.add_argument("--json", type=Path, default=None)
        if mode == "generate":
            p.add_argument("--gguf", type=Path, default=None,
                           help="Q4_K: the GGUF to read, written there by krea2 quantize when missing (default: a temporary one)")
        p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="compute dtype; auto: the project's policy (bf16 on CUDA and on CPUs with bf16 units)")
        p.add_argument("--small", action="store_true", help="a 2-block model of the same widths per head (see above)")
    return parser.parse_args(argv)


def _child_env() -> dict:
    """This checkout first on the path; ``krea2 train`` logs its steps' split (finetune/trainer.py)."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), KREA2_STEP_SPLIT="1")


def _krea2_here(args, log: Path) -> int:
    """``krea2 ARGS`` run in this process (``--small``: a child's start, torch's imports, took longer
    than the small run itself), its output and log records written to ``log``; the exit code."""
    import contextlib
    import logging

    from krea2_diffusers.cli import main as krea2_main

    os.environ["KREA2_STEP_SPLIT"] = "1"
    root = logging.getLogger()
    with open(log, "w") as handle, contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
        handler = logging.StreamHandler(handle)
        root.addHandler(handler)  # before the CLI's basicConfig, which then adds none of its own
        try:
            return krea2_main(list(args))
        except SystemExit as exit:
            return exit.code if isinstance(exit.code, int) else 1
        finally:
            root.removeHandler(handler)
            os.environ.pop("KREA2_STEP_SPLIT")


def _krea2(*args: str, log: Path, here: bool = False) -> str:
    """Run ``krea2 ARGS`` (this checkout's) as a child (``here``: in this process); its output is
    echoed and returned; a failure exits."""
    print("$ krea2 " + " ".join(args), flush=True)
    if here:
        code = _krea2_here(args, log)
    else:
        with open(log, "w") as handle:
            child = subprocess.Popen([sys.executable, "-m", "krea2_diffusers.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=_child_env(), cwd=str(ROOT), text=True, errors="replace")
            for line in child.stdout:  # each line stamped with TreePeak's clock, to place the peak in the run
                handle.write(f"[{time.monotonic() - CLOCK_START:8.1f} s] {line}")
            code = child.wait()
    text = log.read_text()
    print(text[-4000:], flush=True)
    if code != 0:
        raise SystemExit(f"krea2 {args[0]} failed (exit {code}); see the output above")
    return text


def _plan_bytes(text: str) -> int:
    match = re.search(r"host peak[^\n]*?([\d.]+) GiB", text)
    if not match:
        raise SystemExit("the dry run printed no host plan")
    return int(float(match.group(1)) * GIB)


def prepare(args, tmp: Path) -> dict:
    """Write the random checkpoint (when missing) and text encoder in a child, and ask another child
    (bench/full_size_record.py's ``machine_probe``) for the device, the config, the compute dtype and
    why, the threads and the matmul peaks: this process then holds no torch heap of its own
    (building the random text encoder left ~1.3 GiB resident here, which the tree's peak counted on
    top of the ``krea2 train`` child it measures). ``--small`` does both here: its figures are not
    what it is for."""
    quantize = args.quantize if args.mode == "train" else None
    if args.small:
        from full_size_models import write_random_checkpoint
        from full_size_record import machine_probe

        write_random_checkpoint(args.checkpoint, SMALL_CONFIG)
        return machine_probe(SMALL_CONFIG, SMALL_PEAK_SIZE, quantize, args.dtype)
    subprocess.run([sys.executable, str(ROOT / "bench" / "full_size_models.py"), str(args.checkpoint),
                    str(args.text_encoder)], check=True)
    call = f"machine_probe(None, None, {quantize!r}, {args.dtype!r})"
    code = f"import json, sys; sys.path.insert(0, sys.argv[1]); from full_size_record import machine_probe; print(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench")], check=True, capture_output=True,
                          text=True, env=_child_env())
    return json.loads(done.stdout.strip().splitlines()[-1])


def _steady_split(stamps: list, forwards: list) -> tuple[float, dict]:
    """Seconds per steady step and its split, from the Usage at each step's end (``stamps[0]``: the
    run's start) and each transformer call's Usage (``forwards``). The first step also pays one-time
    costs: the later ones are the steady figure (the first alone when there is one)."""
    from krea2_diffusers.cpu_usage import Usage

    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    per_step = max(1, len(forwards) // len(steps))
    calls = [sum(forwards[i * per_step:(i + 1) * per_step], Usage()) for i in range(len(steps))]
    first = 1 if len(steps) > 1 else 0
    n = len(steps) - first
    step, forward = sum(steps[first:], Usage()) / n, sum(calls[first:], Usage()) / n
    return step.wall, {"forward": forward.as_dict(), "other": (step - forward).as_dict()}


def generate(args, tmp: Path, device: str, machine: dict) -> dict:
    """One image in this process: plan, streamed quantized load, ``steps`` denoising steps."""
    import torch
    from full_size_record import dequant_paths, layer_probe, page_cache
    from roofline import TransformerMeter, roofline

    from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
    from krea2_diffusers.cpu_usage import Usage
    from krea2_diffusers.loaders.assembly import load_pipeline
    from krea2_diffusers.pipelines.host_memory import host_ram, plan_host_memory
    from krea2_diffusers.pipelines.memory import release_text_encoder
    from krea2_diffusers.quantization.gguf import resident_bytes

    from krea2_diffusers.heap import hold_freed_chunks

    hold_freed_chunks()  # as ``krea2 generate`` does before loading
    dtype = getattr(torch, args.dtype)
    model, quantization = args.checkpoint, args.quantize
    if args.quantize == "Q4_K":
        model, quantization = args.gguf or tmp / "krea2-Q4_K.gguf", None
        if model.exists():
            print(f"reading {model} (kept by an earlier run; delete it to quantize again)", flush=True)
        else:
            _krea2("quantize", str(args.checkpoint), str(model), "--type", "Q4_K", log=tmp / "quantize.log", here=args.small)
    tokens = (args.resolution // 16) ** 2 + len(PROMPT.split()) * 2
    plan = plan_host_memory(model, quantization, dtype, text_encoder=args.text_encoder, vae=None, tokens=tokens,
                            release_text_encoder=True)
    print(plan.render(host_ram(), []), flush=True)
    # As a 24 GB machine runs it: encode the prompt, drop the text encoder, then stream the transformer in.
    pipe = load_pipeline(Krea2Pipeline, str(model), text_encoder=str(args.text_encoder), vae="tiny-random",
                         torch_dtype=dtype, transformer=None)
    embeds, mask = pipe.encode_prompt([PROMPT], device=device)
    release_text_encoder(pipe)
    cache = page_cache(model)  # the file the transformer is read from, just before
    before = Usage.now()
    pipe.register_modules(transformer=Krea2Transformer2DModel.from_single_file(
        model, torch_dtype=dtype, quantization=quantization, device=device if device != "cpu" else None))
    load = Usage.now() - before
    print(f"transformer loaded in {load.wall:.0f} s ({100 * cache['resident_fraction']:.0f}% of "
          f"{Path(model).name} in the page cache before)", flush=True)
    stamps = [Usage.now()]

    def on_step(pipe, step, timestep, kwargs):
        stamps.append(Usage.now())
        print(f"step {step + 1}/{args.steps} at {stamps[-1].wall - stamps[0].wall:.0f} s", flush=True)
        return kwargs

    with TransformerMeter(pipe.transformer) as meter:
        image = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, height=args.resolution, width=args.resolution,
                     num_inference_steps=args.steps, guidance_scale=0.0, generator=torch.Generator(device).manual_seed(0),
                     callback_on_step_end=on_step).images[0]
    image.save(tmp / "image.png")
    seconds, split = _steady_split(stamps, meter.usages)
    forward = meter.usages[-1]
    peaks = roofline(meter.flops, meter.seconds, pipe.transformer.compute_dtype, machine)
    return dict(plan_host_bytes=plan.total, quantized_transformer_bytes=resident_bytes(pipe.transformer),
                seconds_per_step=seconds, step_split=split, load_seconds=load.wall, load_usage=load.as_dict(),
                page_cache_before_load={str(model): cache}, dequant_paths=dequant_paths(pipe.transformer),
                layer_probe=layer_probe(pipe.transformer, tokens, dtype),
                gflops_per_busy_thread=meter.flops / meter.calls / forward.user / 1e9 if forward.user else 0.0,
                **peaks)


TRAIN_CONFIG = """
output_dir: {out}
model:
  pretrained_model_name_or_path: {checkpoint}
  text_encoder: {text_encoder}
  vae: tiny-random
  dtype: {dtype}
  quantize: {quantize}
  max_sequence_length: {text_tokens}
data:
  synthetic: {{num_prompts: 2, size: {resolution}}}
  resolution: {resolution}
  caption_dropout: 0.0
training:
  method: lora
  max_steps: {steps}
  batch_size: 1
  seed: 0
  activation_checkpointing: full
  mixed_precision: {mixed_precision}
lora: {{rank: 32, alpha: 32, train_text_fusion: false}}  # the blocks only, as the README's figures were measured
optimizer: {{learning_rate: 1.0e-4}}
checkpointing: {{every_n_steps: 1000000}}
export:
  formats: [diffusers, comfyui, kohya]
"""


TRAIN_TEXT_TOKENS = 32
# Matmul FLOPs of a LoRA step per forward's: the forward, its recompute (full activation
# checkpointing) and the backward to the activations (the frozen base has no weight gradients;
# attention's backward, twice its forward, and the rank-32 LoRA's are left out: an estimate).
TRAIN_FLOPS_PER_FORWARD = 3


def train(args, tmp: Path, device: str, machine: dict) -> dict:
    from roofline import conditioning_flops, roofline, step_flops

    out = tmp / "run"
    config = tmp / "train.yaml"
    config.write_text(TRAIN_CONFIG.format(out=out, checkpoint=args.checkpoint, text_encoder=args.text_encoder,
                                          dtype=args.dtype, mixed_precision="bf16" if args.dtype == "bfloat16" else "no",
                                          quantize=args.quantize,
                                          resolution=args.resolution, steps=args.steps, text_tokens=TRAIN_TEXT_TOKENS))
    plan = _plan_bytes(_krea2("train", str(config), "--dry-run", log=tmp / "plan.log", here=args.small))
    text = _krea2("train", str(config), log=tmp / "train.log", here=args.small)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [float(r["loss"]) for r in rows]
    if len(losses) != args.steps or not all(l == l and abs(l) != float("inf") for l in losses):
        raise SystemExit(f"expected {args.steps} finite losses, got {losses}")
    exports = sorted(str(p) for p in out.glob("lora_*.safetensors"))  # the run folder's LoRA files (not its caches)
    if not exports:
        raise SystemExit(f"no LoRA export under {out}")
    quantized = int(re.search(r"transformer: (\d+) bytes", text).group(1))
    load = float(re.search(r"transformer loaded in ([\d.]+) s", text).group(1))
    # the first step also builds the optimizer state and warms up: the last step is the steady one
    seconds = float(rows[-1]["step_time"])
    split = rows[-1]["step_split"]
    busy = sum(split[part]["user"] for part in ("forward", "backward"))
    # text counted at max_sequence_length, as the dry-run plan does (an upper bound for shorter prompts)
    config, image_tokens = machine["config"], (args.resolution // 16) ** 2
    flops = TRAIN_FLOPS_PER_FORWARD * (step_flops(config, image_tokens, TRAIN_TEXT_TOKENS)
                                       + conditioning_flops(config, TRAIN_TEXT_TOKENS))
    dtype = args.dtype
    return dict(plan_host_bytes=plan, quantized_transformer_bytes=quantized, seconds_per_step=seconds,
                step_split=split, load_seconds=load, dequant_paths=machine["dequant_paths"],
                gflops_per_busy_thread=flops / busy / 1e9 if busy else 0.0,
                losses=losses, exports=exports, **roofline(flops, seconds, dtype, machine))


def _print_split(result: dict) -> None:
    parts = result["step_split"]
    total = sum(part["wall"] for part in parts.values())
    print(f"step {result['seconds_per_step']:.2f} s = " + " + ".join(
        f"{name} {part['wall']:.2f} (user {part['user']:.2f}, sys {part['system']:.2f}, {part['minor_faults']:.0f} faults)"
        for name, part in parts.items()) + f" = {total:.2f} s; {result['gflops_per_busy_thread']:.1f} GFLOPS per busy thread")
    for key, entry in result["dequant_paths"].items():
        probe = result.get("layer_probe", {}).get(key)
        timing = (f": {probe['layer']} {probe['forward_wall'] * 1e3:.0f} ms ({probe['forward_gflops']:.0f} GFLOPS), matmul "
                  f"alone {probe['matmul_wall'] * 1e3:.0f} ms, expansion {100 * probe['expansion_share']:.0f}%") if probe else ""
        print(f"  {key}{' x ' + str(entry['layers']) if 'layers' in entry else ''}: {entry['path']}{timing}")


def main(argv=None) -> int:
    from full_size_record import cpu_record, describe_cpu, machine_state, page_cache

    args = parse_args(argv)
    if args.small:  # its matrices take microseconds: a second thread only synchronises (krea2_diffusers/cpu_threads.py)
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="krea2-full-size-"))
    args.checkpoint = (tmp / "krea2-small-random.safetensors" if args.small else args.checkpoint).resolve()
    args.text_encoder = "tiny-random" if args.small else tmp / "text_encoder"
    if getattr(args, "gguf", None):  # krea2 quantize runs in the checkout (cwd=ROOT): a relative path meant this one
        args.gguf = args.gguf.resolve()
    try:
        machine = prepare(args, tmp)
        device = "cpu" if machine["device"] == "cpu" else "cuda"
        args.dtype = machine["compute_dtype"]
        print(f"compute dtype: {args.dtype} ({machine['compute_dtype_reason']}); threads {machine['threads']}", flush=True)
        cpu = cpu_record()
        print(f"cpu: {describe_cpu(cpu)}", flush=True)
        state, cache = machine_state(), page_cache(args.checkpoint)
        print(f"before the run: load average {state['load_average']}, {state['meminfo'].get('MemAvailable', 0) / GIB:.1f} GiB "
              f"available, {100 * cache['resident_fraction']:.0f}% of the checkpoint in the page cache", flush=True)
        with TreePeak(clock_start=CLOCK_START) as peak:
            result = (generate if args.mode == "generate" else train)(args, tmp, device, machine)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if args.small:
            torch.set_num_threads(threads)
    result = dict(peak_host_bytes=peak.peak, max_hwm_bytes=peak.max_hwm, device=machine["device"],
                  threads=machine["threads"], compute_dtype=args.dtype, compute_dtype_reason=machine["compute_dtype_reason"],
                  small=args.small, cpu=cpu, machine_before=state, machine_after=machine_state(),
                  page_cache_checkpoint_at_start=cache, **result)
    print(json.dumps(result, indent=2))
    result.update(peak_at_seconds=peak.peak_at, host_timeline=peak.timeline)
    print(f"{args.mode} {args.quantize}: peak host {peak.peak / GIB:.2f} GiB sampled, {peak.max_hwm / GIB:.2f} GiB "
          f"largest process high-water mark (plan {result['plan_host_bytes'] / GIB:.2f}), "
          f"quantized transformer {result['quantized_transformer_bytes'] / GIB:.2f} GiB, {result['seconds_per_step']:.1f} s/step, "
          f"load {result['load_seconds']:.0f} s ({100 * cache['resident_fraction']:.0f}% of the checkpoint cached at the start)")
    _print_split(result)
    print(describe(result, args.dtype))
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
