"""What the model loader offers, how it loads it, and the cache that keeps it between queue runs.

Names are shown the way ComfyUI shows files: relative to their model folder, with ``/``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import comfy_bridge

TINY_RANDOM = "tiny-random"
HUB_TEXT_ENCODER = "Qwen/Qwen3-VL-4B-Instruct"
HUB_VAE = "Qwen/Qwen-Image"
CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".gguf")
# auto: the project's compute-dtype policy on ComfyUI's device (bf16 on CUDA and on CPUs with bf16 units).
DTYPES = ("auto", "bfloat16", "float16", "float32")
# Which release the transformer is: decides the sampler preset (Turbo: 8 steps, guidance off; RAW: 52, 3.5).
VARIANTS = {"auto": None, "turbo": True, "raw": False}

logger = logging.getLogger(__name__)


def _walk(kind: str):
    for root in comfy_bridge.model_folders(kind):
        if root.is_dir():
            for folder, dirs, files in os.walk(root, followlinks=True):
                dirs.sort()
                yield root, Path(folder), dirs, sorted(files)


def _name(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def list_files(kind: str, suffixes=CHECKPOINT_SUFFIXES) -> dict[str, Path]:
    """Files of the model folder ``kind`` ending in ``suffixes``, by display name."""
    found = {}
    for root, folder, _, files in _walk(kind):
        for file in files:
            if file.lower().endswith(suffixes):
                found.setdefault(_name(root, folder / file), folder / file)
    return dict(sorted(found.items()))


def list_folders(kind: str, markers: tuple[str, ...]) -> dict[str, Path]:
    """Sub-folders of the model folder ``kind`` holding one of ``markers`` (not descending into them)."""
    found = {}
    for root, folder, dirs, files in _walk(kind):
        if folder != root and any(marker in files for marker in markers):
            found.setdefault(_name(root, folder), folder)
            dirs.clear()
    return dict(sorted(found.items()))


def transformer_choices() -> dict[str, Path | None]:
    """tiny-random, diffusers folders (``models/diffusers``), then single files and GGUF (``models/diffusion_models``)."""
    folders = {f"diffusers/{name}": path for name, path in list_folders("diffusers", ("model_index.json",)).items()}
    return {TINY_RANDOM: None, **folders, **list_files("diffusion_models")}


# ComfyUI's usual names for the Krea 2 text encoder and VAE files: the first match is the default.
DEFAULT_FILE_PREFIXES = {"text_encoders": "qwen3vl_4b", "vae": "qwen_image_vae"}
COMPONENT_SUFFIXES = (".safetensors", ".sft")


def component_choices(kind: str, hub_id: str) -> dict[str, Path | str | None]:
    """What the loader offers for the text encoder (``kind`` "text_encoders") or VAE ("vae"), in order:
    ``tiny-random``, the hub id, the model folders (transformers/diffusers format) and the single files
    (ComfyUI's ``qwen3vl_4b_*.safetensors`` / ``qwen_image_vae.safetensors``) in the model folder ``kind``.
    """
    folders = list_folders(kind, ("config.json", "model_index.json"))
    files = list_files(kind, COMPONENT_SUFFIXES)
    return {TINY_RANDOM: None, hub_id: hub_id, **folders, **files}


def default_component(kind: str, hub_id: str) -> str:
    """ComfyUI's usual file when present (``qwen3vl_4b*`` / ``qwen_image_vae*``, bf16 before fp8), else the hub id."""
    prefix = DEFAULT_FILE_PREFIXES[kind]
    usual = [name for name in list_files(kind, COMPONENT_SUFFIXES) if Path(name).name.lower().startswith(prefix)]
    return sorted(usual, key=lambda name: ("fp8" in name.lower(), name))[0] if usual else hub_id


def memory_presets() -> list[str]:
    """The library's memory presets: ``auto`` sizes the plan to the GPU, ``high`` keeps everything on it."""
    from krea2_diffusers.pipelines.memory import MEMORY_PRESETS

    return list(MEMORY_PRESETS)


def _lookup(choices: dict, name: str, what: str, kind: str):
    if name not in choices:
        folders = ", ".join(str(p) for p in comfy_bridge.model_folders(kind))
        raise FileNotFoundError(f"Krea 2 {what} {name!r} is not in {folders}. Put it there and press 'Refresh' (R).")
    return choices[name]


def lora_path(name: str) -> Path:
    return _lookup(list_files("loras"), name, "LoRA", "loras")


@dataclass(frozen=True)
class LoadSpec:
    """Everything that identifies one loaded pipeline (the cache key)."""

    model: str
    variant: str = "auto"
    text_encoder: str = HUB_TEXT_ENCODER
    vae: str = HUB_VAE
    dtype: str = "auto"
    memory: str = "auto"


def weight_dtype(name: str) -> torch.dtype:
    """The loader's ``dtype`` choice: a dtype name, or ``auto`` (the compute-dtype policy on ComfyUI's device)."""
    if name != "auto":
        return getattr(torch, name)
    from krea2_diffusers.precision import choose_compute_dtype

    chosen = choose_compute_dtype(comfy_bridge.torch_device())
    logger.info("Krea 2 %s", chosen.describe())
    return chosen.dtype


def load_pipeline(spec: LoadSpec):
    """Build the Krea2Pipeline ``spec`` describes and fit it onto ComfyUI's device with its memory preset."""
    from krea2_diffusers import Krea2Pipeline
    from krea2_diffusers.loaders.assembly import load_pipeline as load
    from krea2_diffusers.pipelines.memory import apply_memory_preset

    path = _lookup(transformer_choices(), spec.model, "model", "diffusion_models")
    components = {}
    if path is None or path.is_file():  # tiny-random or a transformer alone: add the text encoder and VAE
        for name, kind, hub_id, what in (("text_encoder", "text_encoders", HUB_TEXT_ENCODER, "text encoder"),
                                         ("vae", "vae", HUB_VAE, "VAE")):
            source = _lookup(component_choices(kind, hub_id), getattr(spec, name), what, kind)
            # tiny-random keeps its own tiny components unless a local folder or file is chosen
            if path is not None or source not in (None, hub_id):
                components[name] = TINY_RANDOM if source is None else str(source)
    comfy_bridge.make_room()
    pipe = load(Krea2Pipeline, TINY_RANDOM if path is None else str(path), torch_dtype=weight_dtype(spec.dtype),
                is_distilled=VARIANTS[spec.variant], **components)
    logger.info("Krea 2 %s: %s", spec.model, apply_memory_preset(pipe, spec.memory, device=comfy_bridge.torch_device()))
    return pipe


class PipelineCache:
    """Keeps the most recently used pipeline loaded (loading another one frees it first) and which
    LoRAs are active on it."""

    def __init__(self, loader=load_pipeline):
        self._loader = loader
        self._spec: LoadSpec | None = None
        self._pipe = None
        self._loras: tuple = ()

    def get(self, spec: LoadSpec, loras: tuple | None = ()):
        """The pipeline for ``spec`` with exactly ``loras`` ((path, strength), ...) applied (None: as they are)."""
        if spec != self._spec:
            self.free()
            self._pipe, self._spec = self._loader(spec), spec
        if loras is not None and tuple(loras) != self._loras:
            self._set_loras(spec, tuple(loras))
        return self._pipe

    def _set_loras(self, spec: LoadSpec, loras: tuple) -> None:
        if self._loras and hasattr(self._pipe, "unload_lora_weights"):
            self._pipe.unload_lora_weights()
        elif self._loras:  # no way to take LoRAs off: start again from clean weights
            self.free()
            self._pipe, self._spec = self._loader(spec), spec
        self._loras = ()
        try:
            for index, (path, strength) in enumerate(loras):
                self._pipe.load_lora_weights(path, adapter_name=f"comfy_{index}", strength=strength)
        except BaseException:
            self.free()  # never keep a half-patched pipeline
            raise
        self._loras = loras

    def free(self) -> None:
        self._pipe = self._spec = None
        self._loras = ()
        from krea2_diffusers.heap import release_freed_memory

        release_freed_memory()

    @property
    def loaded(self) -> LoadSpec | None:
        return self._spec


PIPELINES = PipelineCache()
comfy_bridge.on_unload_models(PIPELINES.free)
