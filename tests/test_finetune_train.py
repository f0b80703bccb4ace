"""End-to-end LoRA and full fine-tunes on the tiny-random pipeline (CPU, about a minute).

The tiny-random VAE has random weights and maps every image to almost the same latents (pairwise
MSE ~5e-5 against a latent std of ~0.4), so "reproduce the right image" cannot be measured
through it. The learning test therefore swaps the VAE *encoder* used for caching for a fixed,
invertible-in-spirit stand-in (8x8 average pooling and a fixed random 3->16 channel map): the
training targets are then distinct per caption, and reproduction is measured in latent space,
through the real pipeline, the real transformer and the real exported LoRA files.
"""

from __future__ import annotations

import json

import pytest
import torch

import finetune.data.encoding
from finetune.config import build_config
from finetune.data import DatasetError, scan_dataset
from finetune.metrics import read_metrics
from finetune.trainer import NonFiniteLossError, RunDirectoryError, Trainer, train
from krea2_diffusers import Krea2Pipeline
from krea2_diffusers.loaders.lora import delete_lora, read_lora_file
from lora_checks import with_overrides

_CHANNEL_MAP = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))


def pooled_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Stand-in VAE encoder: (B, 3, H, W) in [0, 1] -> (B, 16, H/8, W/8), distinct per colour."""
    x = torch.nn.functional.avg_pool2d(pixels.float() * 2 - 1, 8)
    return torch.einsum("oc,bchw->bohw", _CHANNEL_MAP, x)


def lora_config(out, cache, **overrides) -> dict:
    raw = {
        "output_dir": str(out),
        "model": {"pretrained_model_name_or_path": "tiny-random", "turbo_model_name_or_path": "tiny-random"},
        "data": {"synthetic": {"num_prompts": 4, "size": 64}, "resolution": 64, "caption_dropout": 0.0, "cache_dir": str(cache)},
        "training": {"method": "lora", "max_steps": 200, "batch_size": 4, "seed": 0},
        "lora": {"rank": 16, "alpha": 16, "train_text_fusion": True, "extra_modules": ["img_in", "final_layer.linear"]},
        "optimizer": {"learning_rate": 3e-3},
        "lr_scheduler": {"name": "wsd", "warmup_steps": 10, "decay_fraction": 0.3},
        # Uniform times: 16-token images put the resolution shift near t = 0.6 and leave the low-t
        # end (where the per-caption colour is settled) under-trained in a 200-step run.
        "objective": {"timestep_sampling": "uniform", "shift": "none"},
        "checkpointing": {"every_n_steps": 100, "keep_last": 1},
        "validation": {"prompts": ["red"], "num_inference_steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64},
        "export": {"trigger_words": ["tinystyle"]},
        "logging": {"progress_bar": False},
    }
    return with_overrides(raw, overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the function-scoped one_thread fixture
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune.data.encoding, "encode_images", pooled_latents)
        trainer = Trainer(build_config(lora_config(root / "run", root / "cache")))
        result = trainer.train()
    torch.set_num_threads(threads)
    return trainer, result


pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(pipe, prompts):
    generators = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    return pipe(prompts, height=64, width=64, num_inference_steps=12, guidance_scale=0.0,
                generator=generators, output_type="latent").images


def _fresh_pipe():
    pipe = Krea2Pipeline.from_pretrained("tiny-random")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate_as_trained(trainer, pipe, prompts):
    """What the trained transformer (adapter live) generates in ``pipe`` (a fresh pipeline: the trainer
    drops its encoders after caching when no validation samples need them); ``pipe`` keeps its own
    transformer afterwards."""
    own = pipe.transformer
    pipe.register_modules(transformer=trainer.pipe.transformer)
    try:
        return _generate(pipe, prompts)
    finally:
        pipe.register_modules(transformer=own)


def test_lora_learns_a_distinct_image_per_prompt(trained):
    trainer, result = trained
    losses = [row["loss"] for row in read_metrics(result.output_dir)]
    assert len(losses) == 200
    assert sum(losses[-40:]) / 40 < 0.6 * sum(losses[:40]) / 40, "the loss should fall"

    samples = scan_dataset(result.output_dir / "synthetic_data").samples
    prompts = [s.caption for s in samples]
    targets = torch.cat([trainer.cache.latents([i]) for i in range(len(samples))])
    targets = finetune.data.encoding.pack_latents(targets)  # (4, 16, 64): what each prompt should produce

    pipe = _fresh_pipe()
    untrained = _generate(pipe, prompts)
    pipe.load_lora_weights(result.output_dir / "lora_diffusers.safetensors")
    learned = _generate(pipe, prompts)
    # error[i, j]: generation for prompt i against the image of prompt j
    error = torch.stack([((learned - targets[j]) ** 2).mean(dim=(1, 2)) for j in range(4)], dim=1)
    before = ((untrained - targets) ** 2).mean(dim=(1, 2))
    print("untrained per-prompt MSE", before.tolist(), "\ntrained error matrix\n", error)
    assert error.diagonal().mean() < 0.4 * before.mean()
    assert torch.equal(error.argmin(dim=1), torch.arange(4)), "each prompt must reproduce its own image"


def test_only_lora_weights_train_and_the_base_stays_bit_identical(trained):
    trainer, _ = trained
    transformer = trainer.pipe.transformer
    base = _fresh_pipe().transformer.state_dict()
    lora_names = []
    for name, param in transformer.named_parameters():
        if ".lora_" in name:
            lora_names.append(name)
            assert param.requires_grad
        else:
            assert not param.requires_grad, name
            assert torch.equal(param, base[name.replace(".base_layer", "")]), f"{name} changed"
    assert len(lora_names) == 2 * (2 * 8 + 4 * 8 + 2)  # blocks + text-fusion blocks + img_in/final
    # One more backward pass: gradients reach exactly the LoRA weights.
    batch = trainer.forward_batch(0)
    noisy = batch["x0"] * (1 - batch["t"][:, None, None]) + batch["noise"] * batch["t"][:, None, None]
    pred = trainer.model(hidden_states=noisy, encoder_hidden_states=batch["embeds"], timestep=batch["t"],
                         position_ids=batch["positions"], encoder_attention_mask=batch["mask"]).sample
    pred.square().mean().backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert with_grad == set(lora_names)
    transformer.zero_grad(set_to_none=True)


def test_three_exported_files_load_back_with_identical_effect(trained):
    trainer, result = trained
    files = {fmt: result.output_dir / f"lora_{fmt}.safetensors" for fmt in ("diffusers", "comfyui", "kohya")}
    assert set(result.exported) == set(files.values())
    pipe = _fresh_pipe()
    reference = _generate_as_trained(trainer, pipe, ["red", "green grass, 1998"])  # the model as trained, adapter live
    for fmt, path in files.items():
        tensors, meta = read_lora_file(path)
        assert meta["krea2.format"] == fmt and meta["krea2.base_model"] == "tiny-random"
        assert meta["krea2.rank"] == "16" and meta["krea2.steps"] == "200"
        assert json.loads(meta["krea2.trigger_words"]) == ["tinystyle"]
        prefix = {"diffusers": "transformer.transformer_blocks.", "comfyui": "diffusion_model.blocks.", "kohya": "lora_unet_blocks_"}[fmt]
        assert any(k.startswith(prefix) for k in tensors)
        name = pipe.load_lora_weights(path, adapter_name=fmt)
        torch.testing.assert_close(_generate(pipe, ["red", "green grass, 1998"]), reference, rtol=1e-4, atol=1e-5)
        delete_lora(pipe.transformer, name)


def test_diffusers_file_loads_into_diffusers_transformer(trained):
    import diffusers
    from krea2_diffusers.latents import position_ids

    trainer, result = trained
    ours = _fresh_pipe().transformer
    theirs = diffusers.Krea2Transformer2DModel(**dict(ours.config))
    theirs.load_state_dict(ours.state_dict())
    from krea2_diffusers.loaders.lora import load_lora_into_transformer

    path = result.output_dir / "lora_diffusers.safetensors"
    load_lora_into_transformer(ours, path)
    theirs.load_lora_adapter(diffusers.Krea2Pipeline.lora_state_dict(str(path)), prefix="transformer")
    inputs = dict(hidden_states=torch.randn(1, 16, 64), encoder_hidden_states=trainer.cache.text([0], [False])[0],
                  timestep=torch.tensor([0.6]))
    inputs["position_ids"] = position_ids(inputs["encoder_hidden_states"].shape[1], 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(**inputs).sample, ours.eval()(**inputs).sample, rtol=1e-4, atol=1e-5)


def test_logs_samples_and_checkpoints(trained):
    _, result = trained
    out = result.output_dir
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 201))
    assert all({"loss", "lr", "grad_norm"} <= set(r) for r in rows)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "samples" / "step-000200" / "raw-00.png").is_file()  # RAW with CFG
    assert (out / "samples" / "step-000200" / "turbo-00.png").is_file()  # Turbo with the LoRA
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-200"]  # keep_last=1


def test_loader_workers_fork_before_the_transformer_loads(tmp_path, monkeypatch):
    """Forked after the base loads, the workers would share its pages and the LoRA's, and each page
    the trainer rewrites later (the LoRA weights at every step) would be held twice: +0.5 GiB at
    full size on the CPU. They fork once the features are cached, before the transformer loads,
    from the resumed step's position, which the loaded checkpoint then confirms."""
    import shutil

    import psutil

    import finetune.model

    seen, before = [], set()
    load = finetune.model.load_transformer

    def children() -> set[int]:
        return {p.pid for p in psutil.Process().children()}

    def watched(config):
        seen.append(len(children() - before))  # new ones: other tests' servers are this process's children too
        return load(config)

    monkeypatch.setattr(finetune.model, "load_transformer", watched)
    raw = lora_config(tmp_path / "run", tmp_path / "cache", **{"training.max_steps": 4, "data.num_workers": 2,
                                                                "checkpointing.every_n_steps": 2,
                                                                "checkpointing.keep_last": 2})
    raw.pop("validation")
    before.update(children())
    result = Trainer(build_config(raw)).train()
    assert seen == [2] and sorted(result.losses) == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-4")  # resume from step 2
    before.update(children())
    resumed = Trainer(build_config(raw), resume=True)
    resumed_result = resumed.train()
    assert seen == [2, 2] and resumed.start_step == 2 and sorted(resumed_result.losses) == [3, 4]
    assert [resumed_result.losses[s] for s in (3, 4)] == [result.losses[s] for s in (3, 4)]


