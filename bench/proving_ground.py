#!/usr/bin/env python
"""The proving ground (issue 32): a Krea 2 of the real architecture, CPU-sized, trained from scratch on
scikit-learn's real handwritten digits with this project's own commands, then measured stage by stage.

    python bench/proving_ground.py --out DIR [--seed S] [--quick] [--json OUT] [--device cpu|cuda] [--resume]

Stages: data + the evaluation classifier (judge) and the reward classifier, on disjoint halves of the
training scans, with the attack-transfer figure; the autoencoder (the bench's one training loop);
``krea2 pack`` + ``krea2 pretrain`` (two resolution stages, WSD) and the model folder; the base's
CFG sweep (its accuracy / FD frontier); the concept LoRA (``krea2 train``: the tuned config, a
user's config at the defaults, the same with EMA); the edit LoRA on real pairs; DPO, GRPO, DRaFT
(``krea2 posttrain``, each checkpoint on a curve, one chosen by a stated rule) and the TDM student;
samples of every stage through ``Krea2Pipeline``; ``DIR/report.md`` and the JSON. Every seed follows
``--seed`` (:mod:`proving.seeds`); the report's samples use seeds no tuning run used. See the
README's "Proving ground" section for the measured full runs.

``--resume`` reuses what an interrupted run in DIR finished (the VAE, packs, pretraining run, model
folders); without it DIR must be new or empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

# The sizes live in proving.settings; RESOLUTION, WIDTH, FULL and QUICK stay importable from here, where the
# tools that judge a finished run again read them.
from proving.settings import FULL, QUICK, RESOLUTION, WIDTH, Settings  # noqa: E402,F401

STAGE_WHAT = {
    "base_nocfg": "pretrained (krea2 pack + krea2 pretrain), guidance 0",
    "base": "pretrained, CFG",
    "lora": "concept LoRA (krea2 train), trigger in the prompt",
    "lora_off": "same LoRA loaded, prompt without the trigger",
    "lora_off_nocfg": "same LoRA loaded, prompt without the trigger, guidance 0",
    "lora_default": "concept LoRA through a user's config (krea2 train defaults), trigger in the prompt",
    "lora_default_off": "lora_default loaded, prompt without the trigger",
    "lora_default_off_nocfg": "lora_default loaded, prompt without the trigger, guidance 0",
    "lora_ema": "lora_default's config with training.ema at its defaults, trigger in the prompt",
    "lora_ema_off": "lora_ema loaded, prompt without the trigger",
    "lora_ema_off_nocfg": "lora_ema loaded, prompt without the trigger, guidance 0",
    "dpo": "krea2 posttrain dpo (LoRA), guidance 0",
    "grpo": "krea2 posttrain grpo (LoRA), guidance 0",
    "draft": "krea2 posttrain draft (LoRA), guidance 0",
    "teacher_4": "pretrained, 4 steps, CFG",
    "teacher_28": "pretrained, 28 steps, CFG",
    "student_4": "krea2 posttrain distill (TDM), 4 steps",
}


class Clock:
    """Seconds per named phase, and the run's total."""

    def __init__(self):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = round(seconds, 1)
        print(f"[proving ground] {name}: {seconds:.1f} s (total {time.perf_counter() - self.start:.0f} s)", flush=True)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse to write into a non-empty DIR unless resuming (nothing a user has is overwritten)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out}: exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not resume:
        raise SystemExit(f"--out {out}: not empty; choose a new folder or pass --resume to continue the run in it")


