"""Post-training and distillation stages of the proving ground, each through ``krea2 posttrain``.

DPO (pairs ranked by the reward classifier: rejected from the base's guidance-free samples,
chosen from those and, with ``chosen_guidance``, the base's CFG samples),
GRPO and DRaFT (the reward plug-in :class:`proving.rewards.DigitReward`) and TDM (a 4-step
student). Every stage writes its config as YAML into ``work_dir`` (so a run can be repeated by
hand with ``krea2 posttrain``), runs the product's CLI in its own process with ``bench/`` on
``PYTHONPATH`` (where the reward plug-in lives), and copies what it exported into
``models/<stage>/``: ``lora_diffusers.safetensors`` for a LoRA, a model folder (the base's folder
with the trained ``transformer/``) for full weights.

Issue 39: DPO, GRPO and DRaFT keep a checkpoint every ``curve_every`` steps; the bench samples each
from its selection seeds (:mod:`proving.curves`) and publishes the one :func:`proving.frontier.choose_checkpoint`
chooses, so this module returns the run, not a published model, for them. Their in-training
evaluation is off (the curve replaces it). The reward they train on is the reward's half-split
model (:mod:`proving.rewards`), not the one the settings below were tuned with (trained on every
training scan): the settings stay those of the tuning runs, measured again by the full runs.

The ``quick`` settings only prove the plumbing in CI. The full settings (:data:`SETTINGS`) were
tuned stage by stage on the full run's base (pretrained 2500 steps at 32 px + 500 at 64 px;
guidance-free accuracy 0.850, diversity 24.4, 20 samples per digit, 16 Euler steps):

- DPO: pairs ranked by the reward over the base's guidance-free samples AND as many CFG samples
  (``chosen_guidance``; rejected: the worst guidance-free ones). CFG 3 candidates: 200 steps 0.915,
  300 0.955 (the settings until issue 39's frontier: they taught CFG 3's bold strokes, FD 47.5 / 44.1 at
  seeds 0 / 1 where the frontier's bound was 28.6 / 35.8). CFG 1 candidates, 600 steps (the settings; chosen at training seed 0 on the
  tuning sampling block against that block's own CFG sweep): accuracy 0.98 / 0.985 / 0.98 at steps
  400 / 500 / 600, FD 23.8-25.9 where CFG needs 28-30 for that accuracy; CFG 0.5 candidates reached
  0.95 at FD 23.5 (600 steps) and swung between 23.5 and 41.6 on the way. That block turned out to be
  DPO's best of five (the spread table in ``bench/proving/HISTORY.md``: FD 23.8-38.8 for the same
  weights). On the earlier, weaker base (guidance-free 0.570), on-policy pairs alone peaked at 0.615
  (200 steps), 800 steps 0.58, lr 5e-3 0.31, lr 1e-2 / beta 5000 collapsed (0.135).
  Tried later on the Zen 4 seed-0 base (selection seeds, against its CFG sweep; FD / frontier at steps
  100-600), none adopted: beta 2000 1.09-1.48; ``sft_weight`` 0 0.91-2.41; 64 candidates a digit instead
  of 16 (320 pairs): from CFG 1 0.68-3.11, guidance-free only 0.84-1.73; at lr 5e-4 guidance-free only
  0.88-1.09 (accuracy 0.795-0.835) and CFG 1 0.90-1.22 (0.81-0.90): slower, it walks along the frontier
  instead of past it (the settings: 0.91-2.07).
- GRPO: the exploring window pinned to the first four (high-noise) steps, ``sde_window_start`` 0,
  where the digit is decided: 150 steps of 16 rollouts 0.975 (diversity 16.0); on the earlier base
  0.76 against 0.58 for a random window with the same budget (lr 5e-3 there fell: reward 0.50 -> 0.21).
- DRaFT (issue 39, the round after the frontier): back-propagated through every sampling step
  (``draft_k`` 16) with the base anchor (``anchor_weight`` 1.0), 100 steps at lr 1e-3, batch 8, the
  bounded ``prob`` reward. Chosen at seed 0 of the Zen 4 machine's runs (its base), on the selection
  seeds' curves against that run's CFG sweep, from four runs (accuracy / FD on the selection seeds,
  the base 0.78 / 25.7): the old settings (``draft_k`` 2, 250 steps) reach reward 0.98 while the
  judge's accuracy falls to 0.645 at FD 237 (the hack); ``draft_k`` 6, lr 1e-3: 0.845-0.945 at FD
  74-167 (2.4-4.6x the frontier's FD); ``draft_k`` 16 at lr 1e-3 without the anchor: 0.955 at FD 81.6
  by step 50 (1.45x); at lr 3e-4: along the frontier (1.0-1.1x) to 0.845, then 1.2-1.4x; with the
  anchor at 1.0: 0.835 / 29.4, 0.92 / 37.7, 0.96 / 38.3, 0.97 / 33.9, 0.975 / 28.3 at steps 20-100
  (0.42-1.02x; 0.98 / 31.7 at 120); anchor 10: 0.89-0.90 at FD 21-27. Earlier (single judge, old
  reward): 250 steps with ``draft_k`` 2 read 0.990; the ``log_prob`` reward was gamed.
- TDM (full weights, trajectory matching, teacher CFG 3): the teacher is perfect at 4 steps already
  (teacher_4 accuracy 1.000, FD 136.6; teacher_28 1.000, FD 129.3), so "error <= 0.6 x teacher_4's"
  asks for a perfect student. 600 steps at lr 2e-4: accuracy 1.000, FD 132.4; 300 steps: 1.000 but
  FD 136.9; 100 steps at 1e-4: 0.995, FD 131.3 (0.765 on the earlier base).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .digits import caption

DIGITS = tuple(range(10))
LORA_FILE = "lora_diffusers.safetensors"


@dataclass
class StageResult:
    """``model_dir``: the published model (TDM: the model folder under ``models/student_4/``) or, for the
    LoRA methods, the run folder whose ``checkpoints/step-N`` the bench evaluates and publishes from;
    ``steps``: optimizer steps; ``seconds``: the stage's wall time (pairs included for DPO);
    ``checkpoint_every``: the run's checkpoint interval (the curve's points)."""

    model_dir: Path
    steps: int
    seconds: float
    lora: bool = True
    checkpoint_every: int | None = None


# Per method: (full run, --quick). Keys are krea2 posttrain config values set below.
SETTINGS = {
    "dpo": ({"steps": 600, "lr": 2e-3, "beta": 500.0, "rank": 16, "per_digit": 16, "batch": 4, "chosen_guidance": 1.0,
             "curve_every": 100},
            {"steps": 2, "lr": 2e-3, "beta": 500.0, "rank": 4, "per_digit": 2, "batch": 2, "chosen_guidance": 3.0,
             "curve_every": 1}),
    "grpo": ({"steps": 150, "lr": 2e-3, "group": 16, "batch": 1, "rank": 16, "kl": 0.3, "clip": 0.01, "noise": 1.0,
              "sde_steps": 4, "sde_window_start": 0, "updates": 1, "curve_every": 50},
             {"steps": 2, "lr": 5e-3, "group": 2, "batch": 1, "rank": 4, "kl": 0.3, "clip": 0.01, "noise": 1.0,
              "sde_steps": 2, "sde_window_start": 0, "updates": 1, "curve_every": 1}),
    "draft": ({"steps": 100, "lr": 1e-3, "batch": 8, "rank": 16, "draft_k": 16, "anchor": 1.0, "kind": "prob",
               "curve_every": 20},
              {"steps": 2, "lr": 5e-3, "batch": 2, "rank": 4, "draft_k": 1, "anchor": 1.0, "kind": "log_prob", "curve_every": 1}),
    "distill": ({"steps": 600, "lr": 2e-4, "batch": 4, "teacher_steps": 28},
                {"steps": 2, "lr": 1e-4, "batch": 2, "teacher_steps": 8}),
}


def settings(method: str, quick: bool) -> dict:
    return dict(SETTINGS[method][1 if quick else 0])


def prompts() -> list[str]:
    return [caption(d) for d in DIGITS]


def base_config(base_dir: Path, run_dir: Path, method: str, steps: int, lr: float, batch: int,
                rank: int | None, seed: int, checkpoint_every: int | None = None) -> dict:
    """The parts every stage shares: the model, LoRA (``rank``) or full weights (``rank=None``),
    a checkpoint every ``checkpoint_every`` steps, all kept (default: one at the end), the diffusers export only."""
    every = checkpoint_every or steps
    config = {
        "output_dir": str(run_dir), "method": method,
        "model": {"pretrained_model_name_or_path": str(base_dir)},
        "training": {"method": "lora" if rank else "full", "max_steps": steps, "batch_size": batch, "seed": seed},
        "optimizer": {"learning_rate": lr},
        "checkpointing": {"every_n_steps": every, "keep_last": steps // every + 1},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    if rank:
        config["lora"] = {"rank": rank, "alpha": rank, "extra_modules": ["final_layer.linear"]}
    return config


def run_posttrain(config: dict, config_path: Path, device: str = "cpu") -> float:
    """Write ``config`` to ``config_path`` and run ``krea2 posttrain`` on it (the bench's one
    command runner, :func:`proving.pretraining.krea2`, which puts ``bench/`` on ``PYTHONPATH`` for
    the reward plug-in); its output goes to ``<config>.log``; a run a killed bench left in the
    config's ``output_dir`` continues from its last checkpoint (:func:`proving.pretraining.resume_flag`).
    Seconds taken."""
    from krea2_diffusers.files import atomic_write

    from .pretraining import krea2, resume_flag

    config_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(config_path, "w") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    start = time.perf_counter()
    krea2("posttrain", str(config_path), *resume_flag(config), device=device, log=config_path.with_suffix(".log"))
    return time.perf_counter() - start


def publish(run_dir: Path, base_dir: Path, model_dir: Path, lora: bool) -> Path:
    """Copy the run's export into ``model_dir``: the LoRA file, or the base folder with the
    trained ``transformer/`` (a folder ``Krea2Pipeline.from_pretrained`` loads). Returns the
    LoRA file or the folder."""
    if model_dir.exists():
        shutil.rmtree(model_dir)
    if lora:
        model_dir.mkdir(parents=True)
        return Path(shutil.copy2(run_dir / LORA_FILE, model_dir / LORA_FILE))
    shutil.copytree(base_dir, model_dir, ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(run_dir / "transformer", model_dir / "transformer")
    return model_dir


def reward_options(reward: Path, kind: str = "prob") -> dict:
    return {"path": str(reward), "kind": kind}


def run_dpo(base_dir, work_dir, quick: bool, device: str = "cpu", *, reward: Path, resolution: int,
            sampling_steps: int, seed: int, pool_seed: int, guided_seed: int) -> StageResult:
    """Diffusion-DPO on pairs of the base's own guidance-free samples (noise seeds from ``pool_seed``;
    the CFG candidates from ``guided_seed``): per digit, the reward's best sample is chosen over its
    worst, the second best over the second worst, and so on. ``seed``: the run's ``training.seed``."""
    base_dir, work_dir, s = Path(base_dir), Path(work_dir), settings("dpo", quick)
    start = time.perf_counter()
    manifest = make_pairs(base_dir, work_dir / "dpo_pairs", reward, s["per_digit"], sampling_steps, resolution, device,
                          pool_seed=pool_seed, guided_seed=guided_seed, chosen_guidance=s.get("chosen_guidance"))
    run_dir = work_dir / "dpo"
    config = base_config(base_dir, run_dir, "dpo", s["steps"], s["lr"], s["batch"], s["rank"], seed, s["curve_every"])
    config["dpo"] = {"data": str(manifest), "resolution": resolution, "beta": s["beta"], "sft_weight": 1.0,
                     "chosen_anchor_weight": 1.0, "heldout_pairs": 2, "eval_every_n_steps": s["steps"]}
    run_posttrain(config, work_dir / "dpo.yaml", device)
    return StageResult(run_dir, s["steps"], time.perf_counter() - start, checkpoint_every=s["curve_every"])


