#!/usr/bin/env python
"""Does a concept LoRA pass the proving ground's LoRA gate on a finished run's base, measured exactly as
the run's LoRA stage measures it? For a recipe change checked without running the whole bench again.

    python bench/proving/lora_check.py --run DIR [--lora FILE] [--seed S] [--stage lora|lora_default|lora_ema]
                                       [--blocks 1,5,6,7,8] [--json OUT]

Samples at the run's evaluation seeds (:attr:`proving.seeds.Seeds.eval`; never a tuning seed), the
full run's ``per_digit``, sampling steps and CFG (``proving_ground.FULL``, from :mod:`proving.settings`): the base with CFG (its
accuracy), the LoRA with the trigger with CFG (concept share, accuracy) and without it with CFG and at
guidance 0 (the leak: its concept share). Accuracy is the judge's reader saved in the run
(``DIR/work/judge_reader.safetensors``), concept the red-ink test, as in the stage. Prints the gate of
:func:`proving.gates.checks` for ``--stage``. On seed 2's run and its own ``models/lora_ema`` this gives
the stage's committed figures to the digit (accuracy 0.98, leak 0.105 / 0.205).

``--blocks``: the same rows on several sampling blocks (:meth:`proving.seeds.Seeds.block`; 1 is the
evaluation block, 5 and up are blocks no stage samples), averaged before the gate is read: a gate
missed by a sample or two in 200 is a question of the block, which five blocks (1,000 samples a row)
answer at a binomial standard error of ~0.008 instead of ~0.018. Without ``--lora`` the run's own LoRA
of the stage is checked (``DIR/models/<stage>/lora_diffusers.safetensors``); ``--stage`` then also takes a
comma-separated list (the base sampled once per block for all of them; the JSON holds ``{"seed",
"blocks", "results": {stage: the one-stage result}}``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))


def judged_rows(run: Path, lora: Path | None, stage: str, sample_seed: int) -> dict:
    """The stage's rows for ``lora`` on the run's base, sampled from block ``sample_seed`` exactly as the
    LoRA stage samples: ``{stage, stage_off, stage_off_nocfg: {"accuracy", "concept"}}``; ``lora=None``:
    ``{"base": ...}`` (the base with CFG)."""
    import numpy as np

    import proving_ground as pg
    from proving import digits
    from proving.lora import TRIGGER
    from proving.reader import load_reader
    from proving.sampling import generate, load_pipeline

    settings = pg.FULL
    reader = load_reader(run / "work" / "judge_reader.safetensors")

    def row(pipe, guidance: float, trigger: str | None) -> dict:
        images, labels = generate(None, range(10), settings.per_digit, guidance, settings.sampling_steps, seed=sample_seed,
                                  trigger=trigger, resolution=pg.RESOLUTION, pipe=pipe)
        return {"accuracy": float(np.mean(reader.predict(images) == labels)),
                "concept": float(digits.shows_red_ink(images).mean())}

    G = settings.guidance
    if lora is None:
        return {"base": row(load_pipeline(run / "models" / "base"), G, None)}
    pipe = load_pipeline(run / "models" / "base", lora=lora)
    return {stage: row(pipe, G, TRIGGER), f"{stage}_off": row(pipe, G, None), f"{stage}_off_nocfg": row(pipe, 0.0, None)}


def measure(run: Path, lora: Path, seed: int, stage: str, blocks: list[int] | None = None,
            base_rows: dict | None = None) -> dict:
    """{"stages": {base, stage, stage_off, stage_off_nocfg: {"accuracy", "concept"}}, "gate": [claim, met]}
    at the run's evaluation seeds, or averaged over sampling ``blocks`` (then also ``"blocks"``: each
    block's rows). ``base_rows``: a dict the base's rows are kept in by sampling seed, to share them
    between stages."""
    from proving.gates import checks
    from proving.seeds import Seeds

    seeds = Seeds(seed)
    base = {} if base_rows is None else base_rows
    per_block = {}
    for block in blocks or [None]:
        sample_seed = seeds.eval if block is None else seeds.block(block)
        if sample_seed not in base:
            base[sample_seed] = judged_rows(run, None, stage, sample_seed)
        per_block[block] = {**base[sample_seed], **judged_rows(run, lora, stage, sample_seed)}
    rows = {name: {key: sum(r[name][key] for r in per_block.values()) / len(per_block) for key in ("accuracy", "concept")}
            for name in next(iter(per_block.values()))}
    gate = next(c for c in checks(rows, {}) if c[0].startswith(f"{stage}:"))
    result = {"run": str(run), "lora": str(lora), "seed": seed, "eval_seed": seeds.eval, "stages": rows, "gate": list(gate)}
    if blocks:
        result["blocks"] = {str(b): r for b, r in per_block.items()}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished proving-ground run folder (its models/base, work/)")
    parser.add_argument("--lora", default=None, help="the LoRA to check (diffusers safetensors; default: the run's own "
                        "models/<stage>/lora_diffusers.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed (its evaluation seeds; default 0)")
    parser.add_argument("--stage", default="lora", help="whose gate to read: lora, lora_default or lora_ema (without "
                        "--lora, a comma-separated list of them)")
    parser.add_argument("--blocks", default=None, help="sampling blocks to average over (comma-separated; default: "
                        "the evaluation block alone, as the stage samples)")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else None
    from proving.gates import LORAS

    stages = args.stage.split(",")
    for stage in stages:
        if stage not in LORAS:
            parser.error(f"--stage {stage}: not one of {', '.join(LORAS)}")
    if args.lora and len(stages) > 1:
        parser.error(f"--lora is one LoRA: give one --stage (not {args.stage}), or leave --lora out to check each "
                     "stage's own LoRA in the run")
    import proving_ground as pg
    from krea2_diffusers.cpu_threads import choose_cpu_threads

    run = Path(args.run).resolve()
    loras = {s: Path(args.lora).resolve() if args.lora else run / "models" / s / "lora_diffusers.safetensors" for s in stages}
    for stage, lora in loras.items():  # every input before any sampling
        check_inputs(run, lora, "--lora a LoRA file" if args.lora else f"with its {stage} stage")
    choose_cpu_threads(width=pg.WIDTH)
    base_rows, results = {}, {}
    for stage, lora in loras.items():
        results[stage] = result = measure(run, lora, args.seed, stage, blocks, base_rows)
        print(json.dumps(result["stages"]))
        print(("met: " if result["gate"][1] else "NOT met: ") + result["gate"][0], flush=True)
    write_result(args.json, results[stages[0]] if len(stages) == 1 else
                 {"seed": args.seed, "blocks": blocks, "results": results})
    return 0


def check_inputs(run: Path, other: Path, what: str) -> None:
    """Fail before any sampling when ``run`` is not a finished proving-ground run or ``other`` is missing."""
    for needed in (run / "models" / "base", run / "work" / "judge_reader.safetensors", other):
        if not needed.exists():
            raise SystemExit(f"{needed}: not found (--run must be a finished proving-ground run, {what})")


def write_result(path: str | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (atomically), when a path was given."""
    if path:
        from krea2_diffusers.files import atomic_write

        with atomic_write(Path(path), "w") as handle:
            handle.write(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