def classifiers(splits, settings: Settings, seeds, work: Path) -> tuple:
    """The judge and the reward on disjoint halves of the training split, their held-out accuracies, the
    attack-transfer figure and the concept measure on real scans. Returns (judge, reward, blocks)."""
    import numpy as np

    from proving import attack, digits
    from proving.judge import train_judge
    from proving.rewards import train_reward

    judge_half, reward_half = digits.halves(splits.train_labels, seeds.halves)
    judge = train_judge(splits, seed=seeds.judge, epochs=settings.judge_epochs, scans=judge_half)
    judge.save(work / "judge.safetensors")
    reward = train_reward(splits, work / "reward.safetensors", seed=seeds.reward, epochs=settings.judge_epochs,
                          scans=reward_half)
    transfer = attack.transfer(reward.path, judge, splits.heldout, splits.heldout_labels)
    red = digits.render(splits.heldout_scans, RESOLUTION, digits.RED_INK)
    shared = len(np.intersect1d(judge_half, reward_half))
    blocks = {
        "judge": {"kind": "logistic regression on HOG + 8x8 ink (reader); FD / diversity: a ReLU CNN on 16x16",
                  "heldout_accuracy": judge.heldout_accuracy, "features_heldout_accuracy": judge.features_heldout_accuracy,
                  "train_scans": int(len(judge_half)), "attack_transfer": transfer["share"]},
        "reward": {"kind": "SiLU CNN on 8x8 grey, trained with shifts, contrast, noise, grey paper and smudges",
                   "heldout_accuracy": reward.heldout_accuracy, "train_scans": int(len(reward_half)),
                   "scans_shared_with_judge": shared, "attack": transfer},
        "classifier": {"judge_heldout_accuracy": judge.heldout_accuracy, "judge_heldout_diversity": judge.heldout_diversity,
                       "reward_heldout_accuracy": reward.heldout_accuracy,
                       "concept_measure": {"red_heldout_shows": float(digits.shows_red_ink(red).mean()),
                                           "black_heldout_shows": float(digits.shows_red_ink(splits.heldout).mean())}},
    }
    print(f"[proving ground] judge {judge.heldout_accuracy:.3f}, reward {reward.heldout_accuracy:.3f} on held-out scans; "
          f"attack at {transfer['budget']}: reward fooled {transfer['by_budget'][0]['reward_fooled']:.3f}, "
          f"judge flipped {transfer['share']:.3f}", flush=True)
    return judge, reward, blocks


def autoencoder(splits, settings: Settings, seeds, out: Path, judge, device: str, clock: Clock) -> tuple[Path, dict]:
    """The VAE (trained unless DIR has one) and its figures on the held-out scans."""
    import numpy as np

    from proving import digits
    from proving.autoencoder import load_autoencoder, reconstruct, reconstruction_error, train_autoencoder

    work, vae_dir = out / "work", out / "models" / "vae"
    if not vae_dir.exists():
        # Black and red renderings of the training scans: a VAE that only ever saw grey cannot decode
        # the LoRA's red ink (measured: a LoRA on a black-only VAE gave faded grey, 0% red).
        pool = np.concatenate([splits.train, digits.render(splits.train_scans, RESOLUTION, digits.RED_INK)])
        result = train_autoencoder(pool, splits.heldout, vae_dir, settings.vae_steps, learning_rate=settings.vae_learning_rate,
                                   seed=seeds.autoencoder, device=device, stats_images=settings.vae_stats_images,
                                   log=lambda m: print(f"[proving ground] {m}", flush=True))
        vae_train = {"steps": result.steps, "seconds": round(result.seconds, 1)}
        clock.phase("autoencoder", result.seconds)
        recon = result.reconstructions
    else:
        vae_train = json.loads((work / "vae.json").read_text()) if (work / "vae.json").exists() else {}
        recon = reconstruct(load_autoencoder(vae_dir, device), splits.heldout, device=device)
    (work / "vae.json").write_text(json.dumps(vae_train))
    mse, psnr = reconstruction_error(recon, splits.heldout)
    return vae_dir, {**vae_train, "mse": mse, "psnr": psnr,
                     "judge_accuracy": judge.accuracy(recon, splits.heldout_labels),
                     "judge_accuracy_originals": judge.heldout_accuracy}


