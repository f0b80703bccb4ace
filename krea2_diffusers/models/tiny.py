"""``tiny-random``: a tiny pipeline with RANDOM weights, built offline, for demos and tests.

It has the real structure (real Qwen tokenizer, a 36-layer Qwen3-VL tapped at the real 12
layers, a Qwen-Image VAE, the Krea 2 transformer) at toy widths. Its images are noise-like:
it proves plumbing, not quality.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported on use: `is_tiny` / `TINY_LABEL` serve the CLI's fast paths
    import torch

TINY_RANDOM = "tiny-random"
TINY_LABEL = "tiny-random (RANDOM WEIGHTS — output is meaningless, for testing only)"
TEXT_HIDDEN = 32


def is_tiny(name) -> bool:
    return isinstance(name, str) and name == TINY_RANDOM


def tiny_transformer_config() -> dict:
    return dict(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, timestep_embed_dim=32, text_hidden_dim=TEXT_HIDDEN, num_text_layers=12,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(4, 6, 6),
    )


def tiny_text_encoder_config():
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=151936, hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=36,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]}, tie_word_embeddings=True,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_HIDDEN, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)


def tiny_vae_config() -> dict:
    return dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])


def randomize_(module: torch.nn.Module, generator: torch.Generator, std: float = 0.1) -> None:
    """Give every zero-initialised parameter (norm scales, modulation tables) random values too,
    so that tests exercise them; weight matrices keep their default init."""
    import torch

    with torch.no_grad():
        for param in module.parameters():
            if param.ndim < 2 or bool((param == 0).all()):
                param.add_(torch.randn(param.shape, generator=generator) * std)


def tiny_components(seed: int = 0, torch_dtype: "torch.dtype | None" = None, tokenizer: bool = True) -> dict:
    """The pipeline's components at toy size (float32 unless ``torch_dtype``), deterministic for a seed.
    ``tokenizer=False`` leaves the tokenizer out (None): parsing it costs more than the whole toy model,
    and a caller taking one module does not need it (the weights do not depend on it)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLForConditionalGeneration

    from ..conditioning.tokenizer import qwen_tokenizer
    from .transformer import Krea2Transformer2DModel

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    transformer = Krea2Transformer2DModel(**tiny_transformer_config())
    text_encoder = Qwen3VLForConditionalGeneration(tiny_text_encoder_config())
    vae = AutoencoderKLQwenImage(**tiny_vae_config())
    for module in (transformer, text_encoder, vae):
        randomize_(module, generator)
        if torch_dtype not in (None, torch.float32):
            module.to(torch_dtype)
        module.eval()
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()),
        vae=vae, text_encoder=text_encoder, tokenizer=qwen_tokenizer() if tokenizer else None, transformer=transformer,
    )


def scheduler_config() -> dict:
    """FlowMatchEulerDiscreteScheduler settings equal to Krea 2's schedule (kept for diffusers interop)."""
    from ..sampling import BASE_IMAGE_SEQ_LEN, BASE_SHIFT, MAX_IMAGE_SEQ_LEN, MAX_SHIFT

    return dict(
        use_dynamic_shifting=True, time_shift_type="exponential", base_shift=BASE_SHIFT, max_shift=MAX_SHIFT,
        base_image_seq_len=BASE_IMAGE_SEQ_LEN, max_image_seq_len=MAX_IMAGE_SEQ_LEN,
    )


def proportioned_transformer_config(num_layers: int = 12, heads: int = 8, head_dim: int = 64) -> dict:
    """A mid-size transformer with the released model's proportions (FFN ~8/3 x width, 128-wide
    blocks of rope axes as the loader infers them) that reads the tiny text encoder: ~180 MB in
    float32 at the defaults. For tests and benches of memory, sharding and quantization."""
    from .layers import rope_axes_dims

    dim = heads * head_dim
    return dict(
        in_channels=64, num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=8 * dim // 3 // 64 * 64, timestep_embed_dim=64,
        text_hidden_dim=TEXT_HIDDEN, num_text_layers=12, text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=64, num_layerwise_text_blocks=2, num_refiner_text_blocks=2,
        axes_dims_rope=tuple(rope_axes_dims(head_dim)),
    )


def save_random_original_file(path, config: dict, seed: int = 0, dtype: torch.dtype | None = None) -> int:
    """Write a randomly initialised transformer of ``config`` as an original-layout single file
    (what users download), in ``dtype`` (default float32); returns its size in bytes."""
    import torch

    from ..loaders.convert import convert_diffusers_to_original
    from ..files import save_safetensors
    from .transformer import Krea2Transformer2DModel

    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(**config)
    randomize_(model, torch.Generator().manual_seed(seed))
    state = {k: v.to(dtype or torch.float32) for k, v in convert_diffusers_to_original(model.state_dict()).items()}
    del model
    save_safetensors(state, path)
    return sum(v.numel() * v.element_size() for v in state.values())
