"""Pretraining through the product: the training split written as a captioned image folder,
``krea2 pack`` at each stage's resolution (caption features precomputed with the frozen tiny
Qwen3-VL), ``krea2 pretrain`` over the stages (WSD schedule per stage, most steps at the low
resolution), ``krea2 export`` of chosen checkpoints, and a model folder ``Krea2Pipeline.from_pretrained``
loads (that transformer + the bench's VAE + the tiny text encoder and the real Qwen tokenizer).

Every command runs as its own process, as a user would run it (:func:`krea2`); ``--quick`` runs
them in the bench's process instead (:data:`IN_PROCESS`: the same ``krea2`` entry point and
arguments, without paying ~7 s of torch / diffusers / peft imports per command in CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .digits import described_captions, write_folder

ROOT = Path(__file__).resolve().parents[2]
TEXT_ENCODER = "tiny-random"  # the frozen tiny Qwen3-VL (fixed seed) with the real tokenizer


@dataclass
class Stage:
    """One pretraining stage: ``resolution`` px, ``steps`` steps of ``batch_size`` samples."""

    name: str
    resolution: int
    steps: int
    batch_size: int


@dataclass
class PretrainSpec:
    """What the bench pretrains: the transformer's dimensions (``ArchitectureConfig`` keys), the stages,
    AdamW's peak learning rate and the checkpoint interval (every checkpoint can be exported)."""

    stages: list[Stage]
    architecture: dict
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    checkpoint_every: int = 100
    seed: int = 0
    caption_dropout: float = 0.1


@dataclass
class PretrainResult:
    run_dir: Path
    steps: int
    seconds: float
    checkpoints: list[int] = field(default_factory=list)


IN_PROCESS = False
"""Run :func:`krea2` commands through ``krea2_diffusers.cli.main`` in this process (set by ``--quick``)."""


def resume_flag(config: dict) -> list[str]:
    """``["--resume"]`` when ``config["output_dir"]`` holds a run (``run.json``) that a killed bench
    left: the proving ground's ``--resume`` then continues it from its last checkpoint instead of
    failing on a folder that holds a run. Every training command of the bench (pretrain, train,
    posttrain) passes it."""
    return ["--resume"] if (Path(config["output_dir"]) / "run.json").exists() else []


