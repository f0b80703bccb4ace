"""TDM distillation of tiny-random into a 4-step student, measured outside the trainer.

Reference distribution: the teacher's own 24-step samples with CFG 3.5 from many seeds. The
exported student is loaded back with ``from_single_file`` (recognised as distilled from its
metadata: 4 steps, no CFG by default) and sampled from the same seeds; the sliced Wasserstein
distance of its latents to the reference must beat the same weights run as a 4-step model before
distillation (Turbo schedule, no CFG), i.e. the student learnt the guided, many-step teacher.
"""

from __future__ import annotations

import pytest
import torch

from finetune.config import build_config
from finetune.metrics import read_metrics
from finetune.posttrain.config import PosttrainConfig
from finetune.posttrain.run import posttrain
from krea2_diffusers import Krea2Pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a picture", "a landscape"]
SEEDS = 96
PROJECTIONS = 256


def sliced_wasserstein(a: torch.Tensor, b: torch.Tensor) -> float:
    """W2 between the sorted 1-D projections of two (n, d) sample sets, averaged over random directions."""
    directions = torch.randn(a.shape[1], PROJECTIONS, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    directions /= directions.norm(dim=0)
    pa, _ = (a.double() @ directions).sort(0)
    pb, _ = (b.double() @ directions).sort(0)
    return float(((pa - pb) ** 2).mean().sqrt())


def samples(pipe, steps, guidance, prompt) -> torch.Tensor:
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(SEEDS)]
    return pipe([prompt] * SEEDS, height=64, width=64, num_inference_steps=steps, guidance_scale=guidance,
                generator=generators, output_type="latent").images.flatten(1)


def test_distilled_4_step_student_moves_toward_the_teachers_guided_many_step_samples(tmp_path):
    config = {
        "output_dir": str(tmp_path / "run"), "method": "distill",
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": "full", "max_steps": 30, "batch_size": 4, "seed": 0},
        "optimizer": {"learning_rate": 3.0e-5},
        "distill": {"prompts": PROMPTS, "student_steps": 4, "teacher_steps": 24, "teacher_guidance": 3.5, "resolution": 64},
        "checkpointing": {"every_n_steps": 100}, "export": {"formats": ["original"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }
    result = posttrain(build_config(config, cls=PosttrainConfig))
    assert [r["step"] for r in read_metrics(result.output_dir)] == list(range(1, 31))

    student = Krea2Pipeline.from_single_file(result.output_dir / "krea2_original.safetensors",
                                             text_encoder="tiny-random", vae="tiny-random")
    student.set_progress_bar_config(disable=True)
    assert student.is_distilled and student.preset.num_inference_steps == 4 and student.preset.guidance_scale == 0.0
    teacher = Krea2Pipeline.from_pretrained("tiny-random")
    teacher.set_progress_bar_config(disable=True)
    undistilled = Krea2Pipeline.from_pretrained("tiny-random", is_distilled=True)
    undistilled.set_progress_bar_config(disable=True)
    for prompt in PROMPTS:
        reference = samples(teacher, 24, 3.5, prompt)
        distance = sliced_wasserstein(samples(student, None, None, prompt), reference)
        before = sliced_wasserstein(samples(undistilled, 4, 0.0, prompt), reference)
        teacher_4 = sliced_wasserstein(samples(teacher, 4, 3.5, prompt), reference)
        print(f"{prompt!r}: SWD to teacher 24-step CFG: student {distance:.4f}, before distillation {before:.4f}, "
              f"teacher at 4 steps with CFG {teacher_4:.4f}")
        assert distance < 0.97 * before


def test_lora_distillation_trains_two_adapters_and_exports_the_students(tmp_path):
    from krea2_diffusers.loaders.lora import read_lora_file

    config = {
        "output_dir": str(tmp_path / "run"), "method": "distill",
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": "lora", "max_steps": 3, "batch_size": 2, "seed": 0},
        "lora": {"rank": 4, "alpha": 4}, "optimizer": {"learning_rate": 1.0e-3},
        "distill": {"prompts": PROMPTS, "student_steps": 4, "resolution": 32},
        "export": {"formats": ["diffusers"]}, "logging": {"progress_bar": False, "tensorboard": False},
    }
    from finetune.posttrain.run import trainer_for

    trainer = trainer_for(build_config(config, cls=PosttrainConfig))
    result = trainer.train()
    adapters = {n.split(".lora_")[1].split(".")[1] for n, _ in trainer.model.named_parameters() if ".lora_" in n}
    assert adapters == {"default", "fake"}
    moved = {name: any(float(p.abs().max()) > 0 for n, p in trainer.model.named_parameters() if f".lora_B.{name}." in n)
             for name in adapters}
    assert moved == {"default": True, "fake": True}, "both the student and the fake score must train"
    tensors, _ = read_lora_file(result.output_dir / "lora_diffusers.safetensors")
    assert tensors and not any("fake" in k for k in tensors)
    pipe = Krea2Pipeline.from_pretrained("tiny-random", is_distilled=True)
    pipe.load_lora_weights(result.output_dir / "lora_diffusers.safetensors")
