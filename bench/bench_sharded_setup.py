"""Per-process memory while a full fine-tune sets its transformer up: 1 process vs 2 (torchrun, gloo).

    python bench/bench_sharded_setup.py                 # ~170 MB-fp32 proportioned model, original-layout file
    python bench/bench_sharded_setup.py --layers 24     # ~340 MB

Each process runs the trainer's own ``finetune.model.build_sharded_transformer`` (meta build ->
fully_shard -> to_empty -> its own rows read from the file) under ``finetune.engine.plan.HostPeak``
(resident memory sampled every 2 ms, freed heap pages handed back to the OS first).
Prints each rank's growth and its ratio to the model's fp32 size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(model: str, out: str) -> None:
    from finetune.config import build_config
    from finetune.engine.plan import HostPeak
    from finetune.engine.runtime import setup_runtime
    from finetune.model import build_sharded_transformer

    config = build_config({"output_dir": out, "data": {"synthetic": {}},
                           "model": {"pretrained_model_name_or_path": model, "text_encoder": "tiny-random", "vae": "tiny-random"},
                           "training": {"method": "full"}})
    runtime = setup_runtime(config)
    start = time.perf_counter()
    with HostPeak() as probe:
        build_sharded_transformer(config, runtime)
    seconds = time.perf_counter() - start
    Path(out, f"rank{runtime.rank}-of-{runtime.world_size}.json").write_text(
        json.dumps({"growth": probe.growth, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "medium.safetensors")
        size = save_random_original_file(model, proportioned_transformer_config(num_layers=args.layers))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        print(f"model: {size / 1e6:.0f} MB in float32")
        print(f"{'processes':>9} {'rank':>4} {'growth MB':>10} {'/ fp32':>7} {'seconds':>8}")
        for processes in (1, 2):
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
            subprocess.run(launcher + [__file__, "--worker", str(model), tmp], env=env, check=True, capture_output=True)
            for rank in range(processes):
                row = json.loads(Path(tmp, f"rank{rank}-of-{processes}.json").read_text())
                print(f"{processes:>9} {rank:>4} {row['growth'] / 1e6:10.1f} {row['growth'] / size:7.2f} {row['seconds']:8.2f}")


if __name__ == "__main__":
    main()