def base_stages(stages, *, settings: Settings, seeds, base_dir: Path, pre: tuple[int, float], chosen: dict) -> tuple[list, dict]:
    """base_nocfg, base, the teachers, the CFG sweep (``samples/base_cfg/<g>/``) and the scratch
    transformer. Returns (the sweep [{"guidance", "accuracy", "fd", "diversity"}], the untrained row)."""
    import torch

    from proving.frontier import guidance_name
    from proving.sampling import load_pipeline, save_samples

    S, G = settings.sampling_steps, settings.guidance
    pipe = load_pipeline(base_dir, stages.device)
    sweep = []
    nocfg = stages.run("base_nocfg", pipe, STAGE_WHAT["base_nocfg"] + f" ({chosen['checkpoint']})", *pre, S, 0.0)
    save_samples(stages.out, f"base_cfg/{guidance_name(0.0)}", *nocfg)
    sweep.append({"guidance": 0.0, **{k: stages.rows["base_nocfg"][k] for k in ("accuracy", "fd", "diversity")}})
    for guidance in settings.cfg_scales:
        folder = f"base_cfg/{guidance_name(guidance)}"
        if guidance == G:  # base itself: the same seeds and steps, sampled once
            images, labels = stages.run("base", pipe, STAGE_WHAT["base"], *pre, S, G)
            save_samples(stages.out, folder, images, labels)
            point = stages.rows["base"]
        else:
            images, labels = stages.sample(folder, pipe, S, guidance)
            point = stages.judge.evaluate(images, labels)
        sweep.append({"guidance": float(guidance), **{k: point[k] for k in ("accuracy", "fd", "diversity")}})
        print(f"[proving ground] base at CFG {guidance}: accuracy {point['accuracy']:.3f}, FD {point['fd']:.2f}", flush=True)
    if "base" not in stages.rows:
        stages.run("base", pipe, STAGE_WHAT["base"], *pre, S, G)
    for stage, steps in (("teacher_4", 4), ("teacher_28", 28)):
        stages.run(stage, pipe, STAGE_WHAT[stage], *pre, steps, G)
    # The same pipeline with the transformer as pretraining starts it (scratch init): what pretraining improved on.
    from finetune.pretrain.architecture import init_from_scratch_

    torch.manual_seed(seeds.pretrain)
    init_from_scratch_(pipe.transformer)
    images, labels = stages.sample("untrained", pipe, S, G)
    untrained = {"what": "scratch-initialised transformer, CFG", "steps": 0, "seconds": 0.0, "num_inference_steps": S,
                 "guidance": G, **stages.judge.evaluate(images, labels)}
    return sweep, untrained


def concept_lora(stages, *, settings: Settings, seeds, splits, base_dir: Path, log: Path, name: str) -> dict:
    """One concept LoRA (``lora``: the tuned config; ``lora_default``: a user's config; ``lora_ema``: the
    same with EMA), sampled with the trigger (CFG), without it (CFG and guidance 0). Returns the concept
    scores per stage: {"red_share": mean red share of ink, "redness": mean R - max(G, B) of ink
    (:func:`proving.digits.redness`)}."""
    from proving import digits
    from proving.lora import TRIGGER, run_lora, run_user_lora
    from proving.sampling import load_pipeline

    out, S, G = stages.out, settings.sampling_steps, settings.guidance
    if name == "lora":
        steps = settings.lora.steps
        train = lambda f, w: run_lora(dataclasses.replace(settings.lora, seed=seeds.lora), splits, base_dir, w, f,  # noqa: E731
                                      device=stages.device, log=log)
    else:
        steps = settings.lora_user.steps
        train = lambda f, w: run_user_lora(settings.lora_user, splits, base_dir, w, f, seeds.lora,  # noqa: E731
                                           ema=name == "lora_ema", device=stages.device, log=log)
    scores = {}
    lora_file = out / "models" / name / "lora_diffusers.safetensors"
    seconds = train(lora_file, out / "work" / name).seconds if not lora_file.exists() else None
    pipe = load_pipeline(base_dir, stages.device, lora=lora_file)
    for stage, trigger, guidance in ((name, TRIGGER, G), (f"{name}_off", None, G), (f"{name}_off_nocfg", None, 0.0)):
        images, labels = stages.run(stage, pipe, STAGE_WHAT[stage], steps, seconds, S, guidance, trigger=trigger)
        stages.rows[stage]["concept"] = float(digits.shows_red_ink(images).mean())
        scores[stage] = {"red_share": float(digits.red_ink_share(images).mean()),
                         "redness": float(digits.redness(images).mean())}
    return scores


