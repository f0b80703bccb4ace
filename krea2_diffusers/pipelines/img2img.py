"""``Krea2Img2ImgPipeline``: image-to-image with Krea 2 RAW or Turbo.

The input image is VAE-encoded (posterior mode) to x0; sampling starts at the shifted schedule's
time ``t0`` where diffusers' img2img rule puts ``strength`` (the last ``int(steps * strength)`` of
the steps run), from ``(1 - t0) x0 + t0 noise``. Everything else (text, style references, CFG,
the Euler loop) is ``Krea2Pipeline``'s, through ``sampling.ImageStart``.
"""

from __future__ import annotations

import torch

from ..latents import PATCH_SIZE, VAE_SCALE_FACTOR, PIXELS_PER_TOKEN, encode_images, pack_latents
from ..sampling import ImageStart, check_strength
from .image_inputs import fit, load_images, to_pixels
from .text_to_image import Krea2Pipeline

DEFAULT_STRENGTH = 0.6  # diffusers' img2img / inpainting default


class Krea2Img2ImgPipeline(Krea2Pipeline):
    """Krea 2 image-to-image: same components, loaders and ``from_pipe`` as :class:`Krea2Pipeline`."""

    def encode_image(self, image, height: int | None = None, width: int | None = None) -> tuple[torch.Tensor, int, int]:
        """The input image(s) as packed model latents x0 (K, N, 64) float32, and the target size.

        Args:
            image: paths / PIL images / arrays / (K, 3, H, W) tensors in [0, 1]; or model latents
                (K, 16, H/8, W/8) as ``latents.encode_images`` returns them (normalised; e.g. a
                ComfyUI LATENT's ``samples[:, :, 0]`` after the model's normalisation).
            height, width: target pixels; default the (first) image's size. Images of another size
                are resized with a warning; sizes round up to multiples of 16 with a warning.
        """
        channels = self.transformer.config.in_channels // PATCH_SIZE**2
        if isinstance(image, torch.Tensor) and image.ndim == 4 and image.shape[1] == channels:
            h, w = (side * VAE_SCALE_FACTOR for side in image.shape[-2:])
            if (height or h, width or w) != (h, w) or h % PIXELS_PER_TOKEN or w % PIXELS_PER_TOKEN:
                raise ValueError(f"image latents are for a {h}x{w} image; height/width must match it and be multiples "
                                 f"of {PIXELS_PER_TOKEN}, got {height}x{width}")
            return pack_latents(image.float()), h, w
        images = load_images(image, "image")
        height, width = self._check_size(height or images[0].height, width or images[0].width)
        pixels = to_pixels(fit(images, height, width, "image")).to(self._execution_device)
        return pack_latents(encode_images(self.vae, pixels).float()), height, width

    @torch.no_grad()
    def __call__(self, prompt=None, image=None, strength: float = DEFAULT_STRENGTH, height: int | None = None,
                 width: int | None = None, **kwargs):
        """Generate from ``image``: all of :meth:`Krea2Pipeline.__call__`'s arguments, plus

        Args:
            image: the input image(s) (see :meth:`encode_image`): one for every prompt, or one per prompt.
            strength: in [0, 1]: 0 returns the input (its VAE round trip), 1 ignores it (equals
                text-to-image with the same noise). ``latents``, if given, is the noise mixed in.
            height, width: default the input image's size.
        """
        strength = check_strength(strength)
        if image is None:
            raise ValueError("image is required (the input of image-to-image)")
        x0, height, width = self.encode_image(image, height, width)
        return Krea2Pipeline.__call__(self, prompt, height=height, width=width, image_start=ImageStart(x0, strength), **kwargs)
