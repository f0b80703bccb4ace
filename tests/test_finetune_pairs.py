"""Edit / reference LoRAs trained on image pairs (``data.references``), on the tiny-random pipeline.

The task is the example's (``examples/train_edit_lora_tiny.yaml``, whose config the learning test
runs): a grey rectangle on a flat background (the reference) -> the same rectangle red (the
target), instruction "make it red". The tiny-random VAE is random and maps every image to nearly
the same latents, so colour cannot survive it. As in ``test_finetune_train.py`` the VAE ENCODER is
swapped for a fixed linear stand-in (8x8 average pooling, then a fixed random 3 -> 16 channel map
C), for the training cache AND for the pipeline's reference latents; that encoder has an exact
decoder on its image: the least-squares inverse of C, which gives back the 8x8-pooled RGB of any
latent. The colour criterion is read there: each 8x8 cell of a sample is classed as the nearest
of {red, grey, its background}, and the share of the rectangle's cells that are red, and of the
background's that kept their colour, is measured on held-out layouts (never trained on).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
import yaml

import finetune.data.encoding
import krea2_diffusers.conditioning.style
from finetune.config import build_config
from lora_checks import with_overrides
from finetune.data import DatasetError
from finetune.engine.checkpoint import checkpoint_name
from finetune.data.synthetic_pairs import GREY, INSTRUCTION, RED, layouts, make_edit_pairs, pair_images
from finetune.optimization.objective import flow_matching_loss
from finetune.trainer import Trainer
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.conditioning.reference_images import VISION_MAX_PIXELS
from krea2_diffusers.conditioning.references import encode_prompt_with_images
from krea2_diffusers.conditioning.style import reference_layout
from krea2_diffusers.latents import pack_latents, position_ids, unpack_latents

from test_finetune_train import _CHANNEL_MAP, pooled_latents

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_edit_lora_tiny.yaml"
SIZE, TRAIN_PAIRS, HELD_OUT = 64, 48, 6
pytestmark = pytest.mark.usefixtures("one_thread")


def example_config(root: Path, **overrides) -> dict:
    """The example's config on ``root``'s data, with dotted overrides."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["output_dir"] = str(root / "run")
    raw["data"]["path"] = str(root / "pairs")
    raw["data"]["cache_dir"] = str(root / "cache")
    raw["logging"] = {"progress_bar": False, "tensorboard": False}
    raw["validation"]["reference_images"] = [[str(root / "held_out" / "references" / f"pair_{TRAIN_PAIRS:03d}.png")]]
    raw["validation"]["prompts"] = [INSTRUCTION]
    return with_overrides(raw, overrides)


def decoded_cells(latents: torch.Tensor) -> np.ndarray:
    """Packed latents (16 tokens, 64) of a 64 px image -> (8, 8, 3) RGB of its 8x8 cells, through the
    exact inverse of the stand-in encoder (pooled pixels = pinv(C) @ latents)."""
    cells = unpack_latents(latents[None].float(), SIZE, SIZE)[0]  # (16, 8, 8)
    pooled = torch.einsum("co,ohw->hwc", torch.linalg.pinv(_CHANNEL_MAP), cells)  # 2 * rgb - 1
    return ((pooled + 1) / 2).numpy()


def colour_shares(cells: np.ndarray, background, mask: np.ndarray) -> tuple[float, float]:
    """(share of the rectangle's cells nearest red, share of the background's cells nearest their colour)."""
    palette = np.array([RED, GREY, background])
    nearest = np.argmin(((cells[:, :, None, :] - palette) ** 2).sum(-1), axis=-1)
    shape = mask.reshape(8, 8, 8, 8).mean((1, 3)) > 0.5
    return float((nearest[shape] == 0).mean()), float((nearest[~shape] == 2).mean())


def held_out_loss(pipe, pairs) -> float:
    """Mean flow-matching loss of the transformer on held-out pairs, fixed noise and t in {0.2 ... 0.8}."""
    generator = torch.Generator().manual_seed(0)
    total, count = 0.0, 0
    with torch.no_grad():
        for reference, target, _ in pairs:
            pixels = lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1)[None]
            x0 = pack_latents(pooled_latents(None, pixels(target)))
            refs = pack_latents(pooled_latents(None, pixels(reference)))
            embeds, mask, _ = encode_prompt_with_images(pipe.text_encoder, pipe.tokenizer, INSTRUCTION, [reference],
                                                     layers=pipe.config.text_encoder_select_layers, max_pixels=VISION_MAX_PIXELS)
            positions = torch.cat([position_ids(embeds.shape[1], 4, 4), reference_layout([(SIZE, SIZE)])[1]])
            for t in (0.2, 0.4, 0.6, 0.8):
                noise = torch.randn(x0.shape, generator=generator)
                t = torch.tensor([t])
                pred = pipe.transformer(hidden_states=(1 - t) * x0 + t * noise, encoder_hidden_states=embeds, timestep=t,
                                        position_ids=positions, encoder_attention_mask=mask, reference_hidden_states=refs,
                                        return_dict=False)[0]
                total += float(flow_matching_loss(pred, x0, noise, t))
                count += 1
    return total / count


