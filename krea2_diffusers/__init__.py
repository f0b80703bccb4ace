"""krea2-diffusers: Krea 2 (RAW and Turbo) for diffusers, ComfyUI and fine-tuning.

Names are imported on first use (module ``__getattr__``), so ``import krea2_diffusers`` and the
``krea2`` command's help do not load torch or diffusers.
"""

from __future__ import annotations

import importlib
import logging

# diffusers imports bitsandbytes whenever it is installed; on CPUs with AVX512-BF16 bitsandbytes then
# logs that an optional kernel package is missing. Harmless (its own fallback runs): not shown.
BITSANDBYTES_NOISE = "Failed to load CPU gemm_4bit_forward"
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: BITSANDBYTES_NOISE not in record.getMessage())

# Public name -> the module defining it.
_EXPORTS = {
    "CheckpointError": ".files",
    "Krea2Conditioning": ".models.transformer",
    "Krea2Img2ImgPipeline": ".pipelines.img2img",
    "Krea2InpaintPipeline": ".pipelines.inpaint",
    "Krea2Pipeline": ".pipelines.text_to_image",
    "Krea2PipelineOutput": ".pipelines.text_to_image",
    "Krea2Transformer2DModel": ".models.transformer",
    "RAW": ".presets",
    "TURBO": ".presets",
    "cache_preset": ".caching.presets",
    "convert_diffusers_to_original": ".loaders.convert",
    "convert_original_to_diffusers": ".loaders.convert",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
