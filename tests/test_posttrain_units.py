"""Post-training pieces on their own: the SDE step against an analytic flow, the losses against
hand-written formulas, reward plug-ins, the prompt pool, pair scanning, the pinned configs and
the recognition of distilled exports."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.config import ConfigError, build_config
from finetune.data import DatasetError
from finetune.posttrain.config import PosttrainConfig, PromptPoolConfig, RewardConfig
from finetune.posttrain.dpo import PairLosses, dpo_loss, implicit_reward_margin
from finetune.posttrain.grpo import clipped_policy_loss, exploring_steps, gaussian_step_kl
from finetune.posttrain.pairs import make_synthetic_pairs, scan_pairs
from finetune.posttrain.prompt_pool import PoolLog, PromptPool
from finetune.posttrain.rewards import RewardError, group_advantages, load_rewards, score
from finetune.posttrain.tdm import dmd_student_loss
from krea2_diffusers import sampling

sys.path.insert(0, str(Path(__file__).parent))


# ------------------------------------------------------------------ the SDE step
def _gaussian_flow(x: torch.Tensor, t: float, data_var: float) -> torch.Tensor:
    """Exact velocity E[noise - x0 | x_t] for x0 ~ N(0, data_var): x_t (t - (1 - t) s^2) / Var(x_t)."""
    return x * (t - (1 - t) * data_var) / ((1 - t) ** 2 * data_var + t**2)


def test_sde_step_keeps_the_ode_marginals_on_an_analytic_flow():
    data_var, steps, n = 0.25, 100, 50_000
    times = torch.linspace(1, 0, steps + 1, dtype=torch.float64).tolist()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 1, generator=generator, dtype=torch.float64)
    for i in range(steps):
        t, t_next = times[i], times[i + 1]
        x, mean, std = sampling.sde_step(x, _gaussian_flow(x, t, data_var), t, t_next, noise_level=0.7,
                                         generator=generator, t_cap=times[1])
        assert std > 0
        if abs(t_next - 0.5) < 1e-9:
            expected = 0.25 * data_var + 0.25
            assert abs(float(x.var()) / expected - 1) < 0.03
    assert abs(float(x.var()) / data_var - 1) < 0.03, "the SDE must end at the data distribution"


def test_sde_step_without_noise_is_the_euler_step_and_log_prob_is_a_gaussian_density():
    generator = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 8, generator=generator), torch.randn(2, 4, 8, generator=generator)
    following, mean, std = sampling.sde_step(x, v, 0.7, 0.5, noise_level=0.0)
    assert std == 0.0 and torch.equal(following, sampling.euler_step(x, v, 0.7, 0.5)) and torch.equal(mean, following)
    sample, mean, std = sampling.sde_step(x, v, 0.7, 0.5, noise_level=0.8, generator=generator)
    expected = torch.distributions.Normal(mean, std).log_prob(sample).flatten(1).mean(1)
    torch.testing.assert_close(sampling.gaussian_log_prob(sample, mean, std), expected)


# ------------------------------------------------------------------ losses
def test_dpo_loss_matches_the_formula_and_its_gradient_favours_chosen():
    chosen = torch.tensor([0.50, 0.40], requires_grad=True)
    rejected = torch.tensor([0.45, 0.60], requires_grad=True)
    losses = PairLosses(chosen, rejected, torch.tensor([0.48, 0.41]), torch.tensor([0.47, 0.58]))
    beta = 10.0
    inside = [-beta / 2 * ((0.50 - 0.48) - (0.45 - 0.47)), -beta / 2 * ((0.40 - 0.41) - (0.60 - 0.58))]
    torch.testing.assert_close(implicit_reward_margin(losses, beta), torch.tensor(inside))
    plain = sum(math.log1p(math.exp(-m)) for m in inside) / 2
    torch.testing.assert_close(dpo_loss(losses, beta), torch.tensor(plain))
    anchored = plain + 1.0 * (0.50 + 0.40) / 2 + 2.0 * (max(0.0, 0.50 - 0.48) + max(0.0, 0.40 - 0.41)) / 2
    loss = dpo_loss(losses, beta, sft_weight=1.0, chosen_anchor_weight=2.0)
    torch.testing.assert_close(loss, torch.tensor(anchored))
    dpo_loss(losses, beta).backward()
    assert (chosen.grad > 0).all() and (rejected.grad < 0).all(), "descent lowers the chosen loss, raises the rejected"


def test_clipped_policy_loss_and_gaussian_kl():
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.5, 0.5, 1.05]))
    advantages = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped = clipped_policy_loss(new, old, advantages, clip_range=0.2)
    # PPO: max(-A r, -A clip(r)) per sample
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -2.1]))
    assert clipped.tolist() == [True, True, False]
    mean, ref = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    torch.testing.assert_close(gaussian_step_kl(mean, ref, 0.5), torch.full((2,), 1 / (2 * 0.25)))


def test_grpo_exploring_window_is_random_or_pinned_to_its_start():
    starts = {exploring_steps(10, 3, None, torch.Generator().manual_seed(s))[0] for s in range(200)}
    assert starts == set(range(8)), "a random window may start at any step that leaves it whole"
    assert exploring_steps(10, 3, 0, torch.Generator()) == [0, 1, 2]
    assert exploring_steps(10, 3, 7, torch.Generator()) == [7, 8, 9]
    assert exploring_steps(6, None, None, torch.Generator()) == list(range(6))


def test_dmd_student_loss_gradient_is_the_normalised_score_difference():
    generator = torch.Generator().manual_seed(2)
    x0_hat = torch.randn(2, 3, 4, generator=generator, requires_grad=True)
    fake, teacher = torch.randn(2, 3, 4, generator=generator), torch.randn(2, 3, 4, generator=generator)
    dmd_student_loss(x0_hat, fake, teacher).backward()
    normaliser = (x0_hat.detach() - teacher).abs().flatten(1).mean(1).view(-1, 1, 1)
    expected = (fake - teacher) / normaliser / (2 * 12)  # d/dx of 0.5 * mean over 12 elements, mean over 2
    torch.testing.assert_close(x0_hat.grad, expected)


# ------------------------------------------------------------------ rewards and the prompt pool
def test_rewards_are_weighted_gated_and_checked():
    from PIL import Image

    images = [Image.new("RGB", (16, 16), (v, v, v)) for v in (10, 200, 255)]
    rewards = load_rewards([RewardConfig("posttrain_rewards:brightness", weight=2.0),
                            RewardConfig("posttrain_rewards:Threshold", weight=1.0, gate=0.5, options={"value": 0.5})])
    total, raw = score(rewards, images, ["a", "b", "c"], [{}] * 3)
    bright = torch.tensor([10, 200, 255], dtype=torch.float64) / 255
    torch.testing.assert_close(raw["posttrain_rewards:brightness"], bright)
    torch.testing.assert_close(total, torch.tensor([0.0, 2 * bright[1] + 1, 2 * bright[2] + 1], dtype=torch.float64))
    with pytest.raises(ConfigError, match="cannot import module 'nowhere_module'"):
        load_rewards([RewardConfig("nowhere_module:f")])
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        load_rewards([RewardConfig("posttrain_rewards:missing")])
    with pytest.raises(RewardError, match=r"posttrain_rewards:too_few.*\['a', 'b', 'c'\].*2 values for 3"):
        score(load_rewards([RewardConfig("posttrain_rewards:too_few")]), images, ["a", "b", "c"], [{}] * 3)
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2), torch.tensor([-1.0, 1.0, 0.0, 0.0]),
                               atol=1e-3, rtol=0)


def test_prompt_pool_drops_solved_hopeless_and_flat_prompts_and_replays_its_log(tmp_path):
    config = PromptPoolConfig(solved_above=0.9, hopeless_below=0.1, min_std=1e-3, min_groups=2)
    pool = PromptPool(["easy", "hard", "flat", "useful"], config)
    log = PoolLog(tmp_path / "prompt_pool.jsonl", enabled=True)
    groups = {0: [0.95, 1.0], 1: [0.0, 0.05], 2: [0.5, 0.5], 3: [0.2, 0.8]}
    for step in (1, 2, 3):
        rows = [(i, values) for i, values in groups.items()]
        for i, values in rows:
            pool.update(i, values)
        log.append(step, rows)
    assert [s.dropped for s in pool.stats] == ["solved", "hopeless", "no variance", None]
    assert pool.active == [3] and pool.sample(3, torch.Generator().manual_seed(0)) == [3, 3, 3]
    replayed = PromptPool(pool.prompts, config)
    log.replay(replayed, upto_step=1)  # a resume from step 1: one group each, nothing dropped yet
    assert replayed.active == [0, 1, 2, 3] and len((tmp_path / "prompt_pool.jsonl").read_text().splitlines()) == 1


# ------------------------------------------------------------------ inputs and configs
def test_pairs_with_missing_or_broken_images_are_skipped_and_counted(tmp_path):
    manifest = make_synthetic_pairs(tmp_path / "pairs.jsonl", num_pairs=4, size=32)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = manifest.read_text().splitlines()
    rows.append(json.dumps({"prompt": "x", "chosen": "gone.png", "rejected": "rejected_000.png"}))
    rows.append(json.dumps({"prompt": "y", "chosen": "chosen_000.png", "rejected": "broken.png"}))
    rows.append(json.dumps({"prompt": "z", "chosen": "chosen_000.png"}))
    manifest.write_text("\n".join(rows) + "\n")
    pairs, scan = scan_pairs(manifest)
    assert len(pairs) == 4 and [p.chosen.caption for p in pairs] == [p.prompt for p in pairs]
    assert {k: len(v) for k, v in scan.skipped.items()} == {"missing image": 1, "broken image": 1, "row without rejected": 1}
    (tmp_path / "empty.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "gone.png", "rejected": "gone.png"}) + "\n")
    with pytest.raises(DatasetError, match="no usable preference pairs"):
        scan_pairs(tmp_path / "empty.jsonl")


PINNED = {
    "dpo": """
