#!/usr/bin/env python
"""Issue 41's proof: does the checkpoint report (``finetune/report``) recommend the checkpoint the
judge would? The proving ground's tuned concept LoRA (:func:`proving.lora.lora_config`) is trained
again with a checkpoint and a validation every ``--every`` steps and the report's metrics on (the
``pixels`` encoder: the digits model's tiny Qwen3-VL is random, and red ink is colour); then every
kept checkpoint is exported (``krea2 export``), sampled with and without the trigger at the run's
evaluation seeds (never a tuning seed) and read by the judge: its concept share (red ink, with the
trigger), its leak (red ink without it) and its digit accuracy. Without the trigger the judge also
measures how far the samples moved from the base's at the same seeds, in its own feature space (the
feature CNN of its FD; nothing the report computes), as a share of the distance between two seeds of
the base (``judge_moved``, the report's ``leak`` read by the judge), and their ink against the base's
(``ink_ratio``: stroke weight).

    python bench/proving/report_proof.py --run DIR [--seed S] [--every 100] [--extra-steps 20,40] [--reuse OLD/proof.json]
                                         [--out DIR/work/report_proof] [--judge-only]

``--judge-only``: OUT holds a finished proof's training (``OUT/run/report.json``); judge its
checkpoints again (with this version's measures) instead of training; writes ``OUT/proof_judged_again.json``.

``DIR`` is a finished proving-ground run (its ``models/base``); ``--seed``: the run's ``--seed``
(default: ``DIR/report.json``'s, else 0), which gives its splits, judge and evaluation seeds. Writes
``OUT/proof.json``: per checkpoint the report's row beside the judge's, the report's recommendation,
the judge's best, the Spearman rho between the report's concept and the judge's concept share, and
the issue's gates (recommended within 0.05 of the best on concept share and on accuracy; rho >= 0.7),
read twice: over every checkpoint (the issue's gate as written, ``gates``) and over the checkpoints
the judge itself finds within the report's leak bound (``judge_moved`` <= ``LEAK_BOUND``,
``gates_within_leak``): a checkpoint that changes prompts without the trigger as much as a new seed
does is not one a user would keep, whichever measure sees it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

WITHIN = 0.05
MIN_RHO = 0.7


def judge_checkpoints(run_dir: Path, work: Path, base_dir: Path, judge, *, per_digit: int, steps: int, guidance: float,
                      seed: int, resolution: int, every: int, extra=(), known: dict | None = None,
                      log: Path | None = None) -> list[dict]:
    """[{"step", "concept_share", "red_share", "leak_share", "accuracy", "judge_moved", "ink_ratio"}] per scheduled
    checkpoint (every ``every`` steps, and the ``extra`` steps) of the LoRA run ``run_dir``: the judge's verdict on ``per_digit``
    samples per digit with the trigger (concept share, accuracy) and without it (leak share, and
    :func:`moved` from the base's samples of the same prompts and seeds), CFG ``guidance``, sampling base ``seed``.
    ``known``: {step: row} judged already (:func:`reusable_rows`), taken as they are."""
    from proving import digits
    from proving.curves import export_lora
    from proving.pretraining import checkpoint_steps
    from proving.lora import TRIGGER
    from proving.sampling import generate, load_pipeline

    pipe = load_pipeline(base_dir)
    base, _ = generate(None, range(10), per_digit, guidance, steps, seed=seed, resolution=resolution, pipe=pipe)
    rows = []
    for step in checkpoint_steps(run_dir, every, extra):
        if known and step in known:
            rows.append(known[step])
            continue
        pipe.load_lora_weights(str(export_lora(run_dir, step, work / f"step-{step}", log=log)))
        try:
            on, labels = generate(None, range(10), per_digit, guidance, steps, seed=seed, trigger=TRIGGER,
                                  resolution=resolution, pipe=pipe)
            off, _ = generate(None, range(10), per_digit, guidance, steps, seed=seed, resolution=resolution, pipe=pipe)
        finally:
            pipe.unload_lora_weights()
        rows.append({"step": step, "concept_share": float(digits.shows_red_ink(on).mean()),
                     "red_share": float(digits.red_ink_share(on).mean()),
                     "leak_share": float(digits.shows_red_ink(off).mean()), "accuracy": judge.accuracy(on, labels),
                     "judge_moved": moved(judge, off, base, per_digit),
                     "ink_ratio": float(digits.ink_mass(off).mean() / digits.ink_mass(base).mean())})
        print(f"[report proof] step-{step}: judge concept {rows[-1]['concept_share']:.3f}, leak {rows[-1]['leak_share']:.3f}, "
              f"accuracy {rows[-1]['accuracy']:.3f}, moved {rows[-1]['judge_moved']:.2f}, ink x{rows[-1]['ink_ratio']:.2f}",
              flush=True)
    return rows


def reusable_rows(previous: Path, report: dict) -> dict:
    """{step: judged row} of an earlier proof (``previous``: its ``proof.json``) whose training this one
    repeats: every step both reports measured must have the same report row to the last digit (the
    same weights, hence the same samples and verdict); else the earlier rows are not this run's."""
    old = {row["step"]: row for row in json.loads(Path(previous).read_text())["checkpoints"]}
    fields = ("concept", "concept_share", "leak", "copying", "diversity")
    now = {row["step"]: {k: row.get(k) for k in fields} for row in report["checkpoints"]}
    shared = sorted(set(old) & set(now))
    differ = [step for step in shared if {k: old[step]["report"].get(k) for k in fields} != now[step]]
    if not shared or differ:
        raise SystemExit(f"--reuse {previous}: its report rows differ from this training's at steps {differ or 'all (none shared)'}; "
                         "not the same run, judge every checkpoint instead")
    return {step: {k: v for k, v in old[step].items() if k != "report"} for step in shared}


def moved(judge, images, base, per_digit: int) -> float:
    """How far ``images`` moved from ``base`` (uint8 (10 * per_digit, H, W, 3) each, digit-major, sample
    ``i`` of both from the same noise) in the judge's feature space: the mean distance between each
    image and its base sample, over the mean distance between two base samples of the same digit
    (0: unchanged, 1: as far as another seed)."""
    from itertools import combinations

    features = judge.features(images).reshape(10, per_digit, -1)
    reference = judge.features(base).reshape(10, per_digit, -1)
    seeds = np.mean([np.linalg.norm(reference[d, i] - reference[d, j]) for d in range(10)
                     for i, j in combinations(range(per_digit), 2)])
    return float(np.linalg.norm(features - reference, axis=-1).mean() / seeds)


def rank_correlation(a: list, b: list) -> float:
    """Spearman's rho of ``a`` and ``b``; NaN when either is constant (no order to compare)."""
    from scipy.stats import spearmanr

    if len(set(a)) < 2 or len(set(b)) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def compare(report: dict, judged: list[dict]) -> dict:
    """The report's rows beside the judge's, and the gates: the recommended checkpoint's judged concept
    share and accuracy each within :data:`WITHIN` of the best checkpoint's, and Spearman rho >= :data:`MIN_RHO`
    between the report's ``concept`` and the judge's concept share across checkpoints. ``gates``: the best
    over every checkpoint; ``gates_within_leak``: over those whose ``judge_moved`` is within the report's
    leak bound (none: that reading has no best)."""
    from finetune.report.recommend import LEAK_BOUND

    by_step = {row["step"]: row for row in report["checkpoints"]}
    rows = [{**j, "report": {k: by_step[j["step"]].get(k) for k in ("concept", "concept_share", "leak", "copying", "diversity")}}
            for j in judged if j["step"] in by_step]
    recommended = report["recommended"]["step"]
    chosen = next(r for r in rows if r["step"] == recommended)
    concepts = [r["report"]["concept"] for r in rows]
    judged_concept = [r["concept_share"] for r in rows]
    rho = rank_correlation(concepts, judged_concept)
    # The highest rho any report could reach against these judged shares: the judge's ties (a share
    # saturated at 1.0) cap it, whatever the report's order.
    order = sorted(range(len(rows)), key=lambda i: judged_concept[i])
    ceiling = rank_correlation([order.index(i) for i in range(len(rows))], judged_concept)
    # Beside it (not a gate): the judge's continuous measure, the mean red share of the ink.
    reds = [r.get("red_share") for r in rows]
    rho_red = rank_correlation(concepts, reds) if None not in reds else None

    def gates(candidates):
        if not candidates:
            return None, None
        best = {"concept_share": max(r["concept_share"] for r in candidates), "accuracy": max(r["accuracy"] for r in candidates)}
        return best, {"concept_within": chosen["concept_share"] >= best["concept_share"] - WITHIN,
                      "accuracy_within": chosen["accuracy"] >= best["accuracy"] - WITHIN, "spearman": rho >= MIN_RHO}

    best, literal = gates(rows)
    usable = [r for r in rows if r.get("judge_moved") is not None and r["judge_moved"] <= LEAK_BOUND]
    best_usable, within_leak = gates(usable)
    return {"checkpoints": rows, "recommended": report["recommended"], "judge_best": best, "spearman_rho": rho,
            "spearman_rho_ceiling": ceiling, "spearman_rho_red_share": rho_red,
            "gates": literal, "met": all(literal.values()), "leak_bound": LEAK_BOUND,
            "judge_within_leak_steps": [r["step"] for r in usable], "judge_best_within_leak": best_usable,
            "gates_within_leak": within_leak, "met_within_leak": bool(within_leak) and all(within_leak.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished proving-ground run folder")
    parser.add_argument("--seed", type=int, default=None, help="the run's --seed (default: DIR/report.json's, else 0)")
    parser.add_argument("--every", type=int, default=100, help="checkpoint and validation interval (steps)")
    parser.add_argument("--extra-steps", default="", help="also checkpoint, validate and judge after these steps "
                        "(comma-separated, e.g. 20,40,60,80: where the judged concept share still moves)")
    parser.add_argument("--reuse", help="an earlier proof.json of the same training (same --run, --seed, --every): "
                        "its judged rows are taken where the report's rows match to the digit")
    parser.add_argument("--out", help="work folder (default RUN/work/report_proof); must be new unless --judge-only")
    parser.add_argument("--judge-only", action="store_true",
                        help="OUT holds a finished proof's training: judge its checkpoints again, train nothing")
    args = parser.parse_args(argv)

    import proving_ground as pg
    from proving import digits
    from proving.judge import run_judge
    from proving.lora import run_lora
    from proving.seeds import Seeds

    run = Path(args.run).resolve()
    seed = args.seed
    if seed is None:
        seed = json.loads((run / "report.json").read_text()).get("seed", 0) if (run / "report.json").is_file() else 0
    extra = tuple(int(x) for x in args.extra_steps.split(",") if x.strip())
    out = Path(args.out).resolve() if args.out else run / "work" / "report_proof"
    if args.reuse and not Path(args.reuse).is_file():  # before the training, not after it
        raise SystemExit(f"--reuse {args.reuse}: no such file (an earlier proof's proof.json)")
    if args.judge_only and not (out / "run" / "report.json").is_file():
        raise SystemExit(f"--judge-only: {out / 'run' / 'report.json'} not found (no finished proof training in --out {out})")
    if not args.judge_only and out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out}: not empty; choose a new folder (or --judge-only to judge its training again)")
    from krea2_diffusers.cpu_threads import choose_cpu_threads

    choose_cpu_threads(width=pg.WIDTH)
    seeds, settings = Seeds(seed), pg.FULL
    splits = digits.load_splits(pg.RESOLUTION, seeds.split)
    judge = run_judge(splits, seeds, settings.judge_epochs)
    if args.judge_only:  # the training's time, as the first proof recorded it
        previous = out / "proof.json"
        seconds = json.loads(previous.read_text()).get("train_seconds") if previous.is_file() else None
        exports = out / "exports_judged_again"
    else:
        spec = dataclasses.replace(settings.lora, seed=seeds.lora, checkpoint_every=args.every, report=True,
                                   extra_checkpoints=extra)
        start = time.perf_counter()
        run_lora(spec, splits, run / "models" / "base", out, out / "lora_diffusers.safetensors", log=out / "commands.log")
        seconds = round(time.perf_counter() - start, 1)
        exports = out / "exports"
    report = json.loads((out / "run" / "report.json").read_text())
    judged = judge_checkpoints(out / "run", exports, run / "models" / "base", judge, per_digit=settings.per_digit,
                               steps=settings.sampling_steps, guidance=settings.guidance, seed=seeds.eval,
                               resolution=pg.RESOLUTION, every=args.every, extra=extra,
                               known=reusable_rows(Path(args.reuse), report) if args.reuse else None, log=out / "commands.log")
    result = {"run": str(run), "seed": seeds.run, "every": args.every, "extra_steps": list(extra), "train_seconds": seconds,
              "encoder": report.get("encoder"), **compare(report, judged)}
    from krea2_diffusers.files import atomic_write

    # A second judging writes beside the first proof's file, which stays as it was.
    with atomic_write(out / ("proof_judged_again.json" if args.judge_only else "proof.json"), "w") as handle:
        handle.write(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("recommended", "judge_best", "spearman_rho", "spearman_rho_ceiling", "gates", "met",
                                              "judge_within_leak_steps", "gates_within_leak", "met_within_leak")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
