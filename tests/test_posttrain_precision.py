"""One precision policy for every forward of a post-training step (``Runtime.autocast``).

Under ``mixed_precision: bf16`` the trained model, its frozen reference / teacher, the rollouts
and the fake score all run under the same bf16 autocast. While the model equals its reference
(LoRA with B = 0 before the first update; a full run's first step) every comparison between them
is then exactly 0: a bf16 forward against a float32 one gave a DPO margin of -0.03, a GRPO KL of
1.3e-6 with 8% of the ratios clipped, and a TDM teacher off the student by ~1e-2.

The figures are read from the trainers' own step (``train_step`` / the methods' forwards) on
tiny-random, in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import finetune.data.encoding
from finetune.config import build_config
from finetune.posttrain.config import PosttrainConfig
from finetune.posttrain.rollout import initial_noise, text_positions
from finetune.posttrain.run import trainer_for

sys.path.insert(0, str(Path(__file__).parent))  # the reward plug-in posttrain_rewards
pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one mixed-precision setting per process: an earlier test's trainer (fp32)
    would refuse these bf16 runs, and theirs would leak into later tests. Reset before and after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)

PROMPTS = ["a picture", "an image of a thing"]
_PROJECTION = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))


def _colour_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Stand-in VAE encoder (the tiny VAE maps all images alike): 8x8 mean colours, projected."""
    return torch.einsum("oc,bchw->bohw", _PROJECTION, torch.nn.functional.avg_pool2d(pixels.float() * 2 - 1, 8))


def _config(out, method: str, training: str, section: dict) -> PosttrainConfig:
    extra = {"lora": {"rank": 4, "alpha": 4}} if training == "lora" else {}
    return build_config({
        "output_dir": str(out), "method": method,
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": training, "max_steps": 1, "batch_size": 2, "seed": 0, "mixed_precision": "bf16"},
        "optimizer": {"learning_rate": 1e-3},
        method: section,
        "checkpointing": {"every_n_steps": 100},
        "logging": {"progress_bar": False, "tensorboard": False},
        **extra,
    }, cls=PosttrainConfig)


@pytest.mark.parametrize("training", ["lora", "full"])
def test_dpo_margin_is_exactly_zero_while_the_model_is_its_reference_under_bf16(tmp_path, monkeypatch, training):
    monkeypatch.setattr(finetune.data.encoding, "encode_images", _colour_latents)
    config = _config(tmp_path / "run", "dpo", training,
                     {"data": str(tmp_path / "pairs" / "pairs.jsonl"), "synthetic": {"num_pairs": 4}, "heldout_pairs": 0, "resolution": 32,
                      "beta": 2500.0})
    trainer = trainer_for(config)
    trainer.setup()
    assert trainer.runtime.accelerator.mixed_precision == "bf16"
    trainer.train_step(0, iter(trainer.step_inputs()))
    stats = trainer.extra_metrics
    assert stats["train/chosen_loss"] != stats["train/rejected_loss"]  # the pairs differ: a margin could show
    assert stats["train/margin"] == 0.0 and stats["train/chosen_vs_reference"] == 0.0
    assert stats["train/rejected_vs_reference"] == 0.0


def test_grpo_first_update_has_kl_and_clipped_fraction_exactly_zero_under_bf16(tmp_path):
    config = _config(tmp_path / "run", "grpo", "lora",
                     {"prompts": PROMPTS, "group_size": 2, "num_inference_steps": 3, "resolution": 32,
                      "rewards": [{"function": "posttrain_rewards:brightness"}],
                      "clip_range": 1e-6, "kl_weight": 1.0, "updates_per_rollout": 1, "eval_every_n_steps": 0})
    trainer = trainer_for(config)
    trainer.setup()
    trainer.train_step(0)
    stats = trainer.extra_metrics
    # clip_range 1e-6: any ratio off 1 by more than a millionth would count as clipped.
    assert stats["kl"] == 0.0 and stats["clip_fraction"] == 0.0, stats


def test_tdm_student_fake_score_and_teacher_agree_exactly_while_equal_under_bf16(tmp_path):
    # distribution_weight > 0: the fake score (its adapter) exists only with DMD's term.
    config = _config(tmp_path / "run", "distill", "lora",
                     {"prompts": PROMPTS, "student_steps": 2, "teacher_steps": 2, "resolution": 32, "teacher_guidance": 2.0,
                      "distribution_weight": 1.0})
    trainer = trainer_for(config)
    trainer.setup()
    embeds, mask = trainer.conditioning([0, 1])
    latents = initial_noise(2, trainer.pipe.transformer.config.in_channels, 32, 32, torch.Generator().manual_seed(0))
    t = torch.tensor([0.7, 0.3])
    student = trainer.part_velocity("student", latents, t, embeds, mask)
    fake = trainer.part_velocity("fake", latents, t, embeds, mask)
    teacher = trainer.reference(trainer.model, hidden_states=latents, encoder_hidden_states=embeds, timestep=t,
                                position_ids=text_positions(embeds, 32, 32), encoder_attention_mask=mask)
    assert torch.equal(student, teacher) and torch.equal(fake, teacher)
    # The guided teacher with the prompt as its own negative is the conditional velocity: g (v_c - v_u) = 0.
    guided = trainer.teacher_velocity(latents, t, embeds, mask, embeds, mask)
    assert torch.equal(guided, student)