def checkpoint_steps(run_dir: Path, every: int | None = None, extra=()) -> list[int]:
    """The steps of ``run_dir/checkpoints/step-N``, ascending; with ``every``, only the scheduled ones
    (multiples of ``every``, and the steps in ``extra``: the run's ``checkpointing.steps``). A checkpoint a stop signal wrote between them (a killed bench's SIGTERM:
    the trainer saves before it exits) is left out, so that a resumed run offers the bench the same
    choice as an uninterrupted one: seed 0's GRPO once published a step-53 checkpoint that only the
    interrupted run had."""
    steps = sorted(int(p.name.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*") if p.is_dir())
    return [s for s in steps if every is None or s % every == 0 or s in extra]


def krea2(*args: str, device: str = "cpu", log: Path | None = None) -> None:
    """Run ``krea2 ARGS`` in its own process from this checkout (``python -m krea2_diffusers.cli``), or
    in this one when :data:`IN_PROCESS`; its output appended to ``log``; a failure raises with the
    output's tail."""
    if IN_PROCESS:
        return krea2_in_process(args, log)
    # bench/ too: krea2 posttrain imports the bench's reward plug-in (proving.rewards).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    from .lifetime import die_with_parent

    done = subprocess.run([sys.executable, "-m", "krea2_diffusers.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, preexec_fn=die_with_parent)
    if log is not None:
        with open(log, "a") as handle:
            handle.write(f"$ krea2 {' '.join(args)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        raise RuntimeError(f"krea2 {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def krea2_in_process(args: tuple[str, ...], log: Path | None) -> None:
    """:func:`krea2` in this process: the CLI's ``main(args)``, its output captured the same way."""
    import contextlib
    import io

    from krea2_diffusers.cli import main

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = exit.code
    if log is not None:
        with open(log, "a") as handle:
            handle.write(f"$ krea2 {' '.join(args)}  (in process)\n{output.getvalue()}\n")
    if code not in (0, None):
        raise RuntimeError(f"krea2 {' '.join(args)} failed ({code}):\n{output.getvalue()[-4000:]}")


def write_packs(images, labels, work_dir: Path, stages: list[Stage], log: Path | None = None, seed: int = 0) -> dict[str, Path]:
    """The training split as ``work_dir/images`` (PNG + a caption that describes the scan:
    :func:`~proving.digits.described_captions`), then one ``krea2 pack`` per stage
    (it resizes to the stage's resolution; rows shuffled by ``seed``) with caption features
    precomputed. Returns {stage: pack}."""
    folder = write_folder(Path(work_dir) / "images", images, described_captions(images, labels))
    packs = {}
    for stage in stages:
        pack = Path(work_dir) / "packs" / stage.name
        if not (pack / "pack.json").exists():
            krea2("pack", str(folder), str(pack), "--resolution", str(stage.resolution), "--batch-size",
                  str(stage.batch_size), "--text-encoder", TEXT_ENCODER, "--seed", str(seed), log=log)
        packs[stage.name] = pack
    return packs


def pretrain_config(spec: PretrainSpec, packs: dict[str, Path], vae_folder: Path, run_dir: Path) -> dict:
    """The ``krea2 pretrain`` YAML mapping: AdamW, WSD per stage (warmup in the first stage only),
    checkpoints every ``checkpoint_every`` steps, all kept (the bench picks among them)."""
    total = sum(s.steps for s in spec.stages)
    stages = []
    for index, stage in enumerate(spec.stages):
        stages.append({
            "name": stage.name, "data": str(packs[stage.name]), "resolution": stage.resolution,
            "batch_size": stage.batch_size, "steps": stage.steps,
            "lr_scheduler": {"name": "wsd", "warmup_steps": spec.warmup_steps if index == 0 else 0, "decay_fraction": 0.2},
        })
    return {
        "output_dir": str(run_dir),
        "model": {"architecture": spec.architecture, "init": "scratch", "text_encoder": TEXT_ENCODER,
                  "vae": str(vae_folder), "max_sequence_length": 32},
        "optimizer": {"name": "adamw", "learning_rate": spec.learning_rate},
        "captions": {"long": 1.0, "medium": 0.0, "short": 0.0, "dropout": spec.caption_dropout},
        "checkpointing": {"every_n_steps": spec.checkpoint_every, "keep_last": max(1, total // spec.checkpoint_every + 1)},
        "training": {"seed": spec.seed},
        "stages": stages,
    }


def run_pretraining(spec: PretrainSpec, packs: dict[str, Path], vae_folder: Path, run_dir: Path, device: str = "cpu",
                    log: Path | None = None) -> PretrainResult:
    """``krea2 pretrain`` over ``spec``'s stages into ``run_dir`` (continued when a killed bench left a run there)."""
    from krea2_diffusers.files import atomic_write

    run_dir = Path(run_dir)
    config_path = run_dir.parent / f"{run_dir.name}.yaml"
    config = pretrain_config(spec, packs, vae_folder, run_dir)
    with atomic_write(config_path, "w") as handle:
        handle.write(yaml.safe_dump(config, sort_keys=False))
    start = time.perf_counter()
    krea2("pretrain", str(config_path), *resume_flag(config), device=device, log=log)
    seconds = time.perf_counter() - start
    return PretrainResult(run_dir, sum(s.steps for s in spec.stages), seconds, checkpoint_steps(run_dir, spec.checkpoint_every))


def export_model(run_dir: Path, step: int, vae_folder: Path, out: Path, log: Path | None = None) -> Path:
    """``krea2 export`` of checkpoint ``step`` (its transformer), assembled with the VAE and the tiny
    text encoder + tokenizer into a ``Krea2Pipeline.from_pretrained`` folder at ``out`` (atomic)."""
    import shutil

    from krea2_diffusers import Krea2Pipeline, Krea2Transformer2DModel
    from krea2_diffusers.files import atomic_write_dir
    from krea2_diffusers.loaders import assembly

    from .autoencoder import load_autoencoder

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; the bench never overwrites a model folder")
    staging = Path(run_dir) / "exports" / f"step-{step}"
    if not (staging / "transformer" / "config.json").exists():
        shutil.rmtree(staging, ignore_errors=True)
        krea2("export", str(Path(run_dir) / "checkpoints" / f"step-{step}"), str(staging), "--format", "diffusers", log=log)
    pipe = Krea2Pipeline(
        transformer=Krea2Transformer2DModel.from_pretrained(staging / "transformer"),
        text_encoder=assembly.load_text_encoder(TEXT_ENCODER), tokenizer=assembly.load_tokenizer(None, TEXT_ENCODER),
        vae=load_autoencoder(vae_folder), scheduler=_scheduler(),
    )
    with atomic_write_dir(out) as tmp:
        pipe.save_pretrained(tmp)
        (tmp / "proving_ground.json").write_text(json.dumps({"checkpoint": f"step-{step}", "run": str(run_dir)}))
    return out


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from krea2_diffusers.models.tiny import scheduler_config

    return FlowMatchEulerDiscreteScheduler(**scheduler_config())