def test_nonfinite_loss_stops_naming_step_and_batch(tmp_path, monkeypatch):
    import finetune.trainer as trainer_module

    real = trainer_module.flow_matching_loss
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 5 else loss

    monkeypatch.setattr(trainer_module, "flow_matching_loss", poisoned)
    config = build_config(lora_config(tmp_path / "run", tmp_path / "cache", **{
        "training.max_steps": 8, "checkpointing.every_n_steps": 2, "checkpointing.keep_last": 5, "validation.prompts": []}))
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 5 .*on images \['sample_\d{3}_00.png'"):
        train(config)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step-2", "step-4"]  # the last good one is kept, nothing after
    assert not list((tmp_path / "run").glob("lora_*.safetensors"))


def test_bad_input_is_reported_before_any_model_loads(tmp_path, monkeypatch):
    import finetune.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(finetune.model, "load_pipeline", no_model)
    empty = tmp_path / "empty"
    empty.mkdir()
    config = lora_config(tmp_path / "a", tmp_path / "cache", **{"data.path": str(empty)})
    del config["data"]["synthetic"]
    with pytest.raises(DatasetError, match="no usable samples"):
        train(build_config(config))
    small = tmp_path / "small"
    small.mkdir()
    from PIL import Image

    Image.new("RGB", (40, 40)).save(small / "tiny.png")
    (small / "tiny.txt").write_text("tiny")
    config["data"]["path"] = str(small)
    with pytest.raises(DatasetError, match="smaller than their bucket"):
        train(build_config(config))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text("{}")
    with pytest.raises(RunDirectoryError, match="already holds a training run"):
        train(build_config(lora_config(tmp_path / "b", tmp_path / "cache")))


def test_cli_reports_config_typos(tmp_path, capsys):
    from krea2_diffusers.cli import main

    path = tmp_path / "cfg.yaml"
    path.write_text("data:\n  path: x\n")
    assert main(["train", str(path), "--output-dir", str(tmp_path / "o"), "training.max_step=3"]) == 2
    assert "did you mean 'training.max_steps'" in capsys.readouterr().err


def test_full_finetune_exports_diffusers_and_original_layouts(tmp_path):
    from krea2_diffusers import Krea2Transformer2DModel

    config = build_config(lora_config(tmp_path / "run", tmp_path / "cache", **{
        "training.method": "full", "training.max_steps": 3, "training.batch_size": 2, "optimizer.learning_rate": 1e-3,
        "validation.prompts": [], "model.turbo_model_name_or_path": None}))
    result = train(config)
    assert {p.name for p in result.exported} == {"transformer", "krea2_original.safetensors"}
    diffusers_layout = Krea2Transformer2DModel.from_pretrained(result.output_dir, subfolder="transformer")
    original_layout = Krea2Transformer2DModel.from_single_file(result.output_dir / "krea2_original.safetensors")
    base = _fresh_pipe().transformer.state_dict()
    a, b = diffusers_layout.state_dict(), original_layout.state_dict()
    assert a.keys() == b.keys() == base.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)  # it trained


