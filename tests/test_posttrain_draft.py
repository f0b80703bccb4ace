"""DRaFT (``method: draft``) on tiny-random with a differentiable pure-torch reward (redness).

The learning claim is measured outside the trainer: the exported LoRA is loaded into a fresh
Krea2Pipeline and guidance-free images are generated from fixed seeds. The other tests pin the
method's rules: under bf16 autocast a zero LoRA samples exactly what the base samples (every
forward under one precision policy), only the last ``draft_k`` steps' conditional branch (and the
``lv_samples`` LV steps, each from its own noise) run with gradients, and a reward without a
gradient path / of the wrong length / NaN stops the step naming the function. Several processes:
tests/test_posttrain_distributed.py.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from finetune.config import ConfigError, build_config
from finetune.metrics import read_metrics
from finetune.posttrain.config import PosttrainConfig, RewardConfig
from finetune.posttrain.rewards import RewardError, load_rewards
from finetune.posttrain.run import posttrain, trainer_for
from krea2_diffusers import Krea2Pipeline

sys.path.insert(0, str(Path(__file__).parent))
from posttrain_rewards import redness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a picture", "an image of a thing"]
STEPS = 8


def draft_config(out, reward="posttrain_rewards:redness", training=None, **draft) -> dict:
    """The issue's pinned config (plus test-speed settings): LoRA, 6 sampling steps, draft_k 1, 64 px."""
    return {
        "output_dir": str(out),
        "method": "draft",
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 2, "seed": 0, "activation_checkpointing": "full",
                     **(training or {})},
        "optimizer": {"learning_rate": 1.0e-2},
        "lora": {"rank": 8, "alpha": 8, "extra_modules": ["final_layer.linear"]},
        "draft": {"prompts": PROMPTS, "num_inference_steps": 6, "draft_k": 1, "draft_lv": False, "guidance": 0.0,
                  "resolution": 64, "rewards": [{"function": reward, "weight": 1.0}], "eval_every_n_steps": 4, **draft},
        "checkpointing": {"every_n_steps": 100},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def guidance_free_redness(pipe) -> torch.Tensor:
    """(16,) per-image redness of guidance-free samples from fixed seeds."""
    generators = [torch.Generator().manual_seed(100 + i) for i in range(16)]
    images = pipe([PROMPTS[0]] * 8 + [PROMPTS[1]] * 8, height=64, width=64, num_inference_steps=6, guidance_scale=0.0,
                  generator=generators, output_type="pt").images
    return redness(images, None, None)


def test_draft_raises_the_redness_of_guidance_free_samples_of_the_exported_lora(tmp_path):
    result = posttrain(build_config(draft_config(tmp_path / "run"), cls=PosttrainConfig))
    assert result.final_step == STEPS and (result.output_dir / "lora_diffusers.safetensors").is_file()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all("reward_mean" in r and "reward/posttrain_rewards:redness" in r for r in rows)
    assert [r["step"] for r in rows if "eval/reward_vs_base" in r] == [4, 8]

    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    before = guidance_free_redness(pipe)
    pipe.load_lora_weights(result.output_dir / "lora_diffusers.safetensors")
    after = guidance_free_redness(pipe)
    gain = float(after.mean() - before.mean()) / float(before.std())
    print(f"guidance-free redness {float(before.mean()):.5f} (std {float(before.std()):.5f}) -> {float(after.mean()):.5f}: "
          f"+{gain:.1f} std in {STEPS} steps")
    assert gain >= 1.0, "the issue's bar: at least one standard deviation of the base's per-image reward"
    assert rows[-1]["eval/reward_vs_base"] > 0


