"""Reference-image nodes (edit / identity / insertion LoRAs): native IMAGE in, to the Krea 2 Sampler
or, as text conditioning with the images' vision tokens, to ComfyUI's native samplers.

- ``Krea2ReferenceImage``: a native IMAGE (each batch item its own reference) with a strength,
  chained into ``KREA2_REFERENCES`` for the Krea 2 Sampler (vision tokens + reference latents).
- ``Krea2TextEncode``: the prompt, with the references as vision tokens, encoded by the pipeline's
  Qwen3-VL as a native CONDITIONING. With native ``VAE Encode`` -> ``ReferenceLatent`` (the LATENT
  path) and the reference-method node set to ``index_timestep_zero`` it feeds native Krea 2 models
  (UNETLoader / LoraLoaderModelOnly) the way the Sampler does. ComfyUI's own CLIPLoader builds only
  the 4B Qwen3-VL; this node runs whichever text encoder the pipeline holds.
"""

from __future__ import annotations

import torch

from . import comfy_bridge

CATEGORY = "Krea2"
PIPELINE = "KREA2_PIPELINE"
REFERENCES = "KREA2_REFERENCES"


class Krea2ReferenceImage:
    DESCRIPTION = ("Adds a reference image for an edit / identity / insertion LoRA. Chain up to 3 into the Sampler "
                   "(or Text Encode).")
    CATEGORY = CATEGORY
    FUNCTION = "add_reference"
    RETURN_TYPES = (REFERENCES,)
    RETURN_NAMES = ("references",)
    OUTPUT_TOOLTIPS = ("The references so far; connect to another Reference Image, the Sampler or Text Encode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "image": ("IMAGE", {"tooltip": "The reference; every image of a batch becomes its own reference, "
                                               "kept at its own aspect (at most 1024^2 px)."}),
                "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 4.0, "step": 0.05, "tooltip": (
                    "How much the model attends to this reference: 0 = ignored, 1 = as trained.")}),
            },
            "optional": {"references": (REFERENCES, {"tooltip": "References from a previous Reference Image node."})},
        }

    def add_reference(self, image, strength, references=()):
        return (tuple(references) + tuple((pil, float(strength)) for pil in comfy_bridge.comfy_to_pil(image)),)


class Krea2TextEncode:
    DESCRIPTION = ("Encodes a prompt with the pipeline's Qwen3-VL, reference images as vision tokens before it, as a "
                   "native CONDITIONING (add their latents with native ReferenceLatent).")
    CATEGORY = CATEGORY
    FUNCTION = "encode"
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("conditioning",)
    OUTPUT_TOOLTIPS = ("(1, L, 12 x width) text features, the layout of ComfyUI's own Krea 2 text encoder.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE, {"tooltip": "Its text encoder encodes the prompt."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "dynamicPrompts": True,
                                      "tooltip": "The instruction or description, as for the Sampler."}),
            },
            "optional": {"references": (REFERENCES, {"tooltip": (
                "From Krea 2 Reference Image: their vision tokens enter the text (strengths act in the Sampler only).")})},
        }

    def encode(self, pipeline, prompt, references=()):
        from krea2_diffusers.conditioning.reference_images import check_reference_images, reference_image_batch
        from krea2_diffusers.conditioning.text import DEFAULT_MAX_SEQUENCE_LENGTH

        checked = check_reference_images([ref[0] for ref in references] or None, latents=False)
        pipe = pipeline.pipeline()
        device = pipe._execution_device
        with torch.no_grad():
            if checked is None:
                embeds, _ = pipe.encode_prompt([prompt], device=device)
            else:
                embeds = reference_image_batch(pipe, [prompt], checked, max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH,
                                               device=device).embeds
        batch, length, layers, width = embeds.shape
        return ([[embeds.float().cpu().reshape(batch, length, layers * width), {}]],)
