"""``Krea2InpaintPipeline``: repaint the white part of a mask, keep the black part.

Each Euler step ends by putting the input's own noised latent back outside the mask
(``sampling.keep_known``), so after the last step the kept latents equal the input image's encoded
latents (posterior mode) exactly. The mask is binarised at 0.5 and a latent cell is repainted when
any of its 8x8 pixels is white. With ``padding_mask_crop`` only a crop around the mask is
generated (at the target size) and pasted back into the original, in pixel space, where the mask
is white (diffusers' behaviour): the output then has the original image's size.
"""

from __future__ import annotations

import PIL.Image
import torch

from ..latents import PATCH_SIZE
from ..sampling import ImageStart, check_strength
from .image_inputs import crop_region, fit, latent_repaint_mask, load_images, overlay, to_pixels
from .img2img import DEFAULT_STRENGTH, Krea2Img2ImgPipeline
from .text_to_image import Krea2Pipeline, Krea2PipelineOutput


class Krea2InpaintPipeline(Krea2Img2ImgPipeline):
    """Krea 2 inpainting: same components, loaders and ``from_pipe`` as :class:`Krea2Pipeline`."""

    @torch.no_grad()
    def __call__(self, prompt=None, image=None, mask_image=None, strength: float = DEFAULT_STRENGTH,
                 height: int | None = None, width: int | None = None, padding_mask_crop: int | None = None,
                 output_type: str = "pil", return_dict: bool = True, **kwargs):
        """Inpaint ``image`` where ``mask_image`` is white: all of :meth:`Krea2Pipeline.__call__`'s arguments, plus

        Args:
            image: the input image(s) or model latents (see :meth:`Krea2Img2ImgPipeline.encode_image`).
            mask_image: white = repaint, black = keep; paths / PIL / arrays / tensors, any size
                (resized to the target with a warning), several channels converted to one.
            strength: in [0, 1], as in img2img (1: the masked part starts from pure noise).
            padding_mask_crop: generate only the mask's bounding box grown by this many pixels
                (widened to the target's aspect), then paste it back into the full-size original.
        """
        strength = check_strength(strength)
        if image is None or mask_image is None:
            raise ValueError("inpainting needs both `image` and `mask_image`")
        masks = load_images(mask_image, "mask_image", gray=True)
        box = originals = full_masks = None
        if padding_mask_crop is not None:
            if isinstance(image, torch.Tensor) and image.ndim == 4 and image.shape[1] != 3:
                raise ValueError("padding_mask_crop needs the image in pixels, not latents")
            originals = load_images(image, "image")
            full_masks = fit(masks, originals[0].height, originals[0].width, "mask_image", PIL.Image.BILINEAR)
            height = height or originals[0].height
            width = width or originals[0].width
            box = crop_region(full_masks[0], width, height, padding_mask_crop)
            image, masks = [o.crop(box) for o in originals], [m.crop(box) for m in full_masks]
            height, width = self._check_size(height, width)
        x0, height, width = self.encode_image(image, height, width)
        pixel_mask = to_pixels(fit(masks, height, width, "mask_image", PIL.Image.BILINEAR))
        repaint = latent_repaint_mask(pixel_mask, self.transformer.config.in_channels // PATCH_SIZE**2)
        if repaint.shape[0] != x0.shape[0]:
            if min(repaint.shape[0], x0.shape[0]) != 1:
                raise ValueError(f"got {x0.shape[0]} images and {repaint.shape[0]} masks; pass one mask, or one per image")
            rows = max(repaint.shape[0], x0.shape[0])
            x0, repaint = x0.expand(rows, -1, -1), repaint.expand(rows, -1, -1)
        start = ImageStart(x0, strength, repaint.to(x0.device))
        inner_type = "pt" if box is not None and output_type != "latent" else output_type
        out = Krea2Pipeline.__call__(self, prompt, height=height, width=width, image_start=start, output_type=inner_type, **kwargs)
        images = out.images
        if box is not None and output_type != "latent":
            images = self.to_output(overlay(images, originals, full_masks, box), output_type)
        if not return_dict:
            return (images,)
        return Krea2PipelineOutput(images=images, expanded_prompts=out.expanded_prompts)