def samples_follow(pipe, held_out, seeds=(0, 1)) -> tuple[float, float]:
    """Mean (red share of the rectangle, background kept) over held-out references and seeds."""
    red, kept = [], []
    for (reference, _, mask), (background, _) in held_out:
        for seed in seeds:
            latents = pipe(INSTRUCTION, reference_images=[reference], height=SIZE, width=SIZE, num_inference_steps=8,
                           guidance_scale=0.0, generator=torch.Generator().manual_seed(seed), output_type="latent").images[0]
            r, k = colour_shares(decoded_cells(latents), background, mask)
            red.append(r)
            kept.append(k)
    return float(np.mean(red)), float(np.mean(kept))


def write_pair_folder(root: Path) -> Path:
    """targets/a.png (one reference a.png), targets/b.png (two: b_1.png, b_2.png; b_2 listed after b_1),
    instructions beside the targets, references of other sizes and aspects than their targets."""
    colours = {"a": (200, 20, 20), "b": (20, 20, 200)}
    for name, colour in colours.items():
        (root / "targets").mkdir(parents=True, exist_ok=True)
        PIL.Image.new("RGB", (SIZE, SIZE), colour).save(root / "targets" / f"{name}.png")
        (root / "targets" / f"{name}.txt").write_text(INSTRUCTION)
    (root / "references").mkdir(exist_ok=True)
    PIL.Image.new("RGB", (96, 48), (128, 128, 128)).save(root / "references" / "a.png")
    PIL.Image.new("RGB", (40, 80), (100, 100, 100)).save(root / "references" / "b_2.png")
    PIL.Image.new("RGB", (64, 64), (90, 90, 90)).save(root / "references" / "b_1.png")
    return root


