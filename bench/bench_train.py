"""Training throughput and peak memory on the tiny-random model (CPU or GPU), LoRA and full FT.

    python bench/bench_train.py                  # 64 px, batch 4, 30 timed steps each
    python bench/bench_train.py --resolution 128 --steps 50 --json out.json

Steps/s counts optimizer steps after a warm-up; "peak" is the process's peak RSS during
the timed loop on CPU (whole process: the tiny pipeline is resident too), or torch's peak
allocated memory on GPU. Data comes from the latent/text cache
(built before timing), as in a real run.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config import build_config  # noqa: E402
from finetune.trainer import Trainer  # noqa: E402


def _rss_mib() -> float:
    """Current resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakRSS:
    """Samples the resident set every few ms on a thread: ru_maxrss only knows the whole process's
    peak (model loading included), not the training loop's."""

    def __enter__(self):
        self.base = self.peak = _rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())


def bench(method: str, args, root: Path) -> dict:
    config = build_config({
        "output_dir": str(root / method),
        "data": {"synthetic": {"num_prompts": 8, "size": args.resolution}, "resolution": args.resolution,
                 "cache_dir": str(root / "cache")},
        "training": {"method": method, "max_steps": args.warmup + args.steps, "batch_size": args.batch_size,
                     "gradient_checkpointing": args.gradient_checkpointing},
        "lora": {"rank": args.rank, "alpha": args.rank},
        "checkpointing": {"every_n_steps": 0},
        "logging": {"progress_bar": False, "tensorboard": False},
    })
    trainer = Trainer(config)
    trainer.setup()
    for step in range(args.warmup):
        trainer.train_step(step)
    cuda = trainer.runtime.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        start = time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss.peak
    trainable = sum(p.numel() for p in trainer.params)
    return {"method": method, "steps_per_s": args.steps / elapsed, "s_per_step": elapsed / args.steps,
            "peak_mib": peak, "peak_kind": "cuda_allocated" if cuda else "process_rss", "rss_before_mib": rss.base, "trainable_params": trainable,
            "threads": torch.get_num_threads(), "resolution": args.resolution, "batch_size": args.batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--methods", default="lora,full")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            results.append(bench(method, args, Path(tmp)))
    print(f"{'method':6} {'steps/s':>8} {'s/step':>8} {'peak MiB':>9} {'before':>8} {'trainable':>10}")
    for r in results:
        print(f"{r['method']:6} {r['steps_per_s']:8.2f} {r['s_per_step']:8.4f} {r['peak_mib']:9.1f} "
              f"{r['rss_before_mib']:8.1f} {r['trainable_params']:10d}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
