#!/usr/bin/env python
"""Issue 41's proof: does the checkpoint report (``finetune/report``) recommend the checkpoint the
judge would? The proving ground's tuned concept LoRA (:func:`proving.lora.lora_config`) is trained
again with a checkpoint and a validation every ``--every`` steps and the report's metrics on (the
``pixels`` encoder: the digits model's tiny Qwen3-VL is random, and red ink is colour); then every
kept checkpoint is exported (``krea2 export``), sampled with and without the trigger at the run's
evaluation seeds (never a tuning seed) and read by the judge: its concept share (red ink, with the
trigger), its leak (red ink without it) and its digit accuracy.

    python bench/proving/report_proof.py --run DIR [--seed S] [--every 100] [--out DIR/work/report_proof]

``DIR`` is a finished proving-ground run (its ``models/base``); ``--seed``: the run's ``--seed``
(default: ``DIR/report.json``'s, else 0), which gives its splits, judge and evaluation seeds. Writes
``OUT/proof.json``: per checkpoint the report's row beside the judge's, the report's recommendation,
the judge's best, the Spearman rho between the report's concept and the judge's concept share, and
the issue's gates (recommended within 0.05 of the best on concept share and on accuracy; rho >= 0.7).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

WITHIN = 0.05
MIN_RHO = 0.7


def judge_checkpoints(run_dir: Path, work: Path, base_dir: Path, judge, *, per_digit: int, steps: int, guidance: float,
                      seed: int, resolution: int, every: int, log: Path | None = None) -> list[dict]:
    """[{"step", "concept_share", "leak_share", "accuracy"}] per scheduled checkpoint (every ``every`` steps) of the LoRA run
    ``run_dir``: the judge's verdict on ``per_digit`` samples per digit with the trigger (concept share,
    accuracy) and without it (leak share), CFG ``guidance``, sampling base ``seed``."""
    from proving import digits
    from proving.curves import export_lora
    from proving.pretraining import checkpoint_steps
    from proving.lora import TRIGGER
    from proving.sampling import generate, load_pipeline

    pipe = load_pipeline(base_dir)
    rows = []
    for step in checkpoint_steps(run_dir, every):
        pipe.load_lora_weights(str(export_lora(run_dir, step, work / f"step-{step}", log=log)))
        try:
            on, labels = generate(None, range(10), per_digit, guidance, steps, seed=seed, trigger=TRIGGER,
                                  resolution=resolution, pipe=pipe)
            off, _ = generate(None, range(10), per_digit, guidance, steps, seed=seed, resolution=resolution, pipe=pipe)
        finally:
            pipe.unload_lora_weights()
        rows.append({"step": step, "concept_share": float(digits.shows_red_ink(on).mean()),
                     "leak_share": float(digits.shows_red_ink(off).mean()), "accuracy": judge.accuracy(on, labels)})
        print(f"[report proof] step-{step}: judge concept {rows[-1]['concept_share']:.3f}, leak {rows[-1]['leak_share']:.3f}, "
              f"accuracy {rows[-1]['accuracy']:.3f}", flush=True)
    return rows


def compare(report: dict, judged: list[dict]) -> dict:
    """The report's rows beside the judge's, and the gates: the recommended checkpoint's judged concept
    share and accuracy each within :data:`WITHIN` of the best checkpoint's, and Spearman rho >= :data:`MIN_RHO`
    between the report's ``concept`` and the judge's concept share across checkpoints."""
    from scipy.stats import spearmanr

    by_step = {row["step"]: row for row in report["checkpoints"]}
    rows = [{**j, "report": {k: by_step[j["step"]].get(k) for k in ("concept", "concept_share", "leak", "copying", "diversity")}}
            for j in judged if j["step"] in by_step]
    recommended = report["recommended"]["step"]
    chosen = next(r for r in rows if r["step"] == recommended)
    best_concept = max(r["concept_share"] for r in rows)
    best_accuracy = max(r["accuracy"] for r in rows)
    concepts = [r["report"]["concept"] for r in rows]
    rho = float(spearmanr(concepts, [r["concept_share"] for r in rows]).statistic) if len(set(concepts)) > 1 else float("nan")
    gates = {"concept_within": chosen["concept_share"] >= best_concept - WITHIN,
             "accuracy_within": chosen["accuracy"] >= best_accuracy - WITHIN, "spearman": rho >= MIN_RHO}
    return {"checkpoints": rows, "recommended": report["recommended"], "judge_best": {"concept_share": best_concept,
            "accuracy": best_accuracy}, "spearman_rho": rho, "gates": gates, "met": all(gates.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished proving-ground run folder")
    parser.add_argument("--seed", type=int, default=None, help="the run's --seed (default: DIR/report.json's, else 0)")
    parser.add_argument("--every", type=int, default=100, help="checkpoint and validation interval (steps)")
    parser.add_argument("--out", help="work folder (default RUN/work/report_proof); must be new")
    args = parser.parse_args(argv)

    import proving_ground as pg
    from proving import digits
    from proving.judge import train_judge
    from proving.lora import run_lora
    from proving.seeds import Seeds

    run = Path(args.run).resolve()
    seed = args.seed
    if seed is None:
        seed = json.loads((run / "report.json").read_text()).get("seed", 0) if (run / "report.json").is_file() else 0
    out = Path(args.out).resolve() if args.out else run / "work" / "report_proof"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out}: not empty; choose a new folder")
    from krea2_diffusers.cpu_threads import choose_cpu_threads

    choose_cpu_threads(width=pg.WIDTH)
    seeds, settings = Seeds(seed), pg.FULL
    splits = digits.load_splits(pg.RESOLUTION, seeds.split)
    judge = train_judge(splits, seed=seeds.judge, epochs=settings.judge_epochs,
                        scans=digits.halves(splits.train_labels, seeds.halves)[0])
    spec = dataclasses.replace(settings.lora, seed=seeds.lora, checkpoint_every=args.every, report=True)
    start = time.perf_counter()
    run_lora(spec, splits, run / "models" / "base", out, out / "lora_diffusers.safetensors", log=out / "commands.log")
    seconds = time.perf_counter() - start
    report = json.loads((out / "run" / "report.json").read_text())
    judged = judge_checkpoints(out / "run", out / "exports", run / "models" / "base", judge, per_digit=settings.per_digit,
                               steps=settings.sampling_steps, guidance=settings.guidance, seed=seeds.eval,
                               resolution=pg.RESOLUTION, every=args.every, log=out / "commands.log")
    result = {"run": str(run), "seed": seeds.run, "every": args.every, "train_seconds": round(seconds, 1),
              "encoder": report.get("encoder"), **compare(report, judged)}
    (out / "proof.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("recommended", "judge_best", "spearman_rho", "gates", "met")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
