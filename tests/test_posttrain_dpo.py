"""DPO on a synthetic preference set (warm colour chosen over cool), tiny-random, CPU.

As in test_finetune_train, the tiny-random VAE maps every image to nearly the same latents, so
the cache's VAE encoder is swapped for a fixed pooling stand-in: chosen and rejected latents then
differ. Whether the model moved toward the chosen samples is measured here, outside the trainer:
the exported LoRA is loaded into a fresh Krea2Pipeline and its flow-matching loss on the held-out
pairs is compared with the base weights' under the same noise.
"""

from __future__ import annotations

import pytest
import torch

import finetune.data.encoding
from finetune.config import build_config
from finetune.optimization.objective import add_noise
from finetune.posttrain.config import PosttrainConfig
from finetune.posttrain.pairs import scan_pairs
from finetune.posttrain.run import posttrain
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.latents import pack_latents, position_ids

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 40
HELDOUT = 4
_PROJECTION = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))


def colour_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Stand-in VAE encoder: (B, 3, H, W) in [0, 1] -> (B, 16, H/8, W/8) from the 8x8 mean colour."""
    mean_colour = torch.nn.functional.avg_pool2d(pixels.float() * 2 - 1, 8)
    return torch.einsum("oc,bchw->bohw", _PROJECTION, mean_colour)


def dpo_config(out, **dpo) -> dict:
    return {
        "output_dir": str(out),
        "method": "dpo",
        "model": {"pretrained_model_name_or_path": "tiny-random"},
        "training": {"method": "lora", "max_steps": STEPS, "batch_size": 2, "seed": 0},
        "optimizer": {"learning_rate": 2.0e-3},
        "lora": {"rank": 8, "alpha": 8},
        "objective": {"timestep_sampling": "uniform", "shift": "none"},
        "dpo": {"data": str(out.parent / "pairs" / "pairs.jsonl"), "synthetic": {"num_pairs": 12}, "resolution": 64,
                "beta": 500.0, "heldout_pairs": HELDOUT, "eval_every_n_steps": 20, **dpo},
        "checkpointing": {"every_n_steps": 100},
        "export": {"formats": ["diffusers"]},
        "logging": {"progress_bar": False, "tensorboard": False},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune.data.encoding, "encode_images", colour_latents)
        plain = posttrain(build_config(dpo_config(root / "plain"), cls=PosttrainConfig))
        anchored = posttrain(build_config(dpo_config(root / "anchored", sft_weight=1.0, chosen_anchor_weight=1.0),
                                          cls=PosttrainConfig))
    return root, plain, anchored


def heldout_losses(pipe, root) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-matching losses (pairs, draws) of ``pipe`` on the held-out chosen and rejected images."""
    from finetune.data.cache import load_image_tensor

    pairs, _ = scan_pairs(root / "pairs" / "pairs.jsonl")
    generator = torch.Generator().manual_seed(123)
    draws = 8
    chosen_losses, rejected_losses = [], []
    with torch.no_grad():
        for pair in pairs[-HELDOUT:]:
            embeds, mask = pipe.encode_prompt(pair.prompt)
            embeds, mask = embeds.repeat(draws, 1, 1, 1), mask.repeat(draws, 1)
            positions = position_ids(embeds.shape[1], 4, 4)  # 64 px = 4 x 4 tokens
            noise = torch.randn(draws, 16, 64, generator=generator)
            t = torch.rand(draws, generator=generator) * 0.98 + 0.01
            for sample, out in ((pair.chosen, chosen_losses), (pair.rejected, rejected_losses)):
                x0 = pack_latents(colour_latents(pipe, load_image_tensor(sample, (64, 64))[None])).repeat(draws, 1, 1)
                v = pipe.transformer(hidden_states=add_noise(x0, noise, t), encoder_hidden_states=embeds, timestep=t,
                                     position_ids=positions, encoder_attention_mask=mask, return_dict=False)[0]
                out.append((v - (noise - x0)).pow(2).mean(dim=(1, 2)))
    return torch.stack(chosen_losses), torch.stack(rejected_losses)


def _pipe(lora=None):
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe


def test_dpo_moves_toward_chosen_and_the_anchor_keeps_chosen_at_or_below_reference(runs):
    root, plain, anchored = runs
    ref_chosen, ref_rejected = heldout_losses(_pipe(), root)
    for result in (plain, anchored):
        assert result.final_step == STEPS and (result.output_dir / "lora_diffusers.safetensors").exists()
    chosen, rejected = heldout_losses(_pipe(plain.output_dir / "lora_diffusers.safetensors"), root)
    preference = ((chosen - ref_chosen) - (rejected - ref_rejected)).mean()
    print("plain DPO: held-out chosen", (chosen - ref_chosen).mean().item(), "rejected", (rejected - ref_rejected).mean().item())
    assert preference < 0, "the model should favour the chosen samples relative to the reference"

    a_chosen, a_rejected = heldout_losses(_pipe(anchored.output_dir / "lora_diffusers.safetensors"), root)
    a_preference = ((a_chosen - ref_chosen) - (a_rejected - ref_rejected)).mean()
    print("anchored DPO: held-out chosen", (a_chosen - ref_chosen).mean().item(), "rejected", (a_rejected - ref_rejected).mean().item())
    assert a_preference < 0
    assert a_chosen.mean() <= ref_chosen.mean(), "the anchored variant must not make the chosen samples less likely"


def test_dpo_logs_heldout_drift_metrics(runs):
    from finetune.metrics import read_metrics

    _, plain, _ = runs
    rows = read_metrics(plain.output_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    evaluated = [r for r in rows if "heldout/margin" in r]
    assert [r["step"] for r in evaluated] == [20, 40]
    for key in ("chosen_loss", "rejected_loss", "chosen_vs_reference", "rejected_vs_reference", "accuracy"):
        assert all(f"heldout/{key}" in r for r in evaluated)
