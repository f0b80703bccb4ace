"""Pipelines that start from an image: image-to-image and inpainting (text-to-image is ``krea2_diffusers.pipeline``)."""

from .img2img import Krea2Img2ImgPipeline
from .inpaint import Krea2InpaintPipeline

__all__ = ["Krea2Img2ImgPipeline", "Krea2InpaintPipeline"]
