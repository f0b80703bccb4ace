#!/usr/bin/env python
"""The proving ground (issue 32): a Krea 2 of the real architecture, CPU-sized, trained from scratch on
scikit-learn's real handwritten digits with this project's own commands, then measured stage by stage.

    python bench/proving_ground.py --out DIR [--quick] [--json OUT] [--device cpu|cuda] [--resume]

Stages: data + the evaluation classifier (judge) + the reward classifier; the autoencoder (the bench's
one training loop); ``krea2 pack`` + ``krea2 pretrain`` (two resolution stages, WSD) and the model
folder; the concept LoRA (``krea2 train``); DPO, GRPO, DRaFT and the TDM student (``krea2 posttrain``);
samples of every stage through ``Krea2Pipeline``; ``DIR/report.md`` and the JSON. See the README's
"Proving ground" section for the measured full run.

``--resume`` reuses what an interrupted run in DIR finished (the VAE, packs, pretraining run, model
folders); without it DIR must be new or empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from proving.lora import LoraSpec  # noqa: E402
from proving.pretraining import PretrainSpec, Stage  # noqa: E402

RESOLUTION = 64
# Width 192 (6 heads of 32), 6 blocks; the text path reads the tiny Qwen3-VL (hidden 32, 12 tapped layers).
ARCHITECTURE = dict(
    num_layers=6, attention_head_dim=32, num_attention_heads=6, num_key_value_heads=6, intermediate_size=512,
    timestep_embed_dim=64, text_hidden_dim=32, num_text_layers=12, text_num_attention_heads=2, text_num_key_value_heads=2,
    text_intermediate_size=64, num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=[8, 12, 12],
)


@dataclass
class Settings:
    """Everything a run's size depends on (:data:`FULL`, :data:`QUICK`)."""

    vae_steps: int
    pretrain: PretrainSpec
    lora: LoraSpec
    per_digit: int
    """Samples per digit and stage."""
    guidance: float
    """``base``'s CFG scale (Krea convention, 0 = off)."""
    sampling_steps: int
    """Euler steps of base, base_nocfg, lora, lora_off and the post-trained stages."""
    judge_epochs: int
    pretrain_images: int | None = None
    """Pretrain on the first N scans of the training split (None: all 1,437)."""
    min_posttrain_error: float = 0.10
    """Post-training starts from the latest checkpoint whose guidance-free error is at least this."""