output_dir: outputs/dpo-tiny
method: dpo
model: {pretrained_model_name_or_path: tiny-random}
training: {method: lora, max_steps: 60, batch_size: 2, seed: 0}
optimizer: {learning_rate: 2.0e-3}
lora: {rank: 8, alpha: 8}
dpo: {data: pairs.jsonl, sft_weight: 1.0, resolution: 64}
""",
    "grpo": """
method: grpo          # other sections as above
grpo: {prompts: ["a picture", "an image of a thing"], group_size: 4, num_inference_steps: 6,
       resolution: 64, rewards: [{function: "my_module:reward", weight: 1.0}]}
""",
    "distill": """
method: distill       # with training: {method: full, ...}
distill: {prompts: ["a picture", "a landscape"], student_steps: 4, teacher_steps: 24,
          teacher_guidance: 3.5, resolution: 64}
""",
    "draft": """
method: draft
model: {pretrained_model_name_or_path: tiny-random}
training: {method: lora, max_steps: 40, batch_size: 2, seed: 0}
draft: {prompts: ["a picture", "an image of a thing"], num_inference_steps: 6, draft_k: 1, draft_lv: false,
        guidance: 0.0, resolution: 64, rewards: [{function: "my_reward:reward", weight: 1.0}]}
""",
}


def test_the_pinned_configs_are_valid_as_written():
    common = yaml.safe_load(PINNED["dpo"])
    dpo = build_config(common, cls=PosttrainConfig)
    assert (dpo.method, dpo.dpo.data, dpo.dpo.sft_weight, dpo.training.method) == ("dpo", "pairs.jsonl", 1.0, "lora")
    others = {k: v for k, v in common.items() if k not in ("method", "dpo")}
    grpo = build_config({**others, **yaml.safe_load(PINNED["grpo"])}, cls=PosttrainConfig)
    assert grpo.grpo.group_size == 4 and grpo.grpo.rewards[0].function == "my_module:reward"
    distill = build_config({**others, "training": {"method": "full", "max_steps": 60}, **yaml.safe_load(PINNED["distill"])},
                           cls=PosttrainConfig)
    assert (distill.distill.student_steps, distill.distill.teacher_guidance) == (4, 3.5)
    assert distill.export.formats == ["diffusers", "original"]
    draft = build_config(yaml.safe_load(PINNED["draft"]), cls=PosttrainConfig)
    assert (draft.method, draft.draft.num_inference_steps, draft.draft.draft_k, draft.draft.draft_lv, draft.draft.guidance,
            draft.draft.resolution, draft.draft.rewards[0].function, draft.training.max_steps) == (
        "draft", 6, 1, False, 0.0, 64, "my_reward:reward", 40)
    with pytest.raises(ConfigError, match="did you mean 'dpo.sft_weight'"):
        build_config({**common, "dpo": {"data": "p.jsonl", "sft_wieght": 1.0}}, cls=PosttrainConfig)
    grpo_section = {"prompts": ["a"], "num_inference_steps": 10, "sde_steps": 3, "rewards": [{"function": "m:f"}]}
    with pytest.raises(ConfigError, match=r"grpo.sde_window_start must be in \[0, num_inference_steps - sde_steps\] = \[0, 7\], got 8"):
        build_config({**others, "method": "grpo", "grpo": {**grpo_section, "sde_window_start": 8}}, cls=PosttrainConfig)
    assert build_config({**others, "method": "grpo", "grpo": {**grpo_section, "sde_window_start": 7}},
                        cls=PosttrainConfig).grpo.sde_window_start == 7
    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        build_config({**others, "method": "grpo", "grpo": {"prompts": ["a"], "group_size": 1, "rewards": [{"function": "m:f"}]}},
                     cls=PosttrainConfig)


# ------------------------------------------------------------------ distilled exports
def test_a_distilled_export_is_recognised_from_its_own_metadata_whatever_its_name(tmp_path, tiny_pipe):
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.loaders.convert import convert_diffusers_to_original
    from krea2_diffusers.files import save_safetensors

    state = convert_diffusers_to_original(tiny_pipe.transformer.state_dict())
    meta = {"krea2.is_distilled": "true", "krea2.num_inference_steps": "4"}
    save_safetensors(state, tmp_path / "my_brand_model.safetensors", metadata=meta)
    pipe = Krea2Pipeline.from_single_file(tmp_path / "my_brand_model.safetensors", text_encoder="tiny-random", vae="tiny-random")
    assert pipe.is_distilled and pipe.preset.num_inference_steps == 4 and pipe.preset.guidance_scale == 0.0
    save_safetensors(state, tmp_path / "turbo_named_but_raw.safetensors", metadata={"krea2.is_distilled": "false"})
    raw = Krea2Pipeline.from_single_file(tmp_path / "turbo_named_but_raw.safetensors", text_encoder="tiny-random", vae="tiny-random")
    assert not raw.is_distilled and raw.preset.num_inference_steps == 52

    folder = tmp_path / "pipeline"
    tiny_pipe.save_pretrained(folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    save_safetensors(tiny_pipe.transformer.state_dict(), weights, metadata=meta)
    loaded = Krea2Pipeline.from_pretrained(folder)
    assert loaded.is_distilled and loaded.preset.num_inference_steps == 4


# ------------------------------------------------------------------ built-in rewards (models injected: no download)
class _Batch(dict):
    def to(self, device):
        return self


def test_builtin_rewards_need_a_configured_model_and_load_nothing_until_called():
    for name in ("krea2.ocr", "krea2.clip", "krea2.vlm_rubric"):
        with pytest.raises(ConfigError, match="needs options.model"):
            load_rewards([RewardConfig(name)])
    with pytest.raises(ConfigError, match="unknown built-in reward"):
        load_rewards([RewardConfig("krea2.nope")])
    rewards = load_rewards([RewardConfig("krea2.clip", options={"model": "somewhere/clip", "mode": "aesthetic"})])
    assert rewards[0].function.loaded is None


def test_clip_reward_scores_with_a_real_clip_model():
    from PIL import Image
    from transformers import CLIPConfig, CLIPModel

    from finetune.posttrain.builtin_rewards import CLIPReward

    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=100,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=16)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()

    def processor(images=None, text=None, **kwargs):
        if images is not None:
            return _Batch(pixel_values=torch.stack([torch.full((3, 32, 32), float(i.getpixel((0, 0))[0]) / 255) for i in images]))
        return _Batch(input_ids=torch.tensor([[0, 3 + len(t) % 50, 2] for t in text]))

    reward = CLIPReward(model="injected", mode="alignment", device="cpu")
    reward.loaded = (model, processor)
    images = [Image.new("RGB", (32, 32), (v, v, v)) for v in (0, 255)]
    scores = reward(images, ["a", "bb"], [{}, {}])
    with torch.no_grad():
        img = torch.nn.functional.normalize(model.get_image_features(**processor(images=images)).pooler_output, dim=-1)
        txt = torch.nn.functional.normalize(model.get_text_features(**processor(text=["a", "bb"])).pooler_output, dim=-1)
    torch.testing.assert_close(torch.tensor(scores), (img * txt).sum(-1))


def test_vlm_rubric_and_ocr_rewards_score_from_their_models_answers():
    from PIL import Image

    from finetune.posttrain.builtin_rewards import OCRReward, VLMRubricReward, rubric_items

    assert rubric_items("a red cat, a blue box and a tree", {}, 8) == ["a red cat", "a blue box", "a tree"]
    vocab = {"yes": 5, "Yes": 6, " yes": 7, " Yes": 8, "no": 9, "No": 10, " no": 11, " No": 12}

    class Tokenizer:
        def encode(self, word, add_special_tokens=False):
            return [vocab[word]]

    class Processor:
        tokenizer = Tokenizer()

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return messages[0]["content"][1]["text"]

        def __call__(self, text, images, return_tensors):
            return _Batch(question=text[0])

    class Judge:
        """Says yes (logit 3 vs 0 on "yes") exactly when the question mentions a cat."""

        def __call__(self, question):
            logits = torch.zeros(1, 1, 16)
            logits[0, -1, 5 if "cat" in question else 9] = 3.0
            return type("Out", (), {"logits": logits})

    reward = VLMRubricReward(model="injected", device="cpu")
    reward.loaded = (Judge(), Processor())
    # P(yes) = sigmoid(logsumexp(3, 0, 0, 0) - logsumexp(0, 0, 0, 0)) when the judge says yes
    p = float(torch.sigmoid(torch.logsumexp(torch.tensor([3.0, 0, 0, 0]), 0) - torch.logsumexp(torch.zeros(4), 0)))
    image = Image.new("RGB", (8, 8))
    scores = reward([image, image], ["a cat, a dog", "a dog"], [{}, {"rubric": ["a cat"]}])
    torch.testing.assert_close(torch.tensor(scores), torch.tensor([(p + (1 - p)) / 2, p]))

    ocr = OCRReward(model="injected", device="cpu")
    ocr.read = lambda images: ["HELLO", "HELO", "x"]
    assert ocr([image] * 3, ['a sign saying "hello"', 'a sign saying "hello"', "no text here"], [{}] * 3) == [1.0, 0.8, 1.0]


def test_the_examples_parse_and_krea2_posttrain_is_a_command(tmp_path, capsys):
    from finetune.posttrain.config import load_posttrain_config
    from krea2_diffusers.cli import build_parser, main

    root = Path(__file__).resolve().parents[1] / "examples"
    methods = {}
    for path in sorted(root.glob("posttrain_*.yaml")):
        methods[path.name] = load_posttrain_config(path).method
    assert sorted(methods.values()) == ["distill", "distill", "dpo", "dpo", "draft", "grpo", "grpo"]
    assert build_parser().parse_args(["posttrain", "c.yaml", "--resume", "training.max_steps=5"]).resume
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: dpo\ndpo: {data: p.jsonl, betta: 1.0}\n")
    assert main(["posttrain", str(bad)]) == 2
    assert "did you mean 'dpo.beta'" in capsys.readouterr().err