def edit_stage(stages, *, settings: Settings, seeds, splits, base_dir: Path, log: Path) -> dict:
    """The edit LoRA on pairs: trained, then applied to held-out scans (``samples/edit`` beside
    ``samples/edit_source``); its measures."""
    from proving import edit
    from proving.digits import RED_INK, render
    from proving.sampling import load_pipeline, save_samples

    spec, out = settings.edit, stages.out
    lora_file = out / "models" / "edit" / "lora_diffusers.safetensors"
    seconds = None
    if not lora_file.exists():
        _, seconds = edit.train_edit_lora(spec, splits, base_dir, out / "work" / "edit", lora_file, seeds.edit,
                                          device=stages.device, log=log)
    sources, others, labels = edit.heldout_sources(splits, spec.per_digit)
    pipe = load_pipeline(base_dir, stages.device, lora=lora_file)
    outputs = edit.sample_edits(pipe, splits.heldout[sources], settings.sampling_steps, spec.guidance, stages.eval_seed,
                                RESOLUTION)
    del pipe
    save_samples(out, "edit", outputs, labels)
    save_samples(out, "edit_source", splits.heldout[sources], labels)
    result = {"steps": spec.steps, "seconds": None if seconds is None else round(seconds, 1), "guidance": spec.guidance,
              "num_inference_steps": settings.sampling_steps, "instruction": edit.INSTRUCTION,
              **edit.measure(stages.judge, outputs, splits.heldout[sources], splits.heldout[others], labels,
                             render(splits.heldout_scans[sources], RESOLUTION, RED_INK))}
    print(f"[proving ground] edit: concept {result['concept']:.3f}, accuracy {result['accuracy']:.3f}, IoU with the "
          f"source {result['iou_source']:.3f} vs another scan {result['iou_other']:.3f} ({result['iou_ratio']:.2f}x; the red-ink "
          f"target itself: {result['target_iou_ratio']:.2f}x)", flush=True)
    return result


def post_train(stages, *, settings: Settings, seeds, base_dir: Path, reward_path: Path, base_point: dict, quick: bool,
               log: Path, stage: str) -> dict:
    """DPO, GRPO or DRaFT (``stage``): trained, every kept checkpoint on a curve (selection seeds).
    Returns {"steps", "seconds", "curve"}; :func:`publish_post_trained` chooses among them."""
    from proving import curves, posttraining
    from proving.sampling import load_pipeline

    work = stages.out / "work" / "posttrain"
    common = dict(resolution=RESOLUTION, sampling_steps=settings.sampling_steps, seed=seeds.posttrain, reward=reward_path)
    if stage == "dpo":
        result = posttraining.run_dpo(base_dir, work, quick, stages.device, **common, pool_seed=seeds.dpo_pool,
                                      guided_seed=seeds.dpo_guided)
    else:
        result = {"grpo": posttraining.run_grpo, "draft": posttraining.run_draft}[stage](base_dir, work, quick, stages.device,
                                                                                         **common)
    curve = curves.evaluate_run(load_pipeline(base_dir, stages.device), result.model_dir, work / f"{stage}_checkpoints",
                                stages.judge, reward_path, per_digit=stages.per_digit, steps=settings.sampling_steps,
                                seed=seeds.select, resolution=RESOLUTION, every=result.checkpoint_every,
                                base_point=base_point, log=log)
    return {"steps": result.steps, "seconds": result.seconds, "curve": curve}


def publish_post_trained(stages, settings: Settings, base_dir: Path, sweep: list, stage: str, trained: dict) -> None:
    """The checkpoint the stated rule chooses on ``trained["curve"]`` (against the CFG ``sweep``):
    published to ``DIR/models/<stage>``, sampled at the report's seeds, its row with the frontier FD."""
    from proving import curves
    from proving.frontier import choose_checkpoint, frontier_fd
    from proving.sampling import load_pipeline

    work = stages.out / "work" / "posttrain"
    choice = choose_checkpoint(trained["curve"], sweep)
    lora = curves.publish(work / f"{stage}_checkpoints" / f"step-{choice['step']}" / curves.LORA_FILE,
                          stages.out / "models" / stage)
    pipe = load_pipeline(base_dir, stages.device)
    pipe.load_lora_weights(str(lora))
    images, labels = stages.run(stage, pipe, STAGE_WHAT[stage] + f" (step-{choice['step']})", trained["steps"],
                                trained["seconds"], settings.sampling_steps, 0.0)
    row = stages.rows[stage]
    frontier = frontier_fd(sweep, row["accuracy"])
    row.update(frontier_fd=frontier["fd"], frontier_reached=frontier["reached"], checkpoint=choice)


