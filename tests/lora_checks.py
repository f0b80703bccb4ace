"""What the trained-adapter tests share: the tiny transformer ComfyUI's native loader can build (and
a text encoder as wide as its text fusion), the loss of a plain pipeline on fixed noise (measured outside the trainer), and patching a real
ComfyUI's model with LoRA files through ``LoraLoaderModelOnly``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from krea2_diffusers.models.tiny import proportioned_transformer_config, save_random_original_file

COMFY_BASE_NAME = "krea2_tiny_comfy.safetensors"
# ComfyUI's text fusion has 20 heads, so its width is a multiple of 20 (real Krea 2: 2560 = 20 x 128);
# the tiny text encoder's 32 is not. Adapters trained on the text fusion are checked at this width.
COMFY_TEXT_WIDTH = 40


def comfy_model_config(text_hidden_dim: int | None = None) -> dict:
    """2 blocks of one 128-wide head (ComfyUI's Krea 2 requires 128-wide heads), ComfyUI's SwiGLU
    width (int(2 * 128 / 3) * 4 rounded up to 128) and time embedding width (256); the text fusion
    as wide as the tiny text encoder."""
    config = proportioned_transformer_config(num_layers=2, heads=1, head_dim=128)
    config.update(intermediate_size=384, timestep_embed_dim=256)
    if text_hidden_dim is not None:  # ComfyUI's text fusion has 20 heads: its width is a multiple of 20
        config.update(text_hidden_dim=text_hidden_dim, text_num_attention_heads=20, text_num_key_value_heads=20,
                      text_intermediate_size=128)
    return config


def save_comfy_text_encoder(folder: Path, seed: int) -> Path:
    """The tiny random Qwen3-VL (``tiny_text_encoder_config``) at :data:`COMFY_TEXT_WIDTH`, saved as a
    Hugging Face folder (no tokenizer: the loaders use the Qwen tokenizer). Returns ``folder``."""
    from transformers import Qwen3VLForConditionalGeneration

    from krea2_diffusers.models.tiny import randomize_, tiny_text_encoder_config

    config = tiny_text_encoder_config()
    config.text_config.hidden_size = config.vision_config.out_hidden_size = COMFY_TEXT_WIDTH
    torch.manual_seed(seed)
    encoder = Qwen3VLForConditionalGeneration(config)
    randomize_(encoder, torch.Generator().manual_seed(seed))
    encoder.save_pretrained(folder)
    return folder


def fixed_batch_loss(pipe, trainer, lora_file: Path | None) -> float:
    """Flow-matching loss of a plain pipeline (optionally with a LoRA file loaded) on fixed noise
    and times over the trainer's first two forward batches: measured outside the trainer."""
    from finetune.optimization.objective import add_noise, flow_matching_loss

    if lora_file is not None:
        pipe.load_lora_weights(lora_file, adapter_name="trained")
    dtype = pipe.transformer.dtype
    generator = torch.Generator().manual_seed(123)
    losses = []
    with torch.no_grad():
        for step in range(2):
            batch = trainer.forward_batch(step)
            noise = torch.randn(batch["x0"].shape, generator=generator)
            t = torch.full((batch["x0"].shape[0],), 0.5)
            pred = pipe.transformer(hidden_states=add_noise(batch["x0"], noise, t).to(dtype),
                                    encoder_hidden_states=batch["embeds"].to(dtype), timestep=t,
                                    position_ids=batch["positions"], encoder_attention_mask=batch["mask"], return_dict=False)[0]
            losses.append(float(flow_matching_loss(pred, batch["x0"], noise, t)))
    if lora_file is not None:
        pipe.unload_lora_weights()
    return sum(losses) / len(losses)


def comfy_patched(comfyui, files: list[Path], prefix: str) -> tuple[dict, dict[Path, dict]]:
    """Patch ComfyUI's model (a file with our blocks' shapes; its text fusion 40 wide, a multiple
    of its 20 text heads) with each of ``files`` in ``LoraLoaderModelOnly`` at strength 1 and save
    it with ``ModelSave``. Fails if ComfyUI left a key unloaded. Returns (the base's tensors,
    ``{file: patched tensors}``), both by original-layout key."""
    models = comfyui.base / "models"
    if not (models / "diffusion_models" / COMFY_BASE_NAME).exists():
        save_random_original_file(models / "diffusion_models" / COMFY_BASE_NAME, comfy_model_config(COMFY_TEXT_WIDTH), seed=1)
    graph = {"base": {"class_type": "UNETLoader", "inputs": {"unet_name": COMFY_BASE_NAME, "weight_dtype": "default"}}}
    for path in files:
        name = f"{prefix}_{path.name}"
        (models / "loras" / name).write_bytes(path.read_bytes())
        graph[f"lora-{name}"] = {"class_type": "LoraLoaderModelOnly",
                                 "inputs": {"model": ["base", 0], "lora_name": name, "strength_model": 1.0}}
        graph[f"save-{name}"] = {"class_type": "ModelSave",
                                 "inputs": {"model": [f"lora-{name}", 0], "filename_prefix": f"patched/{prefix}_{path.stem}"}}
    log_start = len(comfyui.output())
    comfyui.run(graph)
    log = comfyui.output()[log_start:]
    assert "lora key not loaded" not in log and "ERROR lo" not in log, log[-3000:]
    patched = {}
    for path in files:
        (saved,) = (comfyui.base / "output" / "patched").glob(f"{prefix}_{path.stem}_*.safetensors")
        patched[path] = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(str(saved)).items()}
    return load_file(str(models / "diffusion_models" / COMFY_BASE_NAME)), patched


class DiedAfterStep(Exception):
    """The in-process stand-in for a kill: raised right after a step's metrics row is written."""


def dying_metrics_logger(kill_at: int) -> type:
    """A ``MetricsLogger`` that raises :class:`DiedAfterStep` once step ``kill_at``'s row is written
    (patched over ``finetune.trainer.MetricsLogger``: the run dies there, as if killed)."""
    from finetune.metrics import MetricsLogger

    class DyingMetricsLogger(MetricsLogger):
        def log(self, step: int, *args, **kwargs) -> None:
            super().log(step, *args, **kwargs)
            if step == kill_at:
                raise DiedAfterStep(step)

    return DyingMetricsLogger


def with_overrides(raw: dict, overrides: dict) -> dict:
    """``raw`` with each ``{"a.b.c": value}`` set at its dotted path (missing sections created)."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return raw
