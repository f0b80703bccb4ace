"""Pretraining throughput of the tiny recipe: AdamW vs Muon, with and without iREPA, side by side.

    python bench/bench_pretrain.py                 # 64 px, batch 4, 20 timed steps per variant
    python bench/bench_pretrain.py --steps 50 --resolution 128 --batch-size 2

Each variant runs the real loop pieces (pack rows decoded, VAE and text encoder on the fly, forward,
backward, optimizer step) of one stage over the same synthetic pack, in this process; the variants
take turns step by step after ``--warmup`` untimed steps; samples/s and the ratio to AdamW without
REPA are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.packs import write_pack  # noqa: E402
from finetune.packs.sources import manifest_records  # noqa: E402
from finetune.packs.synthetic import make_synthetic_set  # noqa: E402
from finetune.pretrain.config import build_pretrain_config  # noqa: E402
from finetune.pretrain.trainer import Pretrainer  # noqa: E402
from krea2_diffusers.files import atomic_write  # noqa: E402

VARIANTS = (("adamw", False), ("muon", False), ("adamw", True), ("muon", True))


def make_trainer(optimizer: str, repa: bool, pack: Path, root: Path, args):
    """A set-up trainer and its step stream for one variant."""
    stage = {"name": "s", "data": str(pack), "resolution": args.resolution, "batch_size": args.batch_size,
             "steps": args.warmup + args.steps}
    if repa:
        stage["repa"] = {"encoder": "tiny-random", "weight": 0.5, "block": 1, "epochs": 1000}
    config = build_pretrain_config({
        "output_dir": str(root / f"{optimizer}-{repa}"),
        "model": {"architecture": "tiny", "text_encoder": "tiny-random", "vae": "tiny-random"},
        "optimizer": {"name": optimizer, "learning_rate": 2e-3},
        "checkpointing": {"every_n_steps": 0}, "logging": {"progress_bar": False, "tensorboard": False},
        "stages": [stage],
    })
    trainer = Pretrainer(config)
    trainer.prepare()
    trainer.setup_stage(0)
    return trainer, iter(trainer.step_loader(0, config.total_steps))


def bench(pack: Path, root: Path, args) -> dict[str, float]:
    """samples/s per variant. The variants take turns step by step, so a machine whose load drifts
    during the run slows them all alike."""
    runs = {f"{o}{' + repa' if r else ''}": make_trainer(o, r, pack, root, args) for o, r in VARIANTS}
    seconds = dict.fromkeys(runs, 0.0)
    for step in range(args.warmup + args.steps):
        for name, (trainer, stream) in runs.items():
            start = time.perf_counter()
            trainer.train_step(next(stream))
            if step >= args.warmup:
                seconds[name] += time.perf_counter() - start
    return {name: args.steps * args.batch_size / s for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matrices: 1 is fastest)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manifest = make_synthetic_set(root / "data", count=64)
        pack = root / "pack"
        write_pack(manifest_records(manifest), pack, resolution=args.resolution, batch_size=args.batch_size)
        results = bench(pack, root, args)
    base = results["adamw"]
    device = "cuda" if torch.cuda.is_available() else f"cpu ({args.threads} thread(s))"
    print(f"tiny recipe, {args.resolution} px, batch {args.batch_size}, {args.steps} timed steps, {device}")
    for name, value in results.items():
        print(f"  {name:14s} {value:7.2f} samples/s  x{value / base:.2f} vs adamw")
    if args.json:
        with atomic_write(Path(args.json), "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