def student(stages, *, settings: Settings, seeds, base_dir: Path, quick: bool) -> None:
    """The TDM student (``krea2 posttrain distill``), sampled at 4 steps, guidance 0."""
    from proving import posttraining
    from proving.sampling import load_pipeline

    result = posttraining.run_distill(base_dir, stages.out / "work" / "posttrain", quick, stages.device,
                                      resolution=RESOLUTION, teacher_guidance=settings.guidance,
                                      models_dir=stages.out / "models", seed=seeds.posttrain)
    stages.run("student_4", load_pipeline(result.model_dir, stages.device), STAGE_WHAT["student_4"], result.steps,
               result.seconds, 4, 0.0)


def after_base(stages, settings: Settings, seeds, splits, base_dir: Path, reward_path: Path, base_point: dict,
               pre: tuple[int, float], chosen: dict, quick: bool, log: Path, clock: Clock, workers: int) -> dict:
    """Every stage that needs only the base (:mod:`proving.parallel`: on ``workers`` processes), then the
    post-trained checkpoints chosen against the CFG sweep. Returns {"sweep", "untrained", "concept_scores",
    "edit", "curves"}."""
    from proving.parallel import Task, run_tasks

    common = dict(settings=settings, seeds=seeds, base_dir=base_dir)
    post = dict(common, reward_path=reward_path, base_point=base_point, quick=quick, log=log)
    lora = dict(common, splits=splits, log=log)
    # GRPO and DRaFT first: ~410 s each on the full run, against 100-220 s for each of the others.
    tasks = [Task("grpo", post_train, dict(post, stage="grpo")), Task("draft", post_train, dict(post, stage="draft")),
             Task("dpo", post_train, dict(post, stage="dpo")),
             Task("lora_default", concept_lora, dict(lora, name="lora_default")),
             Task("lora_ema", concept_lora, dict(lora, name="lora_ema")), Task("lora", concept_lora, dict(lora, name="lora")),
             Task("student_4", student, dict(common, quick=quick)), Task("edit", edit_stage, lora),
             Task("base", base_stages, dict(settings=settings, seeds=seeds, base_dir=base_dir, pre=pre, chosen=chosen))]
    import proving.pretraining

    done = run_tasks(tasks, stages, workers, lambda name, d: clock.phase(name, d.seconds),
                     width=WIDTH if stages.device == "cpu" else None, in_process=proving.pretraining.IN_PROCESS)
    sweep, untrained = done["base"].value
    curves = {}
    for stage in ("dpo", "grpo", "draft"):
        publish_post_trained(stages, settings, base_dir, sweep, stage, done[stage].value)
        curves[stage] = done[stage].value["curve"]
    return {"sweep": sweep, "untrained": untrained, "edit": done["edit"].value, "curves": curves,
            "concept_scores": {k: v for name in ("lora", "lora_default", "lora_ema") for k, v in done[name].value.items()}}


