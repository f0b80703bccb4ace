"""From what a user names to loaded models: the one pipeline loader (:mod:`.assembly`), the
transformer's single files (:mod:`.single_file`, key layouts in :mod:`.convert`), LoRA files
(:mod:`.lora`), and the single files ComfyUI users hold: the Qwen3-VL text encoder in Hugging Face
layout (:mod:`.text_encoder`), the Qwen-Image VAE in Wan 2.1 layout (:mod:`.vae`) and ComfyUI's
scaled-fp8 format (:mod:`.comfy_fp8`)."""