def bf16_autocast():
    """What ``training.mixed_precision: bf16`` makes ``runtime.autocast()`` on the CPU (accelerate's
    ``torch.autocast("cpu", dtype=torch.bfloat16)``). Accelerate keeps one mixed-precision state per
    process, so the in-process tests set the context itself; the kill/resume test runs the config."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_trainer(tmp_path_factory):
    """LV, CFG and draft_k 2 under bf16 autocast, LoRA just initialised (B = 0: the model is its base)."""
    config = draft_config(tmp_path_factory.mktemp("draft") / "run", draft_k=2, draft_lv=True, guidance=1.0)
    trainer = trainer_for(build_config(config, cls=PosttrainConfig))
    trainer.runtime.autocast = bf16_autocast
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the one_thread fixture does for each test (it cannot serve a module fixture)
    try:
        trainer.setup()
    finally:
        torch.set_num_threads(threads)
    return trainer


def test_under_bf16_a_zero_lora_samples_and_scores_exactly_like_the_base(bf16_trainer):
    trainer = bf16_trainer
    prompt_ids, noise, lv_noise = trainer.draft_inputs(0)
    text = trainer.conditioning(prompt_ids)
    latents, lv, _ = trainer.sample(trainer.model, text, noise, lv_noise)  # the training path, with gradients
    base_latents, base_lv, _ = trainer.sample(trainer.base, text, noise, lv_noise, grad=False)
    assert latents.requires_grad and lv.requires_grad
    assert torch.equal(latents.detach(), base_latents) and torch.equal(lv.detach(), base_lv)
    rewards = [redness(trainer.decode(x), None, None) for x in (latents, *lv, base_latents, *base_lv)]
    assert all(torch.equal(a.detach(), b) for a, b in zip(rewards[:3], rewards[3:]))
    assert trainer.evaluate()["eval/reward_vs_base"] == 0.0
    # The guard is real: the base sampled outside the autocast differs.
    # (The reference holds the run's precision context itself: both are switched off.)
    trainer.runtime.autocast = trainer.reference.precision = contextlib.nullcontext
    try:
        fp32_latents, _, _ = trainer.sample(trainer.base, text, noise, grad=False)
    finally:
        trainer.runtime.autocast = trainer.reference.precision = bf16_autocast
    assert not torch.equal(fp32_latents, base_latents)


def test_only_the_last_k_conditional_forwards_and_the_lv_steps_carry_gradients(bf16_trainer):
    trainer = bf16_trainer
    prompt_ids, noise, lv_noise = trainer.draft_inputs(0)
    text = trainer.conditioning(prompt_ids)
    calls = []

    def recording(**inputs):
        branch = "uncond" if inputs["conditioning"] is text[1]["conditioning"] else "cond"
        calls.append((branch, torch.is_grad_enabled()))
        return trainer.model(**inputs)

    latents, lv, _ = trainer.sample(recording, text, noise, lv_noise)
    # 6 steps + the lv_samples (default 2) LV steps, each a conditional and an unconditional forward (guidance 1.0).
    assert [b for b, _ in calls] == ["cond", "uncond"] * 8
    assert [g for b, g in calls if b == "cond"] == [False] * 4 + [True] * 4
    assert not any(g for b, g in calls if b == "uncond")
    loss = -sum(redness(trainer.decode(x), None, None) for x in (latents, *lv)).mean()
    loss.backward()
    grads = [p.grad for p in trainer.params]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    assert not any(p.grad is not None for p in trainer.pipe.vae.parameters())
    trainer.optimizer.zero_grad(set_to_none=True)


def test_lv_averages_lv_samples_renoised_last_steps_each_from_its_own_noise(bf16_trainer):
    """DRaFT-LV's estimator (Clark et al. 2023: n = 2 by default): the loss is minus the mean reward
    of the sample and its n re-noised last steps, each an Euler step from ``(1 - t) x0 + t eps_i``."""
    from krea2_diffusers import sampling

    trainer = bf16_trainer
    assert trainer.config.draft.lv_samples == 2
    prompt_ids, noise, lv_noise = trainer.draft_inputs(0)
    assert lv_noise.shape == (2, *noise.shape) and not torch.equal(lv_noise[0], lv_noise[1])
    text = trainer.conditioning(prompt_ids)
    with torch.no_grad():
        latents, lv, _ = trainer.sample(trainer.base, text, noise, lv_noise, grad=False)
        t, end = trainer.times[-2], trainer.times[-1]
        for eps, sample in zip(lv_noise, lv):  # each LV sample, stepped here by hand from its own noise
            start = sampling.noised(latents, eps, t)
            with bf16_autocast():
                by_hand = sampling.euler_step(start, trainer.step_velocity(trainer.base, start, t, text)[0], t, end)
            assert torch.equal(sample, by_hand)
        assert not torch.equal(lv[0], lv[1])
        loss, stats, _ = trainer.micro_batch_loss(0, 0)  # the training path: the zero LoRA is the base
        rewards = [redness(trainer.decode(x), None, None) for x in (latents, *lv)]
    # Each reward is the one the base path gives bit for bit (test above); the average's float32
    # rounding is a few ulps of the rewards (3 terms, then a mean over 2 samples).
    expected = -(rewards[0] + rewards[1] + rewards[2]).div(3).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats["reward_lv_mean"], (rewards[1] + rewards[2]) / 2, rtol=1e-6, atol=1e-7)
    trainer.optimizer.zero_grad(set_to_none=True)


def test_the_base_anchor_is_the_mean_squared_velocity_gap_to_the_base_over_the_differentiable_steps(tmp_path):
    """``anchor_weight``: the loss adds the mean, over the ``draft_k`` differentiable steps, of the
    squared difference between the trained and the base weights' conditional velocity on the
    trained model's latents, computed here by hand with the adapters switched off; its gradient
    reaches the LoRA, none reaches the base or the VAE."""
    from finetune.posttrain.rollout import velocity
    from krea2_diffusers import sampling

    config = draft_config(tmp_path / "run", draft_k=3, anchor_weight=0.5)
    trainer = trainer_for(build_config(config, cls=PosttrainConfig))
    trainer.setup()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the LoRA off its base: B starts at zero
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    prompt_ids, noise, _ = trainer.draft_inputs(0)
    text = trainer.conditioning(prompt_ids)
    _, _, anchor = trainer.sample(trainer.model, text, noise)
    with torch.no_grad():
        latents, gaps = noise, []
        for i, (t, t_next) in enumerate(zip(trainer.times[:-1], trainer.times[1:])):
            v = velocity(trainer.model, latents, t, text[0])
            if i >= len(trainer.times) - 1 - 3:
                trainer.model.disable_adapters()
                gaps.append((v - velocity(trainer.model, latents, t, text[0])).pow(2).mean(dim=(1, 2)))
                trainer.model.enable_adapters()
            latents = sampling.euler_step(latents, v, t, t_next)
    assert anchor.shape == (len(prompt_ids),) and float(anchor.detach().min()) > 0
    torch.testing.assert_close(anchor.detach(), torch.stack(gaps).mean(0), rtol=1e-5, atol=1e-9)
    loss, stats, _ = trainer.micro_batch_loss(0, 0)
    reward = redness(trainer.decode(trainer.sample(trainer.model, text, noise, grad=False)[0]), None, None)
    torch.testing.assert_close(loss.detach(), -reward.mean() + 0.5 * stats["anchor"].mean(), rtol=1e-5, atol=1e-7)
    anchor.mean().backward()
    assert sum(float(p.grad.abs().sum()) for p in trainer.params if p.grad is not None) > 0
    assert not any(p.grad is not None for p in trainer.pipe.vae.parameters())
    off = trainer_for(build_config(draft_config(tmp_path / "off", draft_k=3), cls=PosttrainConfig))
    off.setup()
    assert off.sample(off.model, off.conditioning(prompt_ids), noise)[2] is None  # weight 0: no anchor term
    with pytest.raises(ConfigError, match="draft.anchor_weight"):
        build_config(draft_config(tmp_path / "bad", anchor_weight=-1.0), cls=PosttrainConfig)


def test_the_memory_plan_counts_draft_k_plus_lv_samples_forwards(tmp_path, no_model_loading):
    from finetune.posttrain.draft import DraftTrainer

    def forward_batch(**draft):
        return DraftTrainer.model_copies(build_config(draft_config(tmp_path / "run", **draft), cls=PosttrainConfig)).forward_batch

    # batch_size 2 prompts x (draft_k differentiable steps + lv_samples LV steps)
    assert forward_batch(draft_k=2) == 2 * 2
    assert forward_batch(draft_k=2, draft_lv=True) == 2 * (2 + 2)
    assert forward_batch(draft_k=1, draft_lv=True, lv_samples=3) == 2 * (1 + 3)


@pytest.mark.parametrize("name, message", [
    ("detached_redness", "no gradient path to the images"),
    ("unrelated_tensor", "no gradient path to the images"),
    ("redness_too_few", "returned 1 values (shape (1,)) for 2 images"),
    ("redness_nan", "returned nan for image 0"),
    ("too_few", "must return a tensor of 2 values, got list"),
])
def test_a_bad_reward_stops_the_step_with_one_line_naming_it(bf16_trainer, name, message):
    trainer = bf16_trainer
    kept = trainer.rewards
    trainer.rewards = load_rewards([RewardConfig(function=f"posttrain_rewards:{name}")])
    try:
        with pytest.raises(RewardError) as err:
            trainer.train_step(0)
    finally:
        trainer.rewards = kept
        trainer.optimizer.zero_grad(set_to_none=True)
    text = str(err.value)
    assert f"'posttrain_rewards:{name}'" in text and message in text and "\n" not in text


def test_an_unimportable_reward_is_refused_before_any_model_loads(tmp_path, no_model_loading):
    config = build_config(draft_config(tmp_path / "run", reward="no_such_module_y:reward"), cls=PosttrainConfig)
    with pytest.raises(ConfigError, match="no_such_module_y"):
        trainer_for(config).setup()
    for bad, match in [({"draft_k": 7}, r"draft.draft_k must be in \[1, num_inference_steps=6\]"),
                       ({"draft_k": 0}, "draft.draft_k"), ({"guidance": -1.0}, "draft.guidance"),
                       ({"rewards": []}, "draft.rewards is empty"), ({"rewards": [{"function": "nocolon"}]}, "package.module:function"),
                       ({"draft_lv": True, "lv_samples": 0}, r"draft.lv_samples must be at least 1 \(re-noised final steps per sample\), got 0"),
                       ({"lv_samples": 3}, "draft.lv_samples=3 is used only by DRaFT-LV")]:
        with pytest.raises(ConfigError, match=match):
            build_config(draft_config(tmp_path / "run", **bad), cls=PosttrainConfig)


def test_full_weights_draft_with_lv_and_cfg_trains_and_exports_the_original_file(tmp_path):
    """Full weights (1 process here; the sharded engine's build is the other methods' own) with
    draft_k 2, LV and CFG: the step runs, the base comparison is reported, the file is exported."""
    from safetensors import safe_open

    config = draft_config(tmp_path / "run", training={"method": "full", "max_steps": 2}, draft_k=2, draft_lv=True,
                          guidance=1.0, resolution=32, eval_every_n_steps=2)
    config["optimizer"]["learning_rate"] = 1.0e-3
    config["export"] = {"formats": ["original"]}
    result = posttrain(build_config(config, cls=PosttrainConfig))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all("reward_lv_mean" in r for r in rows)
    assert rows[-1]["eval/reward_vs_base"] != 0.0, "two full-weight updates move the samples away from the base's"
    exported = result.output_dir / "krea2_original.safetensors"
    with safe_open(exported, "pt") as f:
        assert len(list(f.keys())) > 10
