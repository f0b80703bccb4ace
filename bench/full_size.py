"""The 12.8B Krea 2 transformer for real, on this machine (CPU, or a GPU when one is there), with
random weights and the streamed quantized loader.

    python bench/full_size.py generate --quantize {fp8,int8,nf4,Q4_K} [--resolution 128] [--steps 2]
                                       [--checkpoint PATH] [--json OUT]
    python bench/full_size.py train    --quantize {fp8,int8,nf4}      [--resolution 128] [--steps 2]
                                       [--checkpoint PATH] [--json OUT]

``--checkpoint``: the random full-size original-layout file (bench/full_size_models.py), created
there, tensor by tensor, if missing. ``generate`` makes one image (2 steps, guidance off, one
transformer forward a step) through ``krea2 generate`` with the transformer stored as fp8 / int8 /
nf4 (streamed in by block) or as a Q4_K GGUF written by ``krea2 quantize`` (streamed too).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

from roofline import describe  # noqa: E402  (torch-free: this process imports torch only in ``generate``)

DEFAULT_CHECKPOINT = Path.home() / ".cache" / "krea2-diffusers" / "krea2-full-size-random.safetensors"
GENERATE_MODES = ("fp8", "int8", "nf4", "Q4_K")
TRAIN_MODES = ("fp8", "int8", "nf4")
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
CLOCK_START = time.monotonic()  # the one clock of the peak sampler and the stamped log lines
GIB = 1024**3


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
        p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="compute dtype; auto: the project's policy (bf16 on CUDA and on CPUs with bf16 units)")
    return parser.parse_args(argv)


def _memory_field(path: str, field: str) -> int:
    """``field`` (kB) of /proc/PID/status or smaps_rollup, in bytes; 0 once the process has ended."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # the process ended between listing and reading
    return 0


class TreePeak:
    """Samples the anonymous memory of this process and all its descendants (every 0.2 s), and
    reads the kernel's per-process high-water marks, which no sampling interval can miss.

    ``peak`` (sampled): one process: its anonymous RSS. Several (the trainer's data-loader workers
    are forked after the model is loaded and share its pages copy-on-write, so their RSS repeats
    the parent's): the sum of each one's proportional share (``Pss_Anon``, shared pages divided
    among the sharers), which counts every page once; reading it walks the page tables, so only
    then. A spike shorter than the interval (a dequantized matrix) can fall between two samples.

    ``max_hwm`` (exact per process, not a sum): the largest ``VmHWM`` of any process of the tree
    during the run, i.e. its peak RSS (anonymous and file-backed pages: mapped checkpoint pages
    count). This process's own at the end; the children's polled each interval (the mark only
    grows, so a poll misses only a child's last interval) and, for those that ended and were waited
    for, the kernel's ``ru_maxrss`` of ``RUSAGE_CHILDREN`` (the largest waited-for descendant's peak
    RSS; it includes children that ended before the run, so it counts only when it grew during it)."""

    def __init__(self, interval: float = 0.2, every: float = 5.0):
        self.interval, self.peak, self.max_hwm = interval, 0, 0
        self.peak_at = 0.0  # seconds on CLOCK_START (the child's log lines carry the same clock)
        self.timeline: list[tuple[float, int]] = []  # (seconds, bytes) every ``every`` s: where the peak sits
        self._every = every
        self._done = threading.Event()
        self._waited_before = 0

    def _tree(self) -> list[int]:
        import psutil

        me = psutil.Process()
        return [me.pid] + [c.pid for c in me.children(recursive=True)]

    def _sample(self) -> None:
        while not self._done.is_set():
            pids = self._tree()
            rss = {pid: _memory_field(f"/proc/{pid}/status", "RssAnon:") for pid in pids}
            self.max_hwm = max([self.max_hwm] + [_memory_field(f"/proc/{pid}/status", "VmHWM:") for pid in pids])
            if sum(1 for size in rss.values() if size > 64 * 2**20) > 1:
                total = sum(_memory_field(f"/proc/{pid}/smaps_rollup", "Pss_Anon:") for pid in pids)
            else:
                total = sum(rss.values())
            now = time.monotonic() - CLOCK_START
            if total > self.peak:
                self.peak, self.peak_at = total, now
            if not self.timeline or now - self.timeline[-1][0] >= self._every:
                self.timeline.append((round(now, 1), total))
            self._done.wait(self.interval)

    def __enter__(self):
        self._waited_before = _waited_children_peak()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        waited = _waited_children_peak()
        own = _memory_field("/proc/self/status", "VmHWM:")
        self.max_hwm = max(self.max_hwm, own, waited if waited > self._waited_before else 0)