def test_gradient_checkpointing_block_swap_and_dora(tmp_path):
    """Checkpointing and block swap change memory, not the maths; DoRA trains, exports its
    magnitudes in the diffusers file and loads back with the same effect."""
    base = {"training.max_steps": 3, "validation.prompts": [], "model.turbo_model_name_or_path": None,
            "checkpointing.every_n_steps": 0, "logging.tensorboard": False}
    plain = train(build_config(lora_config(tmp_path / "plain", tmp_path / "cache", **base)))
    # Block swap: on the CPU the copies are no-ops, the hooks and saved-tensor packing still run. The two
    # are independent wrappers (prepare_blocks, then BlockOffloader): one run per checkpointing mode, block
    # swap on in two of them (one of two blocks swapped beside selective checkpointing, whose unchecked
    # parts still save tensors; both blocks beside full checkpointing).
    variants = {"full": {"training.activation_checkpointing": "full"},
                "selective-offload": {"training.activation_checkpointing": "selective", "training.offload_blocks": 1},
                "offload-full": {"training.offload_blocks": 2, "training.activation_checkpointing": "full"}}
    for name, overrides in variants.items():
        ckpt = train(build_config(lora_config(tmp_path / name, tmp_path / "cache", **base, **overrides)))
        torch.testing.assert_close(torch.tensor(list(ckpt.losses.values())), torch.tensor(list(plain.losses.values())), rtol=1e-5, atol=1e-6)

    trainer = Trainer(build_config(lora_config(tmp_path / "dora", tmp_path / "cache", **base, **{"lora.use_dora": True})))
    result = trainer.train()
    assert [p.name for p in result.exported] == ["lora_diffusers.safetensors"]  # no agreed DoRA spelling elsewhere
    tensors, _ = read_lora_file(result.exported[0])
    assert any(k.endswith(".lora_magnitude_vector") for k in tensors)
    assert trainer.pipe.text_encoder is None and trainer.pipe.vae is None  # no validation: freed before the transformer loaded
    pipe = _fresh_pipe()
    reference = _generate_as_trained(trainer, pipe, ["red"])
    pipe.load_lora_weights(result.exported[0])
    torch.testing.assert_close(_generate(pipe, ["red"]), reference, rtol=1e-4, atol=1e-5)
