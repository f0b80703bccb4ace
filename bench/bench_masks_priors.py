"""What masks and regularisation images do to a LoRA, measured on tiny-random with the trainer's own
code (CPU, a few minutes):

    KREA2_CPU_BF16=0 OMP_NUM_THREADS=1 python bench/bench_masks_priors.py [--steps 400] [--part masks|priors|both] [--json out.json]

1. Masked loss: two subject images, the same subject colour on their left half and a different
   background colour on their right, a mask covering the left half. After training, on each half of
   the latent grid: how far the LoRA moved the velocity the model predicts for the training images
   (noised at t = 0.3, 0.5, 0.7, fixed noise; RMS change against the base), and how far it moved the
   subject prompt's generation (12 steps from fixed noise), for the masked run and the same run
   without masks. The tiny model barely places things spatially, so a generation spills what the
   masked half learned over the whole grid; the prediction on the image itself shows where it learned.
2. Regularisation: the same subject run with and without prior images (the base model's own samples of
   class prompts, DreamBooth's prior preservation), fixed seeds; how far a held-out class prompt's
   generation moved from the base's.

The tiny-random VAE maps every image to nearly the same latents, so caching goes through a stand-in
encoder: 8x8 pixel-unshuffle and a fixed orthonormal 192 -> 16 projection, whose transpose decodes a
latent to pixels exactly up to 8-bit rounding (and clipping to [0, 1]). The prior images are the base's latents decoded that way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import finetune.data.encoding  # noqa: E402
from finetune.config import build_config  # noqa: E402
from finetune.trainer import train  # noqa: E402
from krea2_diffusers import Krea2Pipeline  # noqa: E402
from krea2_diffusers.latents import unpack_latents  # noqa: E402

SIZE, SCALE = 64, 4.0
_PROJECTION = torch.linalg.qr(torch.randn(192, 16, generator=torch.Generator().manual_seed(0)))[0].T.contiguous()  # (16, 192)
SEEDS = (100, 101, 102, 103)


def standin_encode(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 16, H/8, W/8)."""
    cells = torch.nn.functional.pixel_unshuffle((pixels.float() - 0.5) * SCALE, 8)  # (B, 192, h, w)
    return torch.einsum("oc,bchw->bohw", _PROJECTION, cells)


def standin_decode(latents: torch.Tensor) -> np.ndarray:
    """(16, h, w) -> (H, W, 3) uint8, the inverse of :func:`standin_encode` up to rounding."""
    cells = torch.einsum("oc,ohw->chw", _PROJECTION, latents.float())
    pixels = torch.nn.functional.pixel_shuffle(cells[None], 8)[0] / SCALE + 0.5
    return (pixels.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()


def pipe_fresh() -> Krea2Pipeline:
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, prompts: list[str]) -> torch.Tensor:
    """(P, 16, 8, 8) latents, one fixed seed per prompt position."""
    generators = [torch.Generator().manual_seed(SEEDS[i % len(SEEDS)]) for i in range(len(prompts))]
    packed = pipe(prompts, height=SIZE, width=SIZE, num_inference_steps=12, guidance_scale=0.0, generator=generators,
                  output_type="latent").images
    return unpack_latents(packed, SIZE, SIZE)


def subject_set(folder: Path, masks: bool) -> list[str]:
    """Two subject images: the subject's colour on the left half, a background on the right; masks keep the left."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = [((230, 40, 40), (40, 200, 60)), ((230, 40, 40), (40, 60, 230))]
    captions = []
    for i, (left, right) in enumerate(colours):
        pixels = np.zeros((SIZE, SIZE, 3), np.uint8)
        pixels[:, : SIZE // 2], pixels[:, SIZE // 2:] = left, right
        Image.fromarray(pixels).save(folder / f"s{i}.png")
        captions.append(f"ohwx square {i}")
        (folder / f"s{i}.txt").write_text(captions[-1])
        if masks:
            mask = np.zeros((SIZE, SIZE), np.uint8)
            mask[:, : SIZE // 2] = 255
            Image.fromarray(mask, mode="L").save(folder / f"s{i}.mask.png")
    return captions


def prior_set(folder: Path, prompts: list[str]) -> None:
    """The base model's own samples of the class prompts, as images."""
    folder.mkdir(parents=True, exist_ok=True)
    latents = generate(pipe_fresh(), prompts)
    for i, (prompt, latent) in enumerate(zip(prompts, latents)):
        Image.fromarray(standin_decode(latent)).save(folder / f"p{i}.png")
        (folder / f"p{i}.txt").write_text(prompt)


