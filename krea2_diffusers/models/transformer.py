"""The Krea 2 single-stream diffusion transformer.

Config keywords, parameter names and ``forward`` match ``diffusers.Krea2Transformer2DModel``,
so diffusers-format weights and LoRAs load in both. What differs is the work per step:

* :meth:`Krea2Transformer2DModel.prepare_conditioning` runs everything that does not depend on
  the timestep (text fusion, text projection, RoPE tables, attention masks) once; the sampler
  passes the result to every step as ``conditioning=``.
* Grouped-query attention folds query groups into the sequence axis instead of repeating K/V.
* Padded text tokens are skipped by the layer-wise text-fusion blocks (their outputs are never read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin

from ..caching.registrations import check_cache_config, register_block
from ..loaders.adapters import per_call_lora_scale
from ..precision import resolve_dtype
from ..presets import check_reference_options
from .layers import Attention, PlainBlock, RMSNorm, SwiGLU, TimestepEmbedding, rope_tables

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Krea2Conditioning:
    """Timestep-independent inputs of a forward pass, computed once per generation.

    Attributes:
        text: (B, L, D) projected text tokens.
        attention_bias: None (no padding, no weights), bool keep-mask or float additive bias on the
            keys, (B, L + N + R).
        rope: (cos, sin), each (1, L + N + R, 1, head_dim) float32.
        text_len: L.
        reference: (B|1, R, D) projected clean reference tokens (style references, joint attention), or None.
        reference_modulation: (B|1, 1, 6, D) shared modulation of timestep 0 for the reference tokens.
        reference_kv: cached attention: per layer the reference tokens' rotated (key, value), each
            (B|1, R, H_kv, hd), computed once; the step's tokens attend to them as extra keys
            (``attention_bias`` then covers L + N + R keys while ``rope`` covers L + N).
    """

    text: torch.Tensor
    attention_bias: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    text_len: int
    reference: torch.Tensor | None = None
    reference_modulation: torch.Tensor | None = None
    reference_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def reference_len(self) -> int:
        """Reference tokens inside the step's sequence (0 when cached: they are keys only)."""
        return 0 if self.reference is None else self.reference.shape[1]

    @property
    def batch_size(self) -> int:
        return self.text.shape[0]

    def select(self, index: slice | torch.Tensor) -> "Krea2Conditioning":
        """The conditioning of a subset of the batch (e.g. only the conditional CFG branch)."""
        batch = self.batch_size
        # Reference tensors shared by every row (batch 1) stay as they are.
        pick = lambda x: x if x is None or (x.shape[0] == 1 and batch != 1) else x[index]
        kv = None if self.reference_kv is None else [(pick(k), pick(v)) for k, v in self.reference_kv]
        return replace(self, text=self.text[index], attention_bias=pick(self.attention_bias), reference=pick(self.reference),
                       reference_modulation=pick(self.reference_modulation), reference_kv=kv)


def _modulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Modulation tables are small and sit next to a 1 + scale: keep at least float32 for them.
    return torch.promote_types(dtype, torch.float32)


