"""Torch dequantization of GGML blocks, on whatever device the packed bytes live.

Each ``_blocks_*`` function takes ``(n_blocks, type_size)`` uint8 and returns
``(n_blocks, block_size)`` values in ``dtype``. The layouts follow ggml's ``block_q*``
structs (little-endian fp16 scales first for the legacy types, last for Q6_K). The math is
done in ``dtype`` directly so that a bf16 model never materialises an fp32 copy of a weight.
"""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from .qtypes import block_geometry

Q = GGMLQuantizationType

QK_K = 256  # values per K-quant super-block
K_SUBBLOCKS = 8  # Q4_K / Q5_K: 8 sub-blocks of 32 values, each with a 6-bit scale and min
K_SCALES_BYTES = 12  # the 8 + 8 six-bit numbers packed into 12 bytes
Q6K_SUBBLOCKS = 16  # Q6_K: 16 sub-blocks of 16 values, each with an int8 scale
LEGACY_BLOCK = 32  # Q4_0 .. Q8_0 block size
FP16_BYTES = 2
NIBBLE = 0x0F
SIX_BITS = 0x3F


def _fp16(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(n, 2)`` uint8 little-endian halves -> ``(n, 1)`` values in ``dtype``."""
    return raw.contiguous().view(torch.float16).to(dtype)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` uint8 -> ``(n, 2, k)``: low nibbles then high nibbles."""
    return torch.stack((packed & NIBBLE, packed >> 4), dim=1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` uint8 -> ``(n, k * 8)`` 0/1 values, bit ``j`` of byte ``i`` at ``8 * i + j``."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _blocks_q8_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _fp16(b[:, :FP16_BYTES], dtype)
    q = b[:, FP16_BYTES:].view(torch.int8)  # same element size: a strided view, no copy
    return q.to(dtype).mul_(d)


def _blocks_q4_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _fp16(b[:, :FP16_BYTES], dtype)
    q = _nibbles(b[:, FP16_BYTES:]).flatten(1).to(dtype) - 8
    return d * q


def _blocks_q4_1(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d, m = _fp16(b[:, 0:2], dtype), _fp16(b[:, 2:4], dtype)
    q = _nibbles(b[:, 4:]).flatten(1).to(dtype)
    return d * q + m


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values of a legacy block: low 4 bits from ``qs`` nibbles, 5th bit from ``qh``."""
    return _nibbles(qs).flatten(1) | (_bits(qh) << 4)


def _blocks_q5_0(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = _fp16(b[:, 0:2], dtype)
    q = _q5_values(b[:, 2:6], b[:, 6:]).to(dtype) - 16
    return d * q


def _blocks_q5_1(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d, m = _fp16(b[:, 0:2], dtype), _fp16(b[:, 2:4], dtype)
    q = _q5_values(b[:, 4:8], b[:, 8:]).to(dtype)
    return d * q + m


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 scale bytes -> two ``(n, 8)`` uint8 tensors of 6-bit numbers.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    lo_sc, lo_mn, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & SIX_BITS, (mixed & NIBBLE) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_mn & SIX_BITS, (mixed >> 4) | ((lo_mn >> 6) << 4)), dim=1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Shared tail of Q4_K/Q5_K: ``d * sc * q - dmin * m`` per 32-value sub-block."""
    d, dmin = _fp16(b[:, 0:2], dtype), _fp16(b[:, 2:4], dtype)
    sc, mn = _k_scales_mins(b[:, 4 : 4 + K_SCALES_BYTES])
    scale = (d * sc.to(dtype)).unsqueeze(-1)
    offset = (dmin * mn.to(dtype)).unsqueeze(-1)
    return (scale * q.view(-1, K_SUBBLOCKS, QK_K // K_SUBBLOCKS).to(dtype) - offset).flatten(1)


def _blocks_q4_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    qs = b[:, 4 + K_SCALES_BYTES :].reshape(-1, 4, 32)  # 4 chunks of 32 bytes, 2 sub-blocks each
    q = torch.stack((qs & NIBBLE, qs >> 4), dim=2)  # (n, chunk, nibble, 32) -> sub-block 2c + nibble
    return _k_affine(b, q, dtype)


def _blocks_q5_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    start = 4 + K_SCALES_BYTES
    qh = b[:, start : start + 32]
    qs = b[:, start + 32 :].reshape(-1, 4, 32)
    low = torch.stack((qs & NIBBLE, qs >> 4), dim=2).reshape(-1, K_SUBBLOCKS, 32)
    shifts = torch.arange(K_SUBBLOCKS, device=b.device, dtype=torch.uint8).view(1, -1, 1)
    high = (qh.unsqueeze(1) >> shifts) & 1  # bit i of qh[j] is the 5th bit of sub-block i, value j
    return _k_affine(b, low | (high << 4), dtype)


def _blocks_q6_k(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 64)  # two halves of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(dtype)
    d = _fp16(b[:, 208:210], dtype)
    low = torch.stack((ql & NIBBLE, ql >> 4), dim=2).reshape(-1, 2, 128)  # value p of a half: nibble p // 64
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, -1, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 3).reshape(-1, 2, 128)  # value p: bits 2 * (p // 32)
    q = (low | (high << 4)).to(dtype).reshape(-1, Q6K_SUBBLOCKS, QK_K // Q6K_SUBBLOCKS) - 32
    return ((d * scales).unsqueeze(-1) * q).flatten(1)


_BLOCK_DEQUANTIZERS = {
    Q.Q8_0: _blocks_q8_0,
    Q.Q4_0: _blocks_q4_0,
    Q.Q4_1: _blocks_q4_1,
    Q.Q5_0: _blocks_q5_0,
    Q.Q5_1: _blocks_q5_1,
    Q.Q4_K: _blocks_q4_k,
    Q.Q5_K: _blocks_q5_k,
    Q.Q6_K: _blocks_q6_k,
}


def dequantize(packed: torch.Tensor, qtype: GGMLQuantizationType, shape, dtype=torch.float32) -> torch.Tensor:
    """Expand packed GGML bytes into a float tensor.

    Args:
        packed: uint8, any shape whose bytes are whole blocks in row-major order, e.g. the
            ``(out, row_bytes)`` weight of a packed linear.
        qtype: the GGML type of the bytes.
        shape: logical shape of the result (its element count must match the blocks).
        dtype: result dtype; the arithmetic is done in it.
    Returns:
        tensor of ``shape`` and ``dtype`` on ``packed.device``.
    """
    if qtype == Q.F32:
        return packed.contiguous().view(torch.float32).to(dtype).reshape(shape)
    if qtype == Q.F16:
        return packed.contiguous().view(torch.float16).to(dtype).reshape(shape)
    if qtype == Q.BF16:
        return packed.contiguous().view(torch.bfloat16).to(dtype).reshape(shape)
    fn = _BLOCK_DEQUANTIZERS.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no torch dequantizer for GGML type {qtype.name}")
    block_size, type_size = block_geometry(qtype)
    if packed.numel() % type_size:
        raise ValueError(f"{qtype.name}: {packed.numel()} bytes is not a whole number of {type_size}-byte blocks")
    n_values = packed.numel() // type_size * block_size
    if n_values != math.prod(shape):
        raise ValueError(f"{qtype.name}: bytes hold {n_values} values but shape {tuple(shape)} needs {math.prod(shape)}")
    blocks = packed.reshape(-1, type_size)
    return fn(blocks, dtype).reshape(shape)
