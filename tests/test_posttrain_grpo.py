"""GRPO on tiny-random with a computable reward on the decoded images (their mean brightness).

The reward of guidance-free samples is measured here, outside the trainer: the exported LoRA is
loaded into a fresh Krea2Pipeline and images are generated with guidance 0 from fixed seeds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.config import ConfigError, build_config
from finetune.metrics import read_metrics
from finetune.posttrain.config import PosttrainConfig
from finetune.posttrain.rewards import RewardError
from finetune.posttrain.run import posttrain, trainer_for
from krea2_diffusers import Krea2Pipeline

sys.path.insert(0, str(Path(__file__).parent))
from posttrain_rewards import brightness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12
PROMPTS = ["a picture", "an image of a thing"]


def grpo_config(out, reward="posttrain_rewards:brightness", **grpo) -> dict:
    return {
        "output_dir": str(out),
        "method": "grpo",
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 2, "seed": 0},
        "optimizer": {"learning_rate": 5.0e-3},
        "lora": {"rank": 8, "alpha": 8, "extra_modules": ["final_layer.linear"]},
        "grpo": {"prompts": PROMPTS, "group_size": 8, "num_inference_steps": 6, "resolution": 64,
                 "rewards": [{"function": reward}], "clip_range": 0.01, "kl_weight": 0.01, "noise_level": 1.0,
                 "eval_every_n_steps": 0, **grpo},
        "checkpointing": {"every_n_steps": 100},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def guidance_free_reward(pipe) -> float:
    generators = [torch.Generator().manual_seed(50 + i) for i in range(16)]
    images = pipe([PROMPTS[0]] * 8 + [PROMPTS[1]] * 8, height=64, width=64, num_inference_steps=6, guidance_scale=0.0,
                  generator=generators).images
    return float(np.mean(brightness(images, None, None)))


def test_grpo_raises_the_reward_of_guidance_free_samples_and_reports_kl(tmp_path):
    result = posttrain(build_config(grpo_config(tmp_path / "run"), cls=PosttrainConfig))
    assert result.final_step == STEPS
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kls = [r["kl"] for r in rows]
    assert all(k >= 0 for k in kls) and kls[-1] > kls[0], "the KL to the reference grows as the policy moves"
    assert all("reward_mean" in r and "clip_fraction" in r and "pool/active" in r for r in rows)

    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    before = guidance_free_reward(pipe)
    pipe.load_lora_weights(result.output_dir / "lora_diffusers.safetensors")
    after = guidance_free_reward(pipe)
    print(f"guidance-free brightness {before:.5f} -> {after:.5f}")
    # Per-image brightness varies by ~5e-4 here: a rise of several 1e-4 on 16 images is far beyond chance.
    assert after > before + 5e-4


def test_reward_module_that_cannot_be_imported_is_refused_before_any_model_loads(tmp_path, no_model_loading):
    config = build_config(grpo_config(tmp_path / "run", reward="no_such_module_x:reward"), cls=PosttrainConfig)
    with pytest.raises(ConfigError, match="no_such_module_x"):
        trainer_for(config).setup()


def test_a_failing_reward_stops_the_step_naming_the_function_and_prompts(tmp_path):
    from finetune.posttrain.config import RewardConfig
    from finetune.posttrain.rewards import load_rewards

    trainer = trainer_for(build_config(grpo_config(tmp_path / "run"), cls=PosttrainConfig))
    trainer.setup()
    for name, message in [("raises", "raised RuntimeError: reward model crashed"), ("too_few", "returned 15 values for 16 images"),
                          ("not_a_number", "returned nan")]:
        trainer.rewards = load_rewards([RewardConfig(function=f"posttrain_rewards:{name}")])
        with pytest.raises(RewardError) as err:
            trainer.train_step(0)
        assert f"posttrain_rewards:{name}" in str(err.value) and message in str(err.value)
        assert all(p in str(err.value) for p in PROMPTS)