def run_all(out: Path, settings: Settings, quick: bool, device: str, json_path, clock: Clock, seed: int = 0,
            workers: int = 1) -> dict:
    """Every stage in order; returns the JSON summary (also written by the report)."""
    from proving import digits, report
    from proving.curves import reward_mean
    from proving.lora import TRIGGER
    from proving.pretraining import run_pretraining, write_packs
    from proving.seeds import Seeds
    from proving.stages import Stages, choose_base

    seeds = Seeds(seed)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"

    start = time.perf_counter()
    splits = digits.load_splits(RESOLUTION, seeds.split)
    judge, reward, blocks = classifiers(splits, settings, seeds, work)
    clock.phase("data and classifiers", time.perf_counter() - start)
    vae_dir, vae_info = autoencoder(splits, settings, seeds, out, judge, device, clock)

    start = time.perf_counter()
    pre = work / "pretrain"
    count = settings.pretrain_images or len(splits.train)
    packs = write_packs(splits.train[:count], splits.train_labels[:count], pre, settings.pretrain.stages, log=log,
                        seed=seeds.pretrain)
    if not (pre / "result.json").exists():
        spec = dataclasses.replace(settings.pretrain, seed=seeds.pretrain)
        result = run_pretraining(spec, packs, vae_dir, pre / "run", device=device, log=log)
        (pre / "result.json").write_text(json.dumps({"seconds": result.seconds, "checkpoints": result.checkpoints}))
    done = json.loads((pre / "result.json").read_text())
    clock.phase("pretraining (krea2 pack + krea2 pretrain)", time.perf_counter() - start)
    pre_steps, pre_seconds = sum(s.steps for s in settings.pretrain.stages), done["seconds"]

    start = time.perf_counter()
    stages = Stages(out, judge, settings.per_digit, RESOLUTION, device, seeds.eval)
    base_dir, chosen = choose_base(stages, pre / "run", done["checkpoints"], pre_steps - settings.pretrain.stages[-1].steps,
                                   vae_dir, settings.sampling_steps, settings.min_posttrain_error, seeds.select, log)
    selection = (chosen.pop("selection_images"), chosen.pop("selection_labels"))
    base_point = {**judge.evaluate(*selection), "reward": reward_mean(reward.path, *selection)}
    clock.phase("base checkpoint (selection seeds)", time.perf_counter() - start)
    stages_done = after_base(stages, settings, seeds, splits, base_dir, reward.path, base_point, (pre_steps, pre_seconds),
                             chosen, quick, log, clock, workers)
    sweep, curves = stages_done["sweep"], stages_done["curves"]
    edit, untrained, concept_scores = stages_done["edit"], stages_done["untrained"], stages_done["concept_scores"]

    extra = {"seed": seed, "eval_seeds": seeds.as_dict(), "judge": blocks["judge"], "reward": blocks["reward"],
             "cfg_sweep": sweep, "edit": edit, "workers": workers, "total_seconds": round(clock.total, 1), "phases": clock.phases,
             "quick": quick, "device": device, "base_checkpoint": chosen, "untrained": untrained,
             "concept_scores": concept_scores, "resolution": RESOLUTION, "trigger": TRIGGER,
             "settings": dataclasses.asdict(settings)}
    report.write_report(out, stages.rows, vae_info, blocks["classifier"], curves, json_path=json_path, extra=extra)
    print(f"[proving ground] done in {clock.total / 60:.1f} min: {out / 'report.md'}", flush=True)
    return {"stages": stages.rows, "vae": vae_info, "classifier": blocks["classifier"], **extra}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="run folder (samples/, models/, work/, report.md)")
    parser.add_argument("--seed", type=int, default=0,
                        help="every split, initialisation, data order, noise and sampling seed follows it (default 0)")
    parser.add_argument("--quick", action="store_true", help="tiny step counts and few samples (CI): plumbing only")
    parser.add_argument("--json", help="also write the JSON summary here (default DIR/report.json)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every stage runs there)")
    parser.add_argument("--resume", action="store_true", help="reuse what a previous run in DIR finished")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes for the stages that need only the base (default: 2 on a CPU with 2+ cores, else 1)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    check_out_dir(out, args.resume)
    settings = QUICK if args.quick else FULL
    import proving.pretraining

    proving.pretraining.IN_PROCESS = args.quick  # CI: the same commands without a process (and its imports) each
    if args.device == "cpu":  # the project's thread rule for this width (the krea2 commands apply it too)
        from krea2_diffusers.cpu_threads import choose_cpu_threads

        choose_cpu_threads(width=WIDTH)
    workers = args.workers if args.workers is not None else (min(2, os.cpu_count() or 1) if args.device == "cpu" else 1)
    if workers < 1:
        raise SystemExit(f"--workers {workers}: must be at least 1")
    run_all(out, settings, quick=args.quick, device=args.device, json_path=args.json, clock=Clock(), seed=args.seed,
            workers=workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
