"""Readers and writers for the single files ComfyUI users hold: the Qwen3-VL text encoder in
Hugging Face layout, the Qwen-Image VAE in Wan 2.1 layout, and ComfyUI's scaled-fp8 format."""