def run(root: Path, name: str, datasets: list[dict], masks: bool, steps: int, lr: float = 3e-3, text: bool = True) -> Path:
    raw = {"output_dir": str(root / name),
           "data": {"datasets": datasets, "masks": masks, "resolution": SIZE, "caption_dropout": 0.0,
                    "cache_dir": str(root / "cache"), "num_workers": 0},
           "training": {"max_steps": steps, "batch_size": 2, "seed": 0},
           "lora": {"rank": 16, "alpha": 16, "train_text_fusion": text,
                    "extra_modules": ["img_in", "final_layer.linear"] if text else []},
           "optimizer": {"learning_rate": lr}, "lr_scheduler": {"name": "wsd", "warmup_steps": 10, "decay_fraction": 0.3},
           "objective": {"timestep_sampling": "uniform", "shift": "none"},
           "checkpointing": {"every_n_steps": 0, "keep_last": 1}, "export": {"formats": ["diffusers"]},
           "logging": {"progress_bar": False, "tensorboard": False}}
    train(build_config(raw))
    return root / name / "lora_diffusers.safetensors"


def with_lora(path: Path, prompts: list[str]) -> torch.Tensor:
    pipe = pipe_fresh()
    pipe.load_lora_weights(path)
    return generate(pipe, prompts)


def predictions(pipe, prompts: list[str], targets: torch.Tensor, denoised: bool = False) -> torch.Tensor:
    """(P, T, 16, 8, 8): the velocity predicted for each target noised at each of T times (fixed noise);
    with ``denoised`` the clean latents it implies instead, ``x_t - t * velocity``."""
    from krea2_diffusers.latents import pack_latents, position_ids

    embeds, mask = pipe.encode_prompt(prompts)
    x0 = pack_latents(targets)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))
    out = []
    with torch.no_grad():
        for t in (0.3, 0.5, 0.7):
            times = torch.full((len(prompts),), t)
            pred = pipe.transformer(hidden_states=(1 - t) * x0 + t * noise, encoder_hidden_states=embeds, timestep=times,
                                    position_ids=position_ids(embeds.shape[1], SIZE // 16, SIZE // 16),
                                    encoder_attention_mask=mask, return_dict=False)[0]
            out.append(unpack_latents((1 - t) * x0 + t * noise - t * pred if denoised else pred, SIZE, SIZE))
    return torch.stack(out, dim=1)


def rms(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean().sqrt())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--part", choices=["masks", "priors", "both"], default="both")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--blocks-only", action="store_true", help="LoRA on the blocks only (no text fusion, img_in, final layer)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    finetune.data.encoding.encode_images = standin_encode
    results: dict = {"steps": args.steps, "lr": args.lr, "blocks_only": args.blocks_only}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        captions = subject_set(root / "subject", masks=True)
        base = generate(pipe_fresh(), captions)
        target = torch.cat([standin_encode(None, torch.from_numpy(np.asarray(Image.open(root / "subject" / f"s{i}.png"),
                                                                            dtype=np.float32)[None] / 255).permute(0, 3, 1, 2))
                            for i in range(2)])
        half = target.shape[-1] // 2
        subject = [{"path": str(root / "subject")}]
        base_pred = predictions(pipe_fresh(), captions, target)
        for name, masks in (("masked", True), ("unmasked", False)) if args.part != "priors" else ():
            lora = run(root, name, subject, masks, args.steps, args.lr, not args.blocks_only)
            moved = with_lora(lora, captions) - base
            pipe = pipe_fresh()
            pipe.load_lora_weights(lora)
            pred_moved = predictions(pipe, captions, target) - base_pred
            results[name] = {"prediction_rms_change_masked_half": rms(pred_moved[..., :half]),
                             "prediction_rms_change_other_half": rms(pred_moved[..., half:]),"rms_change_masked_half": rms(moved[..., :half]), "rms_change_other_half": rms(moved[..., half:]),
                             "rms_error_masked_half": rms((base + moved - target)[..., :half]),
                             "rms_error_other_half": rms((base + moved - target)[..., half:])}
        results["base_rms_error"] = {"masked_half": rms((base - target)[..., :half]), "other_half": rms((base - target)[..., half:])}

        class_prompts = ["a square", "a square shape", "a bright square", "a square, plain"]
        held_out = ["a square picture", "square"]
        prior_set(root / "prior", class_prompts)
        held_base = generate(pipe_fresh(), held_out)
        for name, datasets in () if args.part == "masks" else (("no_prior", subject),
                               ("prior", subject + [{"path": str(root / "prior"), "is_regularization": True}])):
            lora = run(root, name, datasets, False, args.steps)
            results[name] = {"held_out_rms_change": rms(with_lora(lora, held_out) - held_base),
                             "class_prompts_rms_change": rms(with_lora(lora, class_prompts) - generate(pipe_fresh(), class_prompts)),
                             "subject_rms_error": rms(with_lora(lora, captions) - target)}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
