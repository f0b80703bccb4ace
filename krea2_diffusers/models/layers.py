"""Building blocks of the Krea 2 transformer: zero-centred RMSNorm, gated GQA attention,
SwiGLU, 3-axis RoPE and the timestep embedding.

Module and parameter names follow the diffusers layout (``to_q``, ``norm_q``, ``ff.gate`` ...)
so that diffusers-format weights and PEFT LoRAs address the same tensors.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

# The timestep t in [0, 1] is scaled to the [0, 1000] range the sinusoid was trained on.
TIMESTEP_SCALE = 1000.0
# Period of the slowest sinusoid of the timestep embedding.
TIMESTEP_MAX_PERIOD = 10000.0


def swiglu_hidden_size(dim: int, multiple_of: int = 128) -> int:
    """SwiGLU width rule of the released model: ``int(2*dim/3) * 4`` rounded up to ``multiple_of``."""
    hidden = int(2 * dim / 3) * 4
    return multiple_of * math.ceil(hidden / multiple_of)


def rope_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """Split of the head dim over the (t, h, w) RoPE axes, e.g. 128 -> (32, 48, 48)."""
    unit = head_dim // 16
    return (head_dim - 12 * unit, 6 * unit, 6 * unit)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)``, computed in float32 and cast back.

    The weight is stored in float32 (it starts at 0, so bf16 would waste its precision).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Statistics in float32; the scale itself is applied at (at least) float32 precision.
        scale = 1.0 + self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))
        if torch.compiler.is_compiling():  # traced: nothing warns, and catch_warnings would split the graph
            return F.rms_norm(hidden_states.float(), scale.shape, weight=scale, eps=self.eps).to(hidden_states.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            normed = F.rms_norm(hidden_states.float(), scale.shape, weight=scale, eps=self.eps)
        return normed.to(hidden_states.dtype)


def rope_tables(position_ids: torch.Tensor, axes_dims, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for interleaved-pair RoPE.

    Args:
        position_ids: (S, 3) or (B, S, 3) integer-valued (t, h, w) coordinates.
    Returns:
        cos, sin: float32, (..., S, head_dim), each frequency repeated for its (2i, 2i+1) pair.
    """
    pos = position_ids.to(torch.float64)
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        # Angles in float64: positions up to a few hundred times frequencies near 1 lose digits in float32.
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
        angles = pos[..., axis, None] * inv_freq
        cos_parts.append(angles.cos().repeat_interleave(2, dim=-1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=-1))
    return torch.cat(cos_parts, -1).float(), torch.cat(sin_parts, -1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of ``x`` (B, S, H, hd) by the angles in ``cos``/``sin`` (B|1, S, 1, hd)."""
    x32 = x.float()
    pairs = x32.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x32 * cos + rotated * sin).to(x.dtype)


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_bias: torch.Tensor | None
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, without copying K/V per group.

    Query heads that share a key/value head are folded into the sequence axis, so every SDPA
    kernel (flash, memory-efficient, math) sees plain multi-head attention with ``num_kv_heads``
    heads. This works because the bias depends on the key only (padding / per-reference weights).

    Args:
        query: (B, S, H, hd); key, value: (B, S_k, H_kv, hd).
        attention_bias: None, bool (B, S_k) keep-mask, or float (B, S_k) additive bias.
    Returns:
        (B, S, H * hd)
    """
    batch, seq, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    # (B, S, H_kv, G, hd) -> (B, H_kv, G*S, hd): head h uses kv head h // G.
    q = query.view(batch, seq, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * seq, head_dim)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    mask = None if attention_bias is None else attention_bias[:, None, None, :]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # (B, H_kv, G*S, hd) -> (B, S, H*hd)
    return out.view(batch, kv_heads, groups, seq, head_dim).permute(0, 3, 1, 2, 4).reshape(batch, seq, heads * head_dim)


class Attention(nn.Module):
    """Self-attention: GQA projections, per-head QK RMSNorm, optional RoPE, sigmoid output gate."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"dim={dim}, num_heads={num_heads}, num_kv_heads={num_kv_heads} do not divide")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        self.to_q = nn.Linear(dim, self.head_dim * num_heads, bias=False)
        self.to_k = nn.Linear(dim, self.head_dim * num_kv_heads, bias=False)
        self.to_v = nn.Linear(dim, self.head_dim * num_kv_heads, bias=False)
        self.to_gate = nn.Linear(dim, dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        # A list so the output projection is saved as `to_out.0.*`, the diffusers name.
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: list | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, S, D) -> (B, S, D). ``rope`` = (cos, sin), each (B|1, S, 1, hd).

        ``extra_kv``: keys and values (B, S_x, H_kv, hd), rotated, appended after this sequence's own
        (cached reference tokens); ``attention_bias`` then covers S + S_x keys. ``kv_sink``: a list
        that receives this call's own (key, value).
        """
        query = self.norm_q(self.to_q(hidden_states).unflatten(-1, (self.num_heads, self.head_dim)))
        key = self.norm_k(self.to_k(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        value = self.to_v(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if rope is not None:
            query = apply_rope(query, *rope)
            key = apply_rope(key, *rope)
        if kv_sink is not None:
            kv_sink.append((key, value))
        if extra_kv is not None:
            key = torch.cat([key, extra_kv[0].expand(key.shape[0], -1, -1, -1).to(key.dtype)], dim=1)
            value = torch.cat([value, extra_kv[1].expand(value.shape[0], -1, -1, -1).to(value.dtype)], dim=1)
        out = grouped_attention(query, key, value, attention_bias)
        out = out * torch.sigmoid(self.to_gate(hidden_states))
        return self.to_out[0](out)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden_dim, bias=False)
        self.up = nn.Linear(dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(hidden_states)) * self.up(hidden_states))


class PlainBlock(nn.Module):
    """Pre-norm attention + SwiGLU block without RoPE or modulation (text fusion)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, hidden_dim: int, eps: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, eps)
        self.ff = SwiGLU(dim, hidden_dim)

    def forward(self, hidden_states: torch.Tensor, attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), attention_bias)
        return hidden_states + self.ff(self.norm2(hidden_states))


class TimestepEmbedding(nn.Module):
    """t in [0, 1] -> sinusoid (cos half first) -> Linear -> GELU(tanh) -> Linear: (B,) -> (B, D) in ``dtype``."""

    def __init__(self, embed_dim: int, dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.linear_1 = nn.Linear(embed_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.embed_dim // 2
        exponent = torch.arange(half, dtype=torch.float32, device=timestep.device) / half
        freqs = torch.exp(-math.log(TIMESTEP_MAX_PERIOD) * exponent)
        args = (timestep.float() * TIMESTEP_SCALE)[:, None] * freqs
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(dtype)
        return self.linear_2(F.gelu(self.linear_1(emb), approximate="tanh"))
