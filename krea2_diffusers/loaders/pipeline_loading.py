"""``Krea2PipelineLoadingMixin``: how a Krea 2 pipeline is built from what users hold.

``from_pretrained`` takes a diffusers-format folder or hub id (our transformer class is used, and an
old folder's module paths are read as today's), ``"tiny-random"`` or ``"krea2-digits"``;
``from_single_file`` takes a RAW or Turbo transformer file with its text encoder and VAE
(:func:`~krea2_diffusers.loaders.assembly.assemble_from_single_file`). Mixed in before
``DiffusionPipeline``, whose loaders these extend, as diffusers mixes ``FromSingleFileMixin`` in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..conditioning.tokenizer import folder_tokenizer
from ..models.digits import digits_components, digits_folder, is_digits
from ..models.tiny import TINY_LABEL, is_tiny, tiny_components
from ..models.transformer import Krea2Transformer2DModel
from ..precision import resolve_dtype

logger = logging.getLogger(__name__)

# ``model_index.json`` names a component defined outside diffusers/transformers by its module path
# (diffusers records ``cls.__module__`` and resolves it through ``sys.modules``). A folder saved
# before a module moved (e.g. ``krea2_diffusers.transformer``, now ``...models.transformer``) names
# a path that no longer exists: such entries are read as the class's current module.
PACKAGE = __name__.split(".")[0]


def _current_library(entry):
    """``[library, class]`` with a ``krea2_diffusers.<module>`` library replaced by the module the
    package's class of that name lives in now (unchanged for anything else)."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
            and entry[0].startswith(PACKAGE + ".")):
        return entry
    import importlib

    cls = getattr(importlib.import_module(PACKAGE), entry[1], None)
    return [cls.__module__, entry[1]] if cls is not None else entry


class Krea2PipelineLoadingMixin:
    """``load_config``, ``from_pretrained`` and ``from_single_file`` of :class:`~krea2_diffusers.Krea2Pipeline`
    (and its img2img / inpaint subclasses)."""

    @classmethod
    def load_config(cls, *args, **kwargs):
        """diffusers' ``load_config``, our components' libraries read as their current modules."""
        loaded = super().load_config(*args, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        for key, value in list(config.items()):
            config[key] = _current_library(value)
        return loaded

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """A diffusers-format folder or hub id (our transformer class is used), ``"tiny-random"``, or
        ``"krea2-digits"`` (the packaged trained model, float32 unless ``dtype``). ``dtype`` is diffusers'
        name since 0.42; its older ``torch_dtype`` is still taken (not both)."""
        is_distilled = kwargs.pop("is_distilled", None)
        dtype = resolve_dtype(kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None))
        if dtype is not None:
            kwargs["dtype"] = dtype
        if is_digits(pretrained_model_name_or_path):
            # The folder ships no text encoder or tokenizer: rebuilt offline (models.digits), unless passed.
            kwargs["dtype"] = kwargs.get("dtype") or torch.float32
            kwargs.update(digits_components(kwargs["dtype"], kwargs.get("text_encoder"), kwargs.get("tokenizer")))
            pretrained_model_name_or_path = digits_folder()
        if is_tiny(pretrained_model_name_or_path):
            dtype = kwargs.pop("dtype", None) or torch.float32
            components = tiny_components(seed=kwargs.pop("seed", 0), torch_dtype=dtype)
            # Components passed in replace the tiny ones, as diffusers' from_pretrained does.
            components.update({k: kwargs[k] for k in components if kwargs.get(k) is not None})
            pipe = cls(**components, is_distilled=bool(is_distilled))
            pipe.label = TINY_LABEL
            logger.warning("Loaded %s", TINY_LABEL)
            return pipe
        local_tokenizer = Path(pretrained_model_name_or_path) / "tokenizer"
        if "tokenizer" not in kwargs and (local_tokenizer / "tokenizer.json").is_file():
            # Parsed once per process for each content (every folder this project writes holds the same one).
            kwargs["tokenizer"] = folder_tokenizer(local_tokenizer)
        if "transformer" not in kwargs:
            sub = {k: kwargs[k] for k in ("dtype", "cache_dir", "local_files_only", "revision", "token") if k in kwargs}
            kwargs["transformer"] = Krea2Transformer2DModel.from_pretrained(pretrained_model_name_or_path, subfolder="transformer", **sub)
        pipe = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if is_distilled is None:
            from .assembly import recorded_distillation

            # A distilled export says so in its own file, whatever the folder is called.
            recorded, steps = recorded_distillation(pretrained_model_name_or_path)
            if recorded is not None:
                pipe.register_to_config(is_distilled=recorded, distilled_steps=steps if recorded else None)
        else:
            pipe.register_to_config(is_distilled=bool(is_distilled))
        return pipe

    @classmethod
    def from_single_file(cls, path, text_encoder="Qwen/Qwen3-VL-4B-Instruct", vae="Qwen/Qwen-Image", tokenizer=None,
                         torch_dtype=None, is_distilled: bool | None = None, text_encoder_config=None,
                         upcast_fp8: bool = False, dtype=None, **load_kwargs):
        """Assemble a pipeline from a RAW or Turbo transformer file (safetensors, ComfyUI scaled fp8 or
        GGUF) plus the Qwen3-VL-4B-Instruct text encoder and the Qwen-Image VAE.

        ``text_encoder`` and ``vae`` may each be a hub id, a local folder, a loaded model, or ONE
        safetensors file as ComfyUI keeps them (``qwen3vl_4b_*.safetensors`` in Hugging Face layout,
        bf16 or scaled fp8; ``qwen_image_vae.safetensors`` in Wan 2.1 or diffusers layout).
        ``text_encoder_config`` (folder, JSON file or ``Qwen3VLConfig``) is for single-file text
        encoders other than the 4B. fp8 files stay fp8 with their scales (bf16 compute) unless
        ``upcast_fp8``. ``is_distilled`` defaults to whether the file name says Turbo/TDM. ``dtype`` or
        (its older name) ``torch_dtype``: the components' dtype.
        """
        from .assembly import assemble_from_single_file

        return assemble_from_single_file(cls, path, text_encoder=text_encoder, vae=vae, tokenizer=tokenizer,
                                         torch_dtype=resolve_dtype(dtype, torch_dtype), is_distilled=is_distilled,
                                         text_encoder_config=text_encoder_config, upcast_fp8=upcast_fp8, **load_kwargs)
