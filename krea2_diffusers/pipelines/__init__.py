"""The pipelines: text-to-image (:mod:`.text_to_image`), image-to-image (:mod:`.img2img`) and
inpainting (:mod:`.inpaint`), their shared image inputs (:mod:`.image_inputs`) and the memory
knob (:mod:`.memory`). The classes are exported by ``krea2_diffusers`` itself; this package
re-exports nothing."""