class Krea2Block(nn.Module):
    """Single-stream block: modulated pre-norm attention and SwiGLU, each with a gated residual."""

    def __init__(self, dim: int, hidden_dim: int, num_heads: int, num_kv_heads: int, eps: float) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(6, dim))
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, eps)
        self.ff = SwiGLU(dim, hidden_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        time_modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention_bias: torch.Tensor | None,
        reference_modulation: torch.Tensor | None = None,
        reference_len: int = 0,
        reference_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: list | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, S, D); time_modulation (B, 1, 6, D) shared by all blocks.

        With ``reference_modulation``, the last ``reference_len`` tokens (clean style references)
        are modulated with it (timestep 0) instead of ``time_modulation``. ``reference_kv``: cached
        reference keys/values appended to the attention's keys; ``kv_sink`` receives this block's
        own (key, value) (see :class:`~krea2_diffusers.models.layers.Attention`).
        """
        table = self.scale_shift_table.to(time_modulation.dtype)
        mods = [(time_modulation + table).to(hidden_states.dtype).unbind(2)]
        lengths = [hidden_states.shape[1] - reference_len]
        if reference_modulation is not None and reference_len:
            mods.append((reference_modulation + table).to(hidden_states.dtype).unbind(2))
            lengths.append(reference_len)

        def modulate(x, scale, shift):
            if len(mods) == 1:
                return (1 + mods[0][scale]) * x + mods[0][shift]
            return torch.cat([(1 + m[scale]) * part + m[shift] for m, part in zip(mods, x.split(lengths, 1))], 1)

        def gated(x, gate):
            if len(mods) == 1:
                return mods[0][gate] * x
            return torch.cat([m[gate] * part for m, part in zip(mods, x.split(lengths, 1))], 1)

        # modulation rows: prescale, preshift, pregate, postscale, postshift, postgate
        attended = self.attn(modulate(self.norm1(hidden_states), 0, 1), attention_bias, rope, reference_kv, kv_sink)
        hidden_states = hidden_states + gated(attended, 2)
        return hidden_states + gated(self.ff(modulate(self.norm2(hidden_states), 3, 4)), 5)


class TextFusion(nn.Module):
    """(B, L, layers, Dt) tapped encoder states -> (B, L, Dt) fused text features."""

    def __init__(self, num_text_layers, dim, num_heads, num_kv_heads, hidden_dim, num_layerwise, num_refiner, eps):
        super().__init__()
        self.layerwise_blocks = nn.ModuleList(
            PlainBlock(dim, num_heads, num_kv_heads, hidden_dim, eps) for _ in range(num_layerwise)
        )
        self.projector = nn.Linear(num_text_layers, 1, bias=False)
        self.refiner_blocks = nn.ModuleList(
            PlainBlock(dim, num_heads, num_kv_heads, hidden_dim, eps) for _ in range(num_refiner)
        )

    def forward(self, encoder_hidden_states: torch.Tensor, mask: torch.Tensor | None,
                attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        """mask (B, L) bool marks real tokens; the refiner attends with ``attention_bias`` (B, L)
        (float, e.g. per-group log strengths) when given, else with ``mask``."""
        batch, length, layers, dim = encoder_hidden_states.shape
        stacks = encoder_hidden_states.reshape(batch * length, layers, dim)
        keep = None if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
        # Each token's layer stack is its own length-`layers` sequence; padded tokens are skipped.
        fused = stacks if keep is None else stacks.index_select(0, keep)
        for block in self.layerwise_blocks:
            fused = block(fused)
        if keep is not None:
            fused = stacks.new_zeros(stacks.shape).index_copy(0, keep, fused)
        # Collapse the layer axis: (B, L, layers, Dt) -> (B, L, Dt).
        text = self.projector(fused.view(batch, length, layers, dim).transpose(2, 3)).squeeze(-1)
        refiner_bias = mask if attention_bias is None else attention_bias
        for block in self.refiner_blocks:
            text = block(text, refiner_bias)
        return text


class TextProjection(nn.Module):
    """RMSNorm -> Linear -> GELU(tanh) -> Linear: (B, L, Dt) -> (B, L, D)."""

    def __init__(self, text_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = nn.Linear(text_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.norm(text)), approximate="tanh"))


class FinalLayer(nn.Module):
    """Adaptive RMSNorm with a learned (2, D) table on top of ``temb``, then Linear(D -> 64)."""

    def __init__(self, dim: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(2, dim))
        self.norm = RMSNorm(dim, eps)
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """hidden_states (B, N, D), temb (B, D) -> (B, N, out_channels)."""
        mod_dtype = _modulation_dtype(temb.dtype)
        mod = temb.to(mod_dtype)[:, None, :] + self.scale_shift_table.to(mod_dtype)
        scale, shift = mod.to(hidden_states.dtype).unbind(1)
        return self.linear((1 + scale[:, None]) * self.norm(hidden_states) + shift[:, None])


class Krea2Transformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin, CacheMixin):
    """Krea 2 flow-velocity transformer (12.8B parameters at the default config).

    Args mirror ``diffusers.Krea2Transformer2DModel``: ``in_channels`` (64 = 16 latent channels x 2x2
    patch), ``num_layers`` (28), ``attention_head_dim`` (128), ``num_attention_heads`` (48),
    ``num_key_value_heads`` (12), ``intermediate_size`` (16384), ``timestep_embed_dim`` (256),
    ``text_hidden_dim`` (2560), ``num_text_layers`` (12), ``text_num_attention_heads`` (20),
    ``text_num_key_value_heads`` (20), ``text_intermediate_size`` (6912),
    ``num_layerwise_text_blocks`` (2), ``num_refiner_text_blocks`` (2), ``axes_dims_rope``
    ((32, 48, 48)), ``rope_theta`` (1000), ``norm_eps`` (1e-5).
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["Krea2Block", "PlainBlock", "FinalLayer"]
    _repeated_blocks = ["Krea2Block"]
    _keep_in_fp32_modules = ["norm", "norm1", "norm2", "norm_q", "norm_k"]
    _skip_layerwise_casting_patterns = ["time_embed", "norm"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 64,
        num_layers: int = 28,
        attention_head_dim: int = 128,
        num_attention_heads: int = 48,
        num_key_value_heads: int = 12,
        intermediate_size: int = 16384,
        timestep_embed_dim: int = 256,
        text_hidden_dim: int = 2560,
        num_text_layers: int = 12,
        text_num_attention_heads: int = 20,
        text_num_key_value_heads: int = 20,
        text_intermediate_size: int = 6912,
        num_layerwise_text_blocks: int = 2,
        num_refiner_text_blocks: int = 2,
        axes_dims_rope: tuple[int, int, int] = (32, 48, 48),
        rope_theta: float = 1000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if sum(axes_dims_rope) != attention_head_dim:
            raise ValueError(f"axes_dims_rope={tuple(axes_dims_rope)} must sum to attention_head_dim={attention_head_dim}")
        dim = attention_head_dim * num_attention_heads
        self.gradient_checkpointing = False
        self.img_in = nn.Linear(in_channels, dim)
        self.time_embed = TimestepEmbedding(timestep_embed_dim, dim)
        self.time_mod_proj = nn.Linear(dim, 6 * dim)
        self.text_fusion = TextFusion(
            num_text_layers, text_hidden_dim, text_num_attention_heads, text_num_key_value_heads,
            text_intermediate_size, num_layerwise_text_blocks, num_refiner_text_blocks, norm_eps,
        )
        self.txt_in = TextProjection(text_hidden_dim, dim, norm_eps)
        self.transformer_blocks = nn.ModuleList(
            Krea2Block(dim, intermediate_size, num_attention_heads, num_key_value_heads, norm_eps)
            for _ in range(num_layers)
        )
        self.final_layer = FinalLayer(dim, in_channels, norm_eps)

    @classmethod
    def from_single_file(cls, path, torch_dtype: torch.dtype | None = None, config: dict | None = None,
                         upcast_fp8: bool = False, quantization: str | None = None, device=None,
                         dtype: torch.dtype | None = None):
        """Load from an original-layout single file (``model.diffusion_model.`` prefix allowed, or
        sharded with an index), a diffusers-layout file (with ``config``) or a GGUF file.

        ComfyUI's scaled-fp8 files keep their fp8 weights and scales (bf16 compute) unless
        ``upcast_fp8`` dequantizes them to ``torch_dtype``.

        The config is inferred from tensor shapes when not given; no ``torch_dtype`` keeps the stored
        dtypes. The model is built on the meta device, so loading needs about one copy of the weights.

        ``quantization="fp8" | "int8" | "nf4"`` stores the block matrices quantized, streamed: each
        block is read and quantized (on ``device``, default CPU) before the next is read, so the
        full-precision model never exists whole (see :mod:`krea2_diffusers.loaders.quantized`).
        ``torch_dtype`` is then the kept layers' dtype and the compute dtype (default bfloat16).
        ``dtype`` is diffusers' (0.42) name for ``torch_dtype``; either, not both.
        """
        torch_dtype = resolve_dtype(dtype, torch_dtype)
        if quantization is not None:
            from ..loaders.quantized import load_quantized_transformer

            return load_quantized_transformer(cls, path, quantization, torch_dtype=torch_dtype, config=config, device=device)
        from ..loaders.single_file import load_single_file

        model = load_single_file(cls, path, torch_dtype=torch_dtype, config=config, upcast_fp8=upcast_fp8)
        return model.to(device) if device is not None else model

    def enable_cache(self, config) -> None:
        """diffusers' step caches (``CacheMixin.enable_cache``): ``FirstBlockCacheConfig``,
        ``TaylorSeerCacheConfig``, ``MagCacheConfig``; ``disable_cache()`` removes them. FasterCache and
        Pyramid Attention Broadcast are refused with the reason (see :mod:`krea2_diffusers.caching.registrations`)."""
        check_cache_config(config)
        super().enable_cache(config)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the residual stream: the image projection's (kept unquantized in every format)."""
        dtype = self.img_in.weight.dtype
        return dtype if dtype in _COMPUTE_DTYPES else torch.bfloat16

    @per_call_lora_scale
    def prepare_conditioning(
        self,
        encoder_hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        *,
        reference_hidden_states: torch.Tensor | None = None,
        key_bias: torch.Tensor | None = None,
        reference_attention: str = "joint",
        reference_method: str = "index_timestep_zero",
        attention_kwargs: dict[str, Any] | None = None,
    ) -> Krea2Conditioning:
        """Run the timestep-independent part of the forward once.

        Args:
            encoder_hidden_states: (B, L, num_text_layers, text_hidden_dim) tapped encoder states.
            position_ids: (L + N + R, 3) (t, h, w) RoPE coordinates of [text, image, references].
            encoder_attention_mask: (B, L) bool, True for real text tokens; None when all are real.
            reference_hidden_states: (B|1, R, in_channels) packed clean latents of style references,
                modulated per ``reference_method`` and placed after the image tokens (batch 1: shared by all rows).
            key_bias: (B, L + N + R) float additive bias on attention logits per key (e.g. log of a
                reference's strength), applied in every attention layer; its first L entries also in
                the text-fusion refiner.
            reference_attention: "joint": the references join the step's sequence and attend to
                every token. "cached": they attend only among themselves (with their part of
                ``key_bias``), so they are run through the blocks here, once, and every step's
                text and image tokens attend to their stored keys/values. Equal to a joint pass whose
                mask keeps reference queries on reference keys.
            reference_method: "index_timestep_zero": the references are modulated as timestep 0 (their
                own modulation, ComfyUI's native Krea 2 with ``ref_latents``); "index": with the step's
                timestep, like the image tokens (not cacheable: their keys/values change every step).
            attention_kwargs: ``{"scale": s}`` scales PEFT adapters for this call, as in :meth:`forward`: a
                pipeline passes the denoising steps' scale so that text fusion and cached references get it too.
        """
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must have shape (sequence_length, 3), got {tuple(position_ids.shape)}")
        check_reference_options(reference_attention, reference_method)
        batch, text_len = encoder_hidden_states.shape[:2]
        mask = None
        if encoder_attention_mask is not None:
            mask = encoder_attention_mask.to(device=encoder_hidden_states.device, dtype=torch.bool)
            if mask.shape != (batch, text_len):
                raise ValueError(f"encoder_attention_mask has shape {tuple(mask.shape)}, expected {(batch, text_len)}")
            if bool(mask.all()):
                mask = None  # no padding: let attention run unmasked (flash kernels)
        device = encoder_hidden_states.device
        seq_len = position_ids.shape[0]
        bias = None if mask is None else torch.cat([mask, mask.new_ones(batch, seq_len - text_len)], dim=1)
        if key_bias is not None:
            if key_bias.shape != (batch, seq_len):
                raise ValueError(f"key_bias has shape {tuple(key_bias.shape)}, expected {(batch, seq_len)}")
            key_bias = key_bias.to(device=device, dtype=torch.float32)
            bias = key_bias if bias is None else key_bias.masked_fill(~bias, float("-inf"))
        text_bias = None if key_bias is None else bias[:, :text_len]
        text = self.txt_in(self.text_fusion(encoder_hidden_states.to(self.compute_dtype), mask, text_bias))
        cos, sin = rope_tables(position_ids.to(device), self.config.axes_dims_rope, self.config.rope_theta)
        rope = (cos[None, :, None], sin[None, :, None])
        reference = reference_modulation = reference_kv = None
        if reference_hidden_states is not None and reference_hidden_states.shape[1]:
            dtype = self.compute_dtype
            if reference_hidden_states.shape[0] not in (1, batch):
                raise ValueError(f"reference_hidden_states has batch {reference_hidden_states.shape[0]}, expected 1 or {batch}")
            reference = self.img_in(reference_hidden_states.to(device=device, dtype=dtype))
            if reference_method == "index_timestep_zero":  # "index": None, the step's modulation applies
                zero = torch.zeros(reference.shape[0], device=device)
                reference_modulation = self._time_modulation(zero, dtype)[1]
            if reference_attention == "cached":
                reference_kv, rope = self._cache_references(reference, reference_modulation, rope, key_bias)
                reference = reference_modulation = None
        return Krea2Conditioning(text=text, attention_bias=bias, rope=rope, text_len=text_len, reference=reference,
                                 reference_modulation=reference_modulation, reference_kv=reference_kv)

    def _cache_references(self, reference, modulation, rope, key_bias):
        """Run the reference tokens (B|1, R, D) alone through every block (timestep-0 modulation,
        attending among themselves with their part of ``key_bias``) and keep each layer's rotated
        keys/values. Returns that list and the rope tables of the other tokens."""
        length = reference.shape[1]
        cos, sin = rope
        bias = None if key_bias is None else key_bias[:, -length:]
        if bias is not None and reference.shape[0] == 1:
            bias = bias[:1]  # the rows differ only in their text padding
        hidden, cache = reference, []
        for block in self.transformer_blocks:
            sink: list = []
            hidden = block(hidden, modulation, (cos[:, -length:], sin[:, -length:]), bias, kv_sink=sink)
            cache.append(sink[0])
        return cache, (cos[:, :-length], sin[:, :-length])

    def _time_modulation(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) t -> temb (B, D) and the shared block modulation (B, 1, 6, D)."""
        temb = self.time_embed(timestep, dtype)
        modulation = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        return temb, modulation.to(_modulation_dtype(dtype)).view(timestep.shape[0], 1, 6, -1)

    @per_call_lora_scale
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        timestep: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        *,
        conditioning: Krea2Conditioning | None = None,
        reference_hidden_states: torch.Tensor | None = None,
        key_bias: torch.Tensor | None = None,
        reference_attention: str = "joint",
        reference_method: str = "index_timestep_zero",
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Predict the flow velocity ``noise - x0`` of the image tokens.

        Args:
            hidden_states: (B, N, in_channels) packed noisy latents.
            encoder_hidden_states: (B, L, num_text_layers, text_hidden_dim); unused with ``conditioning``.
            timestep: (B,) or scalar, t in [0, 1] (1 = pure noise).
            position_ids: (L + N, 3) RoPE coordinates; unused with ``conditioning``.
            encoder_attention_mask: (B, L) bool, True for real text tokens.
            attention_kwargs: ``{"scale": s}`` scales PEFT LoRA adapters for this call.
            conditioning: the output of :meth:`prepare_conditioning`, reused across steps.
            reference_hidden_states, key_bias, reference_attention, reference_method: without ``conditioning``, passed
                to :meth:`prepare_conditioning` (style references in one call, as training needs);
                ``position_ids`` then covers [text, image, references].
        Returns:
            velocity (B, N, in_channels) as ``.sample`` (or a 1-tuple).
        """
        if conditioning is None:
            if encoder_hidden_states is None or position_ids is None:
                raise ValueError("pass encoder_hidden_states and position_ids, or a prepared `conditioning`")
            conditioning = self.prepare_conditioning(
                encoder_hidden_states, position_ids, encoder_attention_mask, reference_hidden_states=reference_hidden_states,
                key_bias=key_bias, reference_attention=reference_attention, reference_method=reference_method)
        elif reference_hidden_states is not None or key_bias is not None:
            raise ValueError("reference_hidden_states and key_bias go into prepare_conditioning; pass them or `conditioning`, not both")
        if timestep is None:
            raise ValueError("timestep is required")
        dtype = self.compute_dtype
        batch = hidden_states.shape[0]
        if conditioning.batch_size != batch:
            raise ValueError(f"conditioning has batch {conditioning.batch_size}, hidden_states has {batch}")
        timestep = timestep.reshape(-1).expand(batch) if timestep.numel() == 1 else timestep.reshape(batch)

        temb, time_modulation = self._time_modulation(timestep, dtype)
        parts = [conditioning.text.to(dtype), self.img_in(hidden_states.to(dtype))]
        if conditioning.reference is not None:
            parts.append(conditioning.reference.to(dtype).expand(batch, -1, -1))
        tokens = torch.cat(parts, dim=1)
        block_args = (time_modulation, conditioning.rope, conditioning.attention_bias,
                      conditioning.reference_modulation, conditioning.reference_len)
        cached = conditioning.reference_kv or [None] * len(self.transformer_blocks)
        if len(cached) != len(self.transformer_blocks):  # e.g. cache-dit runs its own wrapper in their place
            raise ValueError(f"reference_attention='cached' keeps keys/values for {len(cached)} blocks, but transformer_blocks "
                             f"holds {len(self.transformer_blocks)} modules (a block-list wrapper such as cache-dit's?): "
                             "use reference_attention='joint' with it")
        for block, reference_kv in zip(self.transformer_blocks, cached):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                tokens = self._gradient_checkpointing_func(block, tokens, *block_args, reference_kv)
            else:
                tokens = block(tokens, *block_args, reference_kv)

        image_end = conditioning.text_len + hidden_states.shape[1]
        output = self.final_layer(tokens[:, conditioning.text_len:image_end], temb)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)


# diffusers' cache hooks and cache-dit find our blocks' calling convention here (krea2_diffusers.caching).
register_block(Krea2Block, Krea2Transformer2DModel)
