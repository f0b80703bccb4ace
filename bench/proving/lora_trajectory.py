#!/usr/bin/env python
"""A concept LoRA's gate along its run: each kept checkpoint's trained weights (and their EMA, when the
run kept one) judged as the LoRA stage judges its final file, at the run's *selection* seeds.

    python bench/proving/lora_trajectory.py --run DIR [--seed S] [--stage lora_ema] [--checkpoints FOLDER] [--every N] [--json OUT]

Which of a run's last checkpoints passes, and is the final one typical or lucky? The stage measures
one file at the evaluation seeds; this measures every checkpoint of ``DIR/work/<stage>/run/checkpoints``
(or ``--checkpoints``, e.g. a longer rerun of the same config; ``--every N``: the multiples of N) at :attr:`proving.seeds.Seeds.select`,
a block the report never samples, so looking at these figures chooses nothing from the report's own
samples. Each checkpoint is exported with ``krea2 export --weights raw|ema`` (:func:`proving.curves.export_lora`) into
``trajectory/<step>_<weights>/`` beside the checkpoint folder (kept: a rerun only samples). Prints one row per
checkpoint and weights: concept share with the trigger, the leak (concept share without it) with CFG
and at guidance 0, accuracy with the trigger, and whether the stage's gate holds there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))


def trajectory(run: Path, seed: int, stage: str, checkpoints: Path, every: int | None = None) -> dict:
    """``{"select_seed", "base", "checkpoints": [{"step", "weights", "rows", "gate"}]}``."""
    from lora_check import judged_rows

    from proving.curves import export_lora
    from proving.gates import checks
    from proving.pretraining import checkpoint_steps
    from proving.seeds import Seeds

    select = Seeds(seed).select
    base = judged_rows(run, None, stage, select)
    out = []
    run_dir = checkpoints.parent
    for step in checkpoint_steps(run_dir, every):
        state = json.loads((checkpoints / f"step-{step}" / "train_state.json").read_text())
        for weights in ("raw", "ema") if state.get("ema") else ("raw",):
            lora = export_lora(run_dir, step, run_dir / "trajectory" / f"{step}_{weights}", weights=weights)
            rows = judged_rows(run, lora, stage, select)
            gate = next(c for c in checks({**base, **rows}, {}) if c[0].startswith(f"{stage}:"))
            out.append({"step": step, "weights": weights, "rows": rows, "gate": bool(gate[1])})
            r = rows
            print(f"{step:6d} {weights:4s} concept {r[stage]['concept']:.3f} accuracy {r[stage]['accuracy']:.3f} "
                  f"leak {r[stage + '_off']['concept']:.3f} (CFG) {r[stage + '_off_nocfg']['concept']:.3f} (guidance 0) "
                  f"gate {'met' if gate[1] else 'NOT met'}", flush=True)
    return {"run": str(run), "seed": seed, "stage": stage, "select_seed": select, "base": base["base"], "checkpoints": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished proving-ground run folder")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed (its selection seeds; default 0)")
    parser.add_argument("--stage", default="lora_ema", choices=["lora", "lora_default", "lora_ema"])
    parser.add_argument("--checkpoints", default=None, help="checkpoint folder (default DIR/work/<stage>/run/checkpoints)")
    parser.add_argument("--every", type=int, default=None, help="only checkpoints at multiples of this step")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    import proving_ground as pg
    from lora_check import check_inputs, write_result

    from krea2_diffusers.cpu_threads import choose_cpu_threads

    choose_cpu_threads(width=pg.WIDTH)
    run = Path(args.run).resolve()
    checkpoints = Path(args.checkpoints).resolve() if args.checkpoints else run / "work" / args.stage / "run" / "checkpoints"
    check_inputs(run, checkpoints, "--checkpoints a run's checkpoint folder")
    write_result(args.json, trajectory(run, args.seed, args.stage, checkpoints, args.every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