def _waited_children_peak() -> int:
    """Peak RSS (bytes) of the largest descendant that ended and was waited for (Linux: kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _krea2(*args: str, log: Path) -> str:
    """Run ``krea2 ARGS`` (this checkout's) as a child; its output is echoed and returned; a failure exits."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ krea2 " + " ".join(args), flush=True)
    with open(log, "w") as handle:
        child = subprocess.Popen([sys.executable, "-m", "krea2_diffusers.cli", *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), text=True, errors="replace")
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


PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from roofline import machine_peaks
from krea2_diffusers import Krea2Transformer2DModel
from krea2_diffusers.precision import choose_compute_dtype
cuda = torch.cuda.is_available()
chosen = choose_compute_dtype("cuda" if cuda else "cpu")
with torch.device("meta"):
    config = dict(Krea2Transformer2DModel().config)
print(json.dumps(dict(device=torch.cuda.get_device_name() if cuda else "cpu", config=config,
                      compute_dtype=str(chosen.dtype).removeprefix("torch."), compute_dtype_reason=chosen.reason,
                      threads=torch.get_num_threads(), **machine_peaks("cuda" if cuda else "cpu"))))
"""


def prepare(checkpoint: Path, text_encoder: Path) -> dict:
    """Write the random checkpoint (when missing) and text encoder in a child, and ask another child
    for the device the run uses ("cpu" or the GPU's name), the full-size config and the machine's
    matmul peaks (bench/roofline.py; default threads, as the run's): this process then holds no
    torch heap of its own (building the random text encoder left ~1.3 GiB resident here, which the
    tree's peak counted on top of the ``krea2 train`` child it measures)."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "full_size_models.py"), str(checkpoint), str(text_encoder)],
                   check=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "bench")], check=True, capture_output=True,
                          text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def generate(args, tmp: Path, device: str, machine: dict) -> dict:
    """One image in this process: plan, streamed quantized load, ``steps`` denoising steps."""
    import torch
    from roofline import TransformerMeter, roofline

    from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
    from krea2_diffusers.loaders.assembly import load_pipeline
    from krea2_diffusers.pipelines.host_memory import host_ram, plan_host_memory
    from krea2_diffusers.pipelines.memory import release_text_encoder
    from krea2_diffusers.quantization.gguf import resident_bytes

    dtype = getattr(torch, args.dtype)
    model, quantization = args.checkpoint, args.quantize
    if args.quantize == "Q4_K":
        model, quantization = tmp / "krea2-Q4_K.gguf", None
        _krea2("quantize", str(args.checkpoint), str(model), "--type", "Q4_K", log=tmp / "quantize.log")
    tokens = (args.resolution // 16) ** 2 + len(PROMPT.split()) * 2
    plan = plan_host_memory(model, quantization, dtype, text_encoder=tmp / "text_encoder", vae=None, tokens=tokens,
                            release_text_encoder=True)
    print(plan.render(host_ram(), []), flush=True)
    # As a 24 GB machine runs it: encode the prompt, drop the text encoder, then stream the transformer in.
    pipe = load_pipeline(Krea2Pipeline, str(model), text_encoder=str(tmp / "text_encoder"), vae="tiny-random",
                         torch_dtype=dtype, transformer=None)
    embeds, mask = pipe.encode_prompt([PROMPT], device=device)
    release_text_encoder(pipe)
    start = time.perf_counter()
    pipe.register_modules(transformer=Krea2Transformer2DModel.from_single_file(
        model, torch_dtype=dtype, quantization=quantization, device=device if device != "cpu" else None))
    print(f"transformer loaded in {time.perf_counter() - start:.0f} s", flush=True)
    stamps = []

    def on_step(pipe, step, timestep, kwargs):
        stamps.append(time.perf_counter())
        print(f"step {step + 1}/{args.steps} at {stamps[-1] - start:.0f} s", flush=True)
        return kwargs

    start = time.perf_counter()
    with TransformerMeter(pipe.transformer) as meter:
        image = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, height=args.resolution, width=args.resolution,
                     num_inference_steps=args.steps, guidance_scale=0.0, generator=torch.Generator(device).manual_seed(0),
                     callback_on_step_end=on_step).images[0]
    image.save(tmp / "image.png")
    # the first step also pays one-time costs: the later ones are the steady figure
    steps = [b - a for a, b in zip(stamps, stamps[1:])] or [stamps[0] - start]
    return dict(plan_host_bytes=plan.total, quantized_transformer_bytes=resident_bytes(pipe.transformer),
                seconds_per_step=sum(steps) / len(steps),
                **roofline(meter.flops, meter.seconds, pipe.transformer.compute_dtype, machine))


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
lora: {{rank: 32, alpha: 32}}
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
    config.write_text(TRAIN_CONFIG.format(out=out, checkpoint=args.checkpoint, text_encoder=tmp / "text_encoder",
                                          dtype=args.dtype, mixed_precision="bf16" if args.dtype == "bfloat16" else "no",
                                          quantize=args.quantize,
                                          resolution=args.resolution, steps=args.steps, text_tokens=TRAIN_TEXT_TOKENS))
    plan = _plan_bytes(_krea2("train", str(config), "--dry-run", log=tmp / "plan.log"))
    text = _krea2("train", str(config), log=tmp / "train.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [float(r["loss"]) for r in rows]
    if len(losses) != args.steps or not all(l == l and abs(l) != float("inf") for l in losses):
        raise SystemExit(f"expected {args.steps} finite losses, got {losses}")
    exports = sorted(str(p) for p in out.glob("lora_*.safetensors"))  # the run folder's LoRA files (not its caches)
    if not exports:
        raise SystemExit(f"no LoRA export under {out}")
    quantized = int(re.search(r"transformer: (\d+) bytes", text).group(1))
    # the first step also builds the optimizer state and warms up: the last step is the steady one
    seconds = float(rows[-1]["step_time"])
    # text counted at max_sequence_length, as the dry-run plan does (an upper bound for shorter prompts)
    config, image_tokens = machine["config"], (args.resolution // 16) ** 2
    flops = TRAIN_FLOPS_PER_FORWARD * (step_flops(config, image_tokens, TRAIN_TEXT_TOKENS)
                                       + conditioning_flops(config, TRAIN_TEXT_TOKENS))
    dtype = args.dtype
    return dict(plan_host_bytes=plan, quantized_transformer_bytes=quantized, seconds_per_step=seconds,
                losses=losses, exports=exports, **roofline(flops, seconds, dtype, machine))


def main(argv=None) -> int:
    args = parse_args(argv)
    args.checkpoint = args.checkpoint.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="krea2-full-size-"))
    try:
        machine = prepare(args.checkpoint, tmp / "text_encoder")
        device = "cpu" if machine["device"] == "cpu" else "cuda"
        if args.dtype == "auto":
            args.dtype = machine["compute_dtype"]
            print(f"compute dtype: {args.dtype} ({machine['compute_dtype_reason']})", flush=True)
        with TreePeak() as peak:
            result = (generate if args.mode == "generate" else train)(args, tmp, device, machine)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = dict(peak_host_bytes=peak.peak, max_hwm_bytes=peak.max_hwm, device=machine["device"],
                  threads=machine["threads"], compute_dtype=args.dtype, **result)
    print(json.dumps(result, indent=2))
    result.update(peak_at_seconds=peak.peak_at, host_timeline=peak.timeline)
    print(f"{args.mode} {args.quantize}: peak host {peak.peak / GIB:.2f} GiB sampled, {peak.max_hwm / GIB:.2f} GiB "
          f"largest process high-water mark (plan {result['plan_host_bytes'] / GIB:.2f}), "
          f"quantized transformer {result['quantized_transformer_bytes'] / GIB:.2f} GiB, {result['seconds_per_step']:.1f} s/step")
    print(describe(result, args.dtype))
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