FULL = Settings(
    vae_steps=400,
    pretrain=PretrainSpec(stages=[Stage("s32", 32, 2500, 32), Stage("s64", 64, 500, 32)], architecture=ARCHITECTURE,
                          learning_rate=1.5e-3, warmup_steps=50, checkpoint_every=100),
    # 600 steps, 1e-3, a fifth of the concept images with the empty caption (the uncond branch then
    # carries the concept too, so CFG does not amplify its leak into prompts without the trigger):
    # measured on the full run's base, accuracy 0.98, concept 0.945, lora_off concept 0.0; without
    # the dropout 0.715 / 1.0 / 0.22 (300 steps), at 2e-3 and 150 steps 0.605 / 1.0 / 0.235.
    lora=LoraSpec(steps=600, batch_size=16, rank=8, learning_rate=1e-3, images=300, concept_caption_dropout=0.2),
    per_digit=20, guidance=3.0, sampling_steps=16, judge_epochs=40,
)
QUICK = Settings(
    vae_steps=60,
    pretrain=PretrainSpec(stages=[Stage("s32", 32, 40, 16), Stage("s64", 64, 10, 16)], architecture=ARCHITECTURE,
                          learning_rate=2e-3, warmup_steps=5, checkpoint_every=25),
    lora=LoraSpec(steps=60, batch_size=8, rank=8, learning_rate=6e-3, images=64),
    per_digit=2, guidance=3.0, sampling_steps=8, judge_epochs=5, pretrain_images=256,
)
STAGE_WHAT = {
    "base_nocfg": "pretrained (krea2 pack + krea2 pretrain), guidance 0",
    "base": "pretrained, CFG",
    "lora": "concept LoRA (krea2 train), trigger in the prompt",
    "lora_off": "same LoRA loaded, prompt without the trigger",
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


def evaluate(judge, images, labels, what: str, steps, seconds, num_inference_steps: int, guidance: float, **extra) -> dict:
    """One stage's row: the judge's accuracy, FD and diversity plus what produced the samples."""
    row = {"what": what, "steps": steps, "seconds": None if seconds is None else round(seconds, 1),
           "num_inference_steps": num_inference_steps, "guidance": guidance, **judge.evaluate(images, labels), **extra}
    print(f"[proving ground] {what}: accuracy {row['accuracy']:.3f}, FD {row['fd']:.2f}, diversity {row['diversity']:.2f}",
          flush=True)
    return row


def sample_stage(out: Path, stage: str, settings: Settings, device: str, pipe, steps: int, guidance: float,
                 trigger: str | None = None):
    """Sample ``settings.per_digit`` images of every digit with ``pipe`` and save them under DIR/samples/<stage>."""
    from proving.sampling import generate, save_samples

    images, labels = generate(None, range(10), settings.per_digit, guidance, steps, seed=0, trigger=trigger, device=device,
                              resolution=RESOLUTION, pipe=pipe)
    save_samples(out, stage, images, labels)
    return images, labels


def choose_base(out: Path, settings: Settings, run_dir: Path, checkpoints: list[int], vae_dir: Path, judge, device: str,
                log: Path) -> tuple[Path, dict, tuple]:
    """The model post-training starts from: the latest checkpoint of the last (final-resolution) stage
    whose guidance-free error is >= ``settings.min_posttrain_error`` (room to improve, as post-training
    has on a real model), checking at most three, newest first. Returns its folder (``DIR/models/base``),
    how it was chosen, and its guidance-free samples (they are ``base_nocfg``'s)."""
    import shutil

    from krea2_diffusers.files import atomic_write_dir
    from proving.pretraining import export_model
    from proving.sampling import load_pipeline

    last_stage_start = sum(s.steps for s in settings.pretrain.stages[:-1])
    candidates = [c for c in sorted(checkpoints, reverse=True) if c > last_stage_start][:3]
    tried = []
    for step in candidates:
        folder = export_model(run_dir, step, vae_dir, out / "work" / "candidates" / f"step-{step}", log=log) \
            if not (out / "work" / "candidates" / f"step-{step}").exists() else out / "work" / "candidates" / f"step-{step}"
        start = time.perf_counter()
        images, labels = sample_stage(out, "base_nocfg", settings, device, load_pipeline(folder, device), settings.sampling_steps, 0.0)
        error = 1 - judge.accuracy(images, labels)
        tried.append({"step": step, "guidance0_error": round(error, 4), "sampling_seconds": round(time.perf_counter() - start, 1)})
        print(f"[proving ground] checkpoint step-{step}: guidance-0 error {error:.3f}", flush=True)
        if error >= settings.min_posttrain_error:
            break
    chosen = tried[-1]
    base = out / "models" / "base"
    if not base.exists():
        with atomic_write_dir(base) as tmp:
            shutil.copytree(out / "work" / "candidates" / f"step-{chosen['step']}", tmp, dirs_exist_ok=True)
    why = (f"latest final-stage checkpoint with guidance-0 error >= {settings.min_posttrain_error}"
           if chosen["guidance0_error"] >= settings.min_posttrain_error else
           f"no checkpoint tried had guidance-0 error >= {settings.min_posttrain_error}: the oldest tried")
    return base, {"checkpoint": f"step-{chosen['step']}", "why": why, "tried": tried}, (images, labels)


def run_all(out: Path, settings: Settings, quick: bool, device: str, json_path, clock: Clock) -> dict:
    """Every stage in order; returns the JSON summary (also written by the report)."""
    import numpy as np
    import torch

    from proving import digits, posttraining, report
    from proving.autoencoder import load_autoencoder, reconstruct, train_autoencoder
    from proving.judge import train_judge
    from proving.lora import TRIGGER, run_lora
    from proving.pretraining import run_pretraining, write_packs
    from proving.rewards import train_reward
    from proving.sampling import load_pipeline

    work, models = out / "work", out / "models"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    S, G = settings.sampling_steps, settings.guidance

    start = time.perf_counter()
    splits = digits.load_splits(RESOLUTION)
    judge = train_judge(splits, epochs=settings.judge_epochs)
    judge.save(work / "judge.safetensors")
    reward = train_reward(splits, work / "reward.safetensors", epochs=settings.judge_epochs)
    red = digits.render(splits.heldout_scans, RESOLUTION, digits.RED_INK)
    classifier = {"judge_heldout_accuracy": judge.heldout_accuracy, "judge_heldout_diversity": judge.heldout_diversity,
                  "reward_heldout_accuracy": reward.heldout_accuracy,
                  "concept_measure": {"red_heldout_shows": float(digits.shows_red_ink(red).mean()),
                                      "black_heldout_shows": float(digits.shows_red_ink(splits.heldout).mean())}}
    clock.phase("data and classifiers", time.perf_counter() - start)

    vae_dir = models / "vae"
    if not vae_dir.exists():
        # Black and red renderings of the training scans: a VAE that only ever saw grey cannot decode
        # the LoRA's red ink (measured: a LoRA on a black-only VAE gave faded grey, 0% red).
        pool = np.concatenate([splits.train, digits.render(splits.train_scans, RESOLUTION, digits.RED_INK)])
        result = train_autoencoder(pool, splits.heldout, vae_dir, settings.vae_steps, device=device,
                                   log=lambda m: print(f"[proving ground] {m}", flush=True))
        vae_train = {"steps": result.steps, "seconds": round(result.seconds, 1)}
        clock.phase("autoencoder", result.seconds)
    else:
        vae_train = json.loads((work / "vae.json").read_text()) if (work / "vae.json").exists() else {}
    (work / "vae.json").write_text(json.dumps(vae_train))
    recon = reconstruct(load_autoencoder(vae_dir, device), splits.heldout, device=device)
    mse = float(((recon.astype(np.float64) - splits.heldout) ** 2).mean() / 255**2)
    vae_info = {**vae_train, "mse": mse, "psnr": float(10 * np.log10(1 / max(mse, 1e-12))),
                "judge_accuracy": judge.accuracy(recon, splits.heldout_labels),
                "judge_accuracy_originals": judge.heldout_accuracy}

    start = time.perf_counter()
    pre = work / "pretrain"
    count = settings.pretrain_images or len(splits.train)
    packs = write_packs(splits.train[:count], splits.train_labels[:count], pre, settings.pretrain.stages, log=log)
    if not (pre / "result.json").exists():
        result = run_pretraining(settings.pretrain, packs, vae_dir, pre / "run", device=device, log=log)
        (pre / "result.json").write_text(json.dumps({"seconds": result.seconds, "checkpoints": result.checkpoints}))
    done = json.loads((pre / "result.json").read_text())
    clock.phase("pretraining (krea2 pack + krea2 pretrain)", time.perf_counter() - start)
    pre_steps, pre_seconds = sum(s.steps for s in settings.pretrain.stages), done["seconds"]

    start = time.perf_counter()
    base_dir, chosen, (images, labels) = choose_base(out, settings, pre / "run", done["checkpoints"], vae_dir, judge, device, log)
    rows = {"base_nocfg": evaluate(judge, images, labels, STAGE_WHAT["base_nocfg"] + f" ({chosen['checkpoint']})",
                                   pre_steps, pre_seconds, S, 0.0)}
    pipe = load_pipeline(base_dir, device)
    for stage, steps in (("base", S), ("teacher_4", 4), ("teacher_28", 28)):
        images, labels = sample_stage(out, stage, settings, device, pipe, steps, G)
        rows[stage] = evaluate(judge, images, labels, STAGE_WHAT[stage], pre_steps, pre_seconds, steps, G)
    # The same pipeline with the transformer as pretraining starts it (scratch init): what pretraining improved on.
    from finetune.pretrain.architecture import init_from_scratch_

    torch.manual_seed(0)
    init_from_scratch_(pipe.transformer)
    images, labels = sample_stage(out, "untrained", settings, device, pipe, S, G)
    untrained = evaluate(judge, images, labels, "scratch-initialised transformer, CFG", 0, 0.0, S, G)
    del pipe
    clock.phase("base samples", time.perf_counter() - start)

    start = time.perf_counter()
    lora_file = models / "lora" / "lora_diffusers.safetensors"
    result = run_lora(settings.lora, splits, base_dir, work / "lora", lora_file, device=device, log=log) \
        if not lora_file.exists() else None
    lora_seconds = result.seconds if result else None
    pipe = load_pipeline(base_dir, device, lora=lora_file)
    concept_scores = {}  # the mean red share of ink: a graded view of the same measure
    for stage, trigger in (("lora", TRIGGER), ("lora_off", None)):
        images, labels = sample_stage(out, stage, settings, device, pipe, S, G, trigger=trigger)
        rows[stage] = evaluate(judge, images, labels, STAGE_WHAT[stage], settings.lora.steps, lora_seconds, S, G,
                               concept=float(digits.shows_red_ink(images).mean()))
        concept_scores[stage] = float(digits.red_ink_share(images).mean())
    del pipe
    clock.phase("lora (krea2 train) + samples", time.perf_counter() - start)

    curves = {}
    common = dict(resolution=RESOLUTION, models_dir=models)
    for stage, run in (("dpo", lambda: posttraining.run_dpo(base_dir, work / "posttrain", quick, device, reward=reward.path,
                                                            sampling_steps=S, **common)),
                       ("grpo", lambda: posttraining.run_grpo(base_dir, work / "posttrain", quick, device, reward=reward.path,
                                                              judge=work / "judge.safetensors", sampling_steps=S, **common)),
                       ("draft", lambda: posttraining.run_draft(base_dir, work / "posttrain", quick, device, reward=reward.path,
                                                                judge=work / "judge.safetensors", sampling_steps=S, **common)),
                       ("student_4", lambda: posttraining.run_distill(base_dir, work / "posttrain", quick, device,
                                                                      teacher_guidance=G, **common))):
        result = run()
        if result.curve:
            curves[stage] = result.curve
        pipe = load_pipeline(base_dir if result.lora else result.model_dir, device, lora=result.model_dir if result.lora else None)
        steps, guidance = (4, 0.0) if stage == "student_4" else (S, 0.0)
        images, labels = sample_stage(out, stage, settings, device, pipe, steps, guidance)
        rows[stage] = evaluate(judge, images, labels, STAGE_WHAT[stage], result.steps, result.seconds, steps, guidance)
        del pipe
        clock.phase(stage, result.seconds)

    extra = {"total_seconds": round(clock.total, 1), "phases": clock.phases, "quick": quick, "device": device,
             "base_checkpoint": chosen, "untrained": untrained, "concept_scores": concept_scores, "resolution": RESOLUTION, "trigger": TRIGGER,
             "settings": dataclasses.asdict(settings)}
    report.write_report(out, rows, vae_info, classifier, curves, json_path=json_path, extra=extra)
    print(f"[proving ground] done in {clock.total / 60:.1f} min: {out / 'report.md'}", flush=True)
    return {"stages": rows, "vae": vae_info, "classifier": classifier, **extra}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="run folder (samples/, models/, work/, report.md)")
    parser.add_argument("--quick", action="store_true", help="tiny step counts and few samples (CI): plumbing only")
    parser.add_argument("--json", help="also write the JSON summary here (default DIR/report.json)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every stage runs there)")
    parser.add_argument("--resume", action="store_true", help="reuse what a previous run in DIR finished")
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

        choose_cpu_threads(width=ARCHITECTURE["num_attention_heads"] * ARCHITECTURE["attention_head_dim"])
    run_all(out, settings, quick=args.quick, device=args.device, json_path=args.json, clock=Clock())
    return 0


if __name__ == "__main__":
    sys.exit(main())