def test_pairs_from_a_folder_or_a_manifest_keep_each_references_aspect(tmp_path):
    from finetune.data.pairs import batch_keys, scan_pairs

    settings = build_config(example_config(tmp_path, **{"data.references.max_pixels": 1024})).data.references
    folder = write_pair_folder(tmp_path / "pairs")
    rows = [{"image": "targets/a.png", "references": ["references/a.png"], "text": INSTRUCTION},
            {"image": "targets/b.png", "references": ["references/b_1.png", "references/b_2.png"], "text": INSTRUCTION}]
    (folder / "pairs.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    for source in (folder, folder / "pairs.jsonl"):
        samples = scan_pairs(source, settings).samples
        assert [(s.image_path.name, s.caption, [r.name for r in s.references]) for s in samples] == [
            ("a.png", INSTRUCTION, ["a.png"]), ("b.png", INSTRUCTION, ["b_1.png", "b_2.png"])]
        # (h, w) at <= 1024 px, sides rounded down to 16: 96x48 (w x h) scales by sqrt(1024 / 4608) to 45.3 x 22.6
        # -> (16, 32); 64x64 by 0.5 -> (32, 32); 40x80 by sqrt(1024 / 3200) to 22.6 x 45.3 -> (32, 16).
        assert batch_keys(samples, [(64, 64)] * 2, settings.max_pixels) == [
            ((64, 64), ((16, 32),)), ((64, 64), ((32, 32), (32, 16)))]


def test_bad_pairs_are_refused_naming_the_file_before_any_model_loads(tmp_path, no_model_loading):
    def refused(match: str, **overrides):
        with pytest.raises(DatasetError, match=match):
            Trainer(build_config(example_config(tmp_path, **overrides))).train()

    folder = write_pair_folder(tmp_path / "pairs")
    PIL.Image.new("RGB", (SIZE, SIZE)).save(folder / "targets" / "c.png")
    (folder / "targets" / "c.txt").write_text(INSTRUCTION)
    refused(r"1 problem\(s\) with the paired samples: target \S*/targets/c.png has no reference image")
    (folder / "references" / "c.png").write_text("not a png")
    refused(r"reference \S*/references/c.png of target c.png is not an image")
    PIL.Image.new("RGB", (SIZE, SIZE)).save(folder / "references" / "c.png")
    refused(r"target \S*/targets/b.png has 2 references \(b_1.png, b_2.png\), more than data.references.max_references=1",
            **{"data.references.max_references": 1})
    (folder / "references" / "d.png").write_bytes((folder / "references" / "c.png").read_bytes())
    refused(r"\S*/references/d.png belongs to no target")
    (folder / "references" / "d.png").unlink()
    refused(r"validation.reference_images\[0\] \S*/missing.png does not exist",
            **{"validation.reference_images": [[str(tmp_path / "missing.png")]]})


def test_edit_lora_on_pairs_learns_the_edit_resumes_validates_and_exports(tmp_path, monkeypatch):
    steps = yaml.safe_load(EXAMPLE.read_text())["training"]["max_steps"]  # the example's run, as written
    make_edit_pairs(tmp_path / "pairs", TRAIN_PAIRS)
    make_edit_pairs(tmp_path / "held_out", 1, offset=TRAIN_PAIRS)
    monkeypatch.setattr(finetune.data.encoding, "encode_images", pooled_latents)
    raw = example_config(tmp_path, **{"checkpointing.every_n_steps": steps - 2})
    result = Trainer(build_config(raw)).train()

    # Resume from the step-(N-2) checkpoint: the same last two losses, then validation and export again.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / checkpoint_name(steps))
    resumed = Trainer(build_config(raw), resume=True).train()
    assert sorted(resumed.losses) == [steps - 1, steps]
    assert [resumed.losses[s] for s in (steps - 1, steps)] == [result.losses[s] for s in (steps - 1, steps)]

    sample = PIL.Image.open(next((tmp_path / "run" / "samples").glob("step-*/raw-00.png")))
    assert sample.size == (2 * SIZE, SIZE)  # reference | output, one image per sample
    exported = {p.name for p in resumed.exported}
    assert {"lora_diffusers.safetensors", "lora_comfyui.safetensors", "lora_kohya.safetensors"} <= exported, exported

    monkeypatch.setattr(krea2_diffusers.conditioning.style, "encode_images", pooled_latents)  # reference latents as cached
    combos = layouts()[TRAIN_PAIRS:TRAIN_PAIRS + HELD_OUT]
    held_out = [(pair_images(background, rect, SIZE), (background, rect)) for background, rect in combos]
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    base_loss, base_follow = held_out_loss(pipe, [p for p, _ in held_out]), samples_follow(pipe, held_out)
    pipe.load_lora_weights(tmp_path / "run" / "lora_diffusers.safetensors")
    lora_loss, lora_follow = held_out_loss(pipe, [p for p, _ in held_out]), samples_follow(pipe, held_out)
    print(f"held-out loss {base_loss:.4f} -> {lora_loss:.4f}; (red share of the rectangle, background kept) "
          f"base {base_follow} -> LoRA {lora_follow}")
    # Measured (loaded 2-core machine): loss 3.10 -> 1.06, red share 0.01 -> 0.77, background kept 0.09 -> 0.78.
    # A random colour is nearest red in ~1/3 of cells at most; the thresholds leave ~0.15 of margin
    # to the measured LoRA, more than the spread seen across training seeds and settings (0.59-0.77).
    assert lora_loss < 0.5 * base_loss
    assert lora_follow[0] > 0.6 and base_follow[0] < 0.1, "the rectangle is not red with the LoRA (or is without it)"
    assert lora_follow[1] > 0.6 and base_follow[1] < 0.3, "the background is not the reference's with the LoRA"


def test_pairs_train_over_each_quantized_base_and_adapter_type_and_on_two_processes(tmp_path):
    """The pairs path excludes no LoRA base, adapter type or process count: LoKr over int8 with the
    ``training.reference_kv_cache`` mask, on 1 process (global batch 2) and on 2 (DDP, gloo, each
    encoding half of the reference cache) with the same losses up to float32 summation order
    (rtol 1e-5); LoHa over fp8 and LoRA over nf4 on 1. Each exports every format."""
    from safetensors import safe_open

    from finetune.metrics import read_metrics
    from launcher import launch

    make_edit_pairs(tmp_path / "pairs", 4)

    def config(name: str, kind: str, quantize: str, **more) -> dict:
        return example_config(tmp_path, **{"output_dir": str(tmp_path / name), "training.max_steps": 2, "training.batch_size": 2,
                                           "training.reference_kv_cache": kind == "lokr", "lora.type": kind,
                                           "model.quantize": quantize, "data.num_workers": 0, "validation.prompts": [],
                                           "validation.reference_images": [], "checkpointing.every_n_steps": 2, **more})

    for kind, quantize in (("lokr", "int8"), ("loha", "fp8"), ("lora", "nf4")):
        trainer = Trainer(build_config(config(kind, kind, quantize)))
        result = trainer.train()
        assert sorted(result.losses) == [1, 2] and all(np.isfinite(list(result.losses.values()))), (kind, result.losses)
        assert trainer.reference_kwargs(trainer.forward_batch(0))["reference_attention"] == ("cached" if kind == "lokr" else "joint")
        with safe_open(str(tmp_path / kind / "lora_kohya.safetensors"), "pt") as f:
            assert f.metadata().get("krea2.adapter_type", "lora") == kind  # plain LoRA files carry no type
        assert sorted(p.name for p in result.exported) == ["lora_comfyui.safetensors", "lora_diffusers.safetensors",
                                                            "lora_kohya.safetensors"]

    two = config("two", "lokr", "int8", **{"training.batch_size": 1, "data.cache_dir": str(tmp_path / "cache_two")})
    done = launch(two, tmp_path / "two_config", 2, ["-m", "finetune"])
    assert "2 process(es)" in done.stdout + done.stderr
    losses = [[row["loss"] for row in read_metrics(tmp_path / name)] for name in ("lokr", "two")]
    assert np.allclose(losses[1], losses[0], rtol=1e-5, atol=0), losses
    assert len(list((tmp_path / "cache_two" / "reference_text").rglob("*.safetensors"))) == 4  # each pair's, once
