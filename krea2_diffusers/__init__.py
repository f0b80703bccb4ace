"""krea2-diffusers: Krea 2 (RAW and Turbo) for diffusers, ComfyUI and fine-tuning."""

from .convert import convert_diffusers_to_original, convert_original_to_diffusers
from .files import CheckpointError
from .pipeline import Krea2Pipeline, Krea2PipelineOutput
from .presets import RAW, TURBO
from .transformer import Krea2Conditioning, Krea2Transformer2DModel

__all__ = [
    "CheckpointError",
    "Krea2Conditioning",
    "Krea2Pipeline",
    "Krea2PipelineOutput",
    "Krea2Transformer2DModel",
    "RAW",
    "TURBO",
    "convert_diffusers_to_original",
    "convert_original_to_diffusers",
]
__version__ = "0.1.0"