def make_pairs(base_dir: Path, folder: Path, reward: Path, per_digit: int, sampling_steps: int, resolution: int,
               device: str, *, pool_seed: int, guided_seed: int, chosen_guidance: float | None = None) -> Path:
    """Sample ``per_digit`` guidance-free images per digit from the base, score them with the
    reward classifier, write PNGs and ``pairs.jsonl`` (prompt, chosen, rejected; paths relative
    to it). Returns the manifest.

    ``chosen_guidance``: also sample ``per_digit`` images per digit with that CFG scale from
    ``guided_seed`` (the guidance-free ones from ``pool_seed``); the chosen side is then ranked over both pools (the reward picks; guided samples win
    more often), the rejected side stays the guidance-free samples'. As preference data is made
    in practice (candidates from several sampler settings, a judge picks), and what DPO then
    teaches the guidance-free model is what guidance bought."""
    import torch
    from PIL import Image

    from krea2_diffusers.files import atomic_path, atomic_write

    from .judge import to_tensor
    from .rewards import DigitReward
    from .sampling import generate

    # Sampling blocks of their own (proving.seeds): DPO never sees the report's images.
    images, labels = generate(base_dir, list(DIGITS), per_digit, guidance=0.0, steps=sampling_steps, seed=pool_seed,
                              device=device, resolution=resolution)
    free = len(labels)
    if chosen_guidance is not None:
        guided, guided_labels = generate(base_dir, list(DIGITS), per_digit, guidance=chosen_guidance, steps=sampling_steps,
                                         seed=guided_seed, device=device, resolution=resolution)
        images, labels = np.concatenate([images, guided]), np.concatenate([labels, guided_labels])
    with torch.no_grad():
        scores = DigitReward(str(reward))(to_tensor(images), [caption(d) for d in labels], [{} for _ in labels])
    scores = scores.numpy()
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for digit in DIGITS:
        index = np.flatnonzero(np.asarray(labels) == digit)
        best = index[np.argsort(-scores[index], kind="stable")]
        worst = [i for i in best[::-1] if i < free]  # guidance-free samples, worst first
        for rank in range(per_digit // 2):
            chosen, rejected = best[rank], worst[rank]
            names = []
            for kind, i in (("chosen", chosen), ("rejected", rejected)):
                name = f"{digit}_{rank}_{kind}.png"
                with atomic_path(folder / name) as tmp:
                    Image.fromarray(images[i]).save(tmp, format="PNG")
                names.append(name)
            rows.append({"prompt": caption(digit), "chosen": names[0], "rejected": names[1],
                         "reward_chosen": float(scores[chosen]), "reward_rejected": float(scores[rejected])})
    # Interleave digits so the manifest's last pairs (held out by dpo.heldout_pairs) are not all one digit.
    rows.sort(key=lambda r: (int(r["chosen"].split("_")[1]), r["prompt"]))
    manifest = folder / "pairs.jsonl"
    with atomic_write(manifest, "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    return manifest


def run_grpo(base_dir, work_dir, quick: bool, device: str = "cpu", *, reward: Path, resolution: int,
             sampling_steps: int, seed: int) -> StageResult:
    """GRPO with the reward classifier's probability of the prompted digit, guidance-free rollouts."""
    base_dir, work_dir, s = Path(base_dir), Path(work_dir), settings("grpo", quick)
    run_dir = work_dir / "grpo"
    config = base_config(base_dir, run_dir, "grpo", s["steps"], s["lr"], s["batch"], s["rank"], seed, s["curve_every"])
    config["grpo"] = {
        "prompts": prompts(), "group_size": s["group"], "num_inference_steps": sampling_steps, "resolution": resolution,
        "noise_level": s["noise"], "clip_range": s["clip"], "kl_weight": s["kl"],
        # A window of sde_steps explores and is trained, the ODE elsewhere: the cost of a
        # step scales with the window, not with the sampler's step count.
        "sde_steps": min(s["sde_steps"], sampling_steps), "sde_window_start": s.get("sde_window_start"),
        "updates_per_rollout": s["updates"],
        "rewards": [{"function": "proving.rewards:DigitReward", "options": reward_options(reward)}],
        "eval_every_n_steps": 0,
    }
    seconds = run_posttrain(config, work_dir / "grpo.yaml", device)
    return StageResult(run_dir, s["steps"], seconds, checkpoint_every=s["curve_every"])


def run_draft(base_dir, work_dir, quick: bool, device: str = "cpu", *, reward: Path, resolution: int,
              sampling_steps: int, seed: int) -> StageResult:
    """DRaFT-K through the last ``draft_k`` steps (the full run: every step) and the VAE decode into
    the reward classifier, anchored to the base (``draft.anchor_weight``)."""
    base_dir, work_dir, s = Path(base_dir), Path(work_dir), settings("draft", quick)
    run_dir = work_dir / "draft"
    config = base_config(base_dir, run_dir, "draft", s["steps"], s["lr"], s["batch"], s["rank"], seed, s["curve_every"])
    config["training"]["activation_checkpointing"] = "full"
    config["draft"] = {
        "prompts": prompts(), "num_inference_steps": sampling_steps, "draft_k": min(s["draft_k"], sampling_steps),
        "guidance": 0.0, "anchor_weight": s["anchor"], "resolution": resolution,
        "rewards": [{"function": "proving.rewards:DigitReward", "options": reward_options(reward, s["kind"])}],
        "eval_every_n_steps": 0,
    }
    seconds = run_posttrain(config, work_dir / "draft.yaml", device)
    return StageResult(run_dir, s["steps"], seconds, checkpoint_every=s["curve_every"])


def run_distill(base_dir, work_dir, quick: bool, device: str = "cpu", *, resolution: int, teacher_guidance: float,
                models_dir: Path, seed: int) -> StageResult:
    """TDM: a 4-step student (full weights) from the teacher at ``teacher_guidance``; the model
    folder it exports records ``is_distilled`` and its step count."""
    base_dir, work_dir, s = Path(base_dir), Path(work_dir), settings("distill", quick)
    run_dir = work_dir / "distill"
    config = base_config(base_dir, run_dir, "distill", s["steps"], s["lr"], s["batch"], None, seed)
    config["distill"] = {"prompts": prompts(), "student_steps": 4, "teacher_steps": s["teacher_steps"],
                         "teacher_guidance": teacher_guidance, "resolution": resolution}
    seconds = run_posttrain(config, work_dir / "distill.yaml", device)
    model = publish(run_dir, base_dir, Path(models_dir) / "student_4", lora=False)
    return StageResult(model, s["steps"], seconds, lora=False)
