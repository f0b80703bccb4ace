"""Writing the result from a DCP checkpoint: LoRA files in the three formats other tools load, or
full weights in the diffusers and original layouts.

Full weights are streamed: tensors are read from the checkpoint's shard files a group at a time
(at most :data:`GROUP_BYTES`) and appended to the output file, so one process never holds the
whole model. ``krea2 export CHECKPOINT_DIR OUT`` runs the same code on its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch

from krea2_diffusers.loaders.convert import diffusers_module_to_original
from krea2_diffusers.files import atomic_write, write_safetensors_streaming
from krea2_diffusers.loaders.lora import ADAPTER_PREFIXES, lora_layers_from_diffusers_state_dict, lora_metadata, save_lora_file

from ..engine.checkpoint import load_in_this_process, read_train_state

logger = logging.getLogger("finetune")

LORA_FILE_NAMES = {
    "diffusers": "lora_diffusers.safetensors",
    "comfyui": "lora_comfyui.safetensors",
    "kohya": "lora_kohya.safetensors",
}
FULL_FORMATS = ("diffusers", "original")
ORIGINAL_FILE_NAME = "krea2_original.safetensors"
# Tensors read from the checkpoint per group while streaming a full model out.
GROUP_BYTES = 1 << 30


def model_tensors(path: Path, prefix: str = "", section: str = "model") -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Model tensors of a DCP checkpoint (by parameter name) with their dtype and global shape;
    ``prefix``: only the names under it (e.g. a distillation's ``student.``), without it.
    ``section``: ``model`` (the trained weights) or ``ema`` (their average, :mod:`finetune.optimization.ema`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    out = {}
    start = f"{section}." + prefix
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata):
            out[key[len(start):]] = (entry.properties.dtype, tuple(entry.size))
    return out


def read_model_tensors(path: Path, names: list[str], shapes: dict, prefix: str = "", section: str = "model") -> dict[str, torch.Tensor]:
    """Read whole tensors ``names`` (under ``prefix``, in ``section``: see :func:`model_tensors`)
    from a DCP checkpoint in this process alone (any writer world size)."""
    state = {section: {prefix + n: torch.empty(shapes[n][1], dtype=shapes[n][0]) for n in names}}
    load_in_this_process(state, path)
    return {n[len(prefix):]: v for n, v in state[section].items()}


def _groups(path: Path, names: list[str], shapes: dict, dtype: torch.dtype | None,
            prefix: str = "", section: str = "model") -> Iterator[dict[str, torch.Tensor]]:
    group, size = [], 0
    for name in names:
        group.append(name)
        size += shapes[name][0].itemsize * int(torch.Size(shapes[name][1]).numel())
        if size >= GROUP_BYTES or name == names[-1]:
            tensors = read_model_tensors(path, group, shapes, prefix, section)
            yield {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in tensors.items()}
            group, size = [], 0


def export_lora(path: Path, out_dir: Path, state: dict, formats: list[str], trigger_words: list[str],
                section: str = "model") -> list[Path]:
    """LoRA files from a LoRA run's checkpoint (its model part holds only the adapters). A LoKr or
    LoHa run writes LyCORIS tensors (``lokr_w1`` ..., ``hada_w1_a`` ...) under each format's module
    names, its ``alpha / rank`` folded into the first factor."""
    shapes = model_tensors(path, section=section)
    # The model part holds the trainable parameters only (older checkpoints also held frozen buffers,
    # e.g. fp8 row scales); a distillation's fake-score adapter is excluded by the run's export hints.
    excluded = [f".{name}." for name in state.get("export", {}).get("exclude_adapters", [])]
    names = [n for n in shapes if any(f".{prefix}" in n for prefix in ADAPTER_PREFIXES)
             and not any(e in f"{n}." for e in excluded)]
    trainable = read_model_tensors(path, sorted(names), shapes, section=section)
    lora = state["lora"]
    layers = lora_layers_from_diffusers_state_dict(trainable, alpha=lora["alpha"], rank=lora["rank"])
    kind = lora.get("type", "lora")
    rank = str(lora["rank"])
    extra = {} if kind == "lora" else {  # ours, and the kohya/LyCORIS names UIs show
        "krea2.adapter_type": kind, "krea2.rank": rank, "krea2.alpha": rank, "ss_network_dim": rank, "ss_network_alpha": rank,
        "ss_network_module": "lycoris.kohya",
        "ss_network_args": json.dumps({"algo": kind, **({"factor": lora["factor"]} if kind == "lokr" else {})}),
    }
    if section == "ema":  # which weights the file holds, for whoever compares files later
        extra = {**extra, "krea2.ema_decay": str(state["ema"]["decay"])}
    written = []
    for fmt in formats:
        if fmt not in LORA_FILE_NAMES:
            continue
        if fmt != "diffusers" and lora.get("use_dora"):
            # DoRA magnitudes have no agreed spelling in these formats; better no file than a wrong one.
            logger.warning("export: DoRA LoRAs are written in the diffusers format only; skipping %s", fmt)
            continue
        meta = lora_metadata(layers, fmt, state["base_model"], trained_alpha=lora["alpha"],
                             trigger_words=trigger_words, steps=state["step"], extra=extra)
        written.append(save_lora_file(out_dir / LORA_FILE_NAMES[fmt], layers, fmt, meta))
    return written


def export_full(path: Path, out_dir: Path, state: dict, formats: list[str], dtype: torch.dtype | None = None,
                section: str = "model") -> list[Path]:
    """``transformer/`` (diffusers folder) and/or ``krea2_original.safetensors``, streamed."""
    hints = state.get("export", {})
    prefix = hints.get("model_prefix", "")
    shapes = model_tensors(path, prefix, section)
    names = sorted(shapes)
    meta = {"format": "pt", "krea2.base_model": state["base_model"], "krea2.steps": str(state["step"]),
            **hints.get("metadata", {}), **({"krea2.ema_decay": str(state["ema"]["decay"])} if section == "ema" else {})}

    def entries(rename=lambda n: n, reshape=lambda n, s: s):
        return [(rename(n), dtype if dtype is not None and shapes[n][0].is_floating_point else shapes[n][0],
                 reshape(n, shapes[n][1])) for n in names]

    written = []
    if "diffusers" in formats:
        folder = out_dir / "transformer"
        write_safetensors_streaming(folder / "diffusion_pytorch_model.safetensors", entries(),
                                    _groups(path, names, shapes, dtype, prefix, section), metadata=meta)
        config = {**state["transformer_config"], "_class_name": "Krea2Transformer2DModel"}
        with atomic_write(folder / "config.json", "w") as handle:
            handle.write(json.dumps(config, indent=2))
        written.append(folder)
    if "original" in formats:
        def flat(name, shape):  # the block modulation table is (6, D) in diffusers, (6D,) in the original file
            modulation = name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table") and len(shape) == 2
            return (shape[0] * shape[1],) if modulation else shape

        chunks = ({diffusers_module_to_original(k): v.reshape(flat(k, tuple(v.shape))) for k, v in chunk.items()}
                  for chunk in _groups(path, names, shapes, dtype, prefix, section))
        target = out_dir / ORIGINAL_FILE_NAME
        write_safetensors_streaming(target, entries(diffusers_module_to_original, flat), chunks, metadata=meta)
        written.append(target)
    return written


def export_checkpoint(path: Path, out_dir: Path, formats: list[str] | None = None, trigger_words: list[str] = (),
                      dtype: torch.dtype | None = None, weights: str | None = None) -> list[Path]:
    """Everything a run exports, from checkpoint folder ``path`` into ``out_dir``.

    ``formats``: LoRA runs ``diffusers``/``comfyui``/``kohya``; full fine-tunes ``diffusers``/``original``
    (default: all of the kind). ``dtype``: cast full weights (e.g. bf16), None keeps the stored float32.
    ``weights``: ``raw`` (the trained weights) or ``ema`` (their average, when the run kept one);
    None: what the run exports (``training.ema.export``: the average unless it is ``raw``).
    """
    path, out_dir = Path(path), Path(out_dir)
    state = read_train_state(path)
    ema = state.get("ema")
    if weights is None:
        weights = "ema" if ema and ema["export"] != "raw" else "raw"
    if weights not in ("raw", "ema"):
        raise ValueError(f"weights must be 'raw' or 'ema', got {weights!r}")
    if weights == "ema" and not ema:
        raise ValueError(f"{path} holds no EMA (its run had no training.ema)")
    section = "ema" if weights == "ema" else "model"
    if state["method"] == "lora":
        return export_lora(path, out_dir, state, list(formats or LORA_FILE_NAMES), list(trigger_words), section)
    wanted = [f for f in (formats or FULL_FORMATS) if f in FULL_FORMATS] or list(FULL_FORMATS)
    return export_full(path, out_dir, state, wanted, dtype, section)
