"""Torch dequantization of GGML blocks, on whatever device the packed bytes live.

Each value is computed in float32 exactly as gguf-py's numpy reference computes it (the fp16
scales widened, ``d * sc`` and ``dmin * m`` per sub-block, then ``scale * q - min``: every product
is exact in float32, so the result equals the reference's to the bit) and rounded once to the
output dtype: a bf16 weight is the reference's float32 weight rounded to bf16. The earlier code
computed in bf16 (scales rounded to bf16, then each product and difference rounded again): 42% of
Q4_K's bf16 weights differed from the once-rounded value, by up to 1.2% of the largest weight.

Cost on the CPU (``bench/bench_dequant.py``: ``ours`` against ``before``, the code this replaced,
with each call's system time and page faults): the blocks are expanded a chunk of ~``CHUNK_VALUES``
values at a time into one reused float32 scratch buffer, written straight into the output. Whole-
matrix temporaries (the nibbles, their float copy, the scaled and the shifted values: ~8 bytes a
weight) were fresh memory at every call, and the kernel faulting those pages in (~200,000 faults
for one 16384 x 6144 matrix) took as long as the arithmetic; chunk-sized temporaries stay cached
by the allocator. Off the CPU the whole tensor is one chunk.

Each ``_blocks_*`` function takes ``(k, type_size)`` uint8 blocks and writes their
``(k, block_size)`` values into a float32 ``out``. The layouts follow ggml's ``block_q*`` structs
(little-endian fp16 scales first for the legacy types, last for Q6_K).
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
# Values expanded per pass on the CPU: a 1 MiB float32 scratch buffer (and ~0.1 MiB of uint8
# temporaries), small enough to stay in the cores' caches between the passes of a chunk; larger
# chunks measured no faster (bench/bench_dequant.py --chunk-sweep, one thread), and the loop's
# overhead is ~400 chunks of a 100M-value matrix. Off the CPU one chunk is the whole tensor.
CHUNK_VALUES = 1 << 18


def fp16_values(raw: torch.Tensor) -> torch.Tensor:
    """``(..., 2)`` uint8 little-endian halves -> ``(..., 1)`` float32 (exact)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles_into(out: torch.Tensor, packed: torch.Tensor) -> None:
    """``packed`` ``(..., k)`` uint8 -> ``out`` ``(..., 2, k)`` float32: low nibbles, then high ones."""
    out.select(-2, 0).copy_(packed & NIBBLE)
    out.select(-2, 1).copy_(packed >> 4)


def split_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``(n, ...)`` uint8 -> ``(n, 2, ...)`` uint8: low nibbles then high nibbles."""
    return torch.stack((packed & NIBBLE, packed >> 4), dim=1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` uint8 -> ``(n, k * 8)`` 0/1 values, bit ``j`` of byte ``i`` at ``8 * i + j``."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _blocks_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, FP16_BYTES:].view(torch.int8), fp16_values(b[:, :FP16_BYTES]), out=out)


def _blocks_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _nibbles_into(out.view(-1, 2, LEGACY_BLOCK // 2), b[:, FP16_BYTES:])
    out.sub_(8).mul_(fp16_values(b[:, :FP16_BYTES]))


def _blocks_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _nibbles_into(out.view(-1, 2, LEGACY_BLOCK // 2), b[:, 4:])
    out.mul_(fp16_values(b[:, 0:2])).add_(fp16_values(b[:, 2:4]))


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values of a legacy block (uint8): low 4 bits from ``qs`` nibbles, 5th bit from ``qh``."""
    return split_nibbles(qs).flatten(1) | (_bits(qh) << 4)


def _blocks_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_values(b[:, 2:6], b[:, 6:]))
    out.sub_(16).mul_(fp16_values(b[:, 0:2]))


def _blocks_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_values(b[:, 4:8], b[:, 8:]))
    out.mul_(fp16_values(b[:, 0:2])).add_(fp16_values(b[:, 2:4]))


def k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 scale bytes ``(n, 12, ...)`` -> two ``(n, 8, ...)`` uint8 tensors of
    6-bit numbers (the bytes along dim 1: rows of blocks, or byte planes over many blocks).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    lo_sc, lo_mn, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & SIX_BITS, (mixed & NIBBLE) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_mn & SIX_BITS, (mixed >> 4) | ((lo_mn >> 6) << 4)), dim=1)
    return sc, mn


def _k_affine_(b: torch.Tensor, out: torch.Tensor) -> None:
    """Shared tail of Q4_K/Q5_K, in place on ``out`` holding the integers: ``d * sc * q - dmin * m``
    per 32-value sub-block (both products exact in float32, one rounding in the difference)."""
    sc, mn = k_scales_mins(b[:, 4 : 4 + K_SCALES_BYTES])
    scale = (fp16_values(b[:, 0:2]) * sc).unsqueeze(-1)
    offset = (fp16_values(b[:, 2:4]) * mn).unsqueeze(-1)
    out.view(-1, K_SUBBLOCKS, QK_K // K_SUBBLOCKS).mul_(scale).sub_(offset)


def _blocks_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # 4 chunks of 32 bytes, 2 sub-blocks each: sub-block 2c holds chunk c's low nibbles, 2c + 1 its high ones
    _nibbles_into(out.view(-1, 4, 2, 32), b[:, 4 + K_SCALES_BYTES :].reshape(-1, 4, 32))
    _k_affine_(b, out)


def _blocks_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    start = 4 + K_SCALES_BYTES
    qh = b[:, start : start + 32]
    qs = b[:, start + 32 :].reshape(-1, 4, 32)
    low = torch.stack((qs & NIBBLE, qs >> 4), dim=2).reshape(-1, K_SUBBLOCKS, 32)
    shifts = torch.arange(K_SUBBLOCKS, device=b.device, dtype=torch.uint8).view(1, -1, 1)
    high = (qh.unsqueeze(1) >> shifts) & 1  # bit i of qh[j] is the 5th bit of sub-block i, value j
    out.view(-1, K_SUBBLOCKS, 32).copy_(low | (high << 4))
    _k_affine_(b, out)


def _blocks_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    ql = b[:, :128].reshape(-1, 2, 64)  # two halves of 128 values
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8)
    low = torch.stack((ql & NIBBLE, ql >> 4), dim=2).reshape(-1, 2, 128)  # value p of a half: nibble p // 64
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, -1, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 3).reshape(-1, 2, 128)  # value p: bits 2 * (p // 32)
    out.view(-1, 2, 128).copy_(low | (high << 4))
    scale = (fp16_values(b[:, 208:210]) * scales).unsqueeze(-1)  # d * scale: exact in float32
    out.view(-1, Q6K_SUBBLOCKS, QK_K // Q6K_SUBBLOCKS).sub_(32).mul_(scale)


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
            ``(out, row_bytes)`` weight of a packed linear, or a slice of its rows.
        qtype: the GGML type of the bytes.
        shape: logical shape of the result (its element count must match the blocks).
        dtype: result dtype; values are computed in float32 and rounded once to it.
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
    n_blocks = blocks.shape[0]
    result = torch.empty((n_blocks, block_size), dtype=dtype, device=packed.device)
    step = max(1, CHUNK_VALUES // block_size) if packed.device.type == "cpu" else max(1, n_blocks)
    scratch = None if dtype == torch.float32 else torch.empty((min(step, n_blocks), block_size), device=packed.device)
    for start in range(0, n_blocks, step):
        part = blocks[start : start + step]
        if scratch is None:  # float32 out: written in place
            fn(part, result[start : start + step])
        else:
            values = scratch[: part.shape[0]]
            fn(part, values)
            result[start : start + step].copy_(values)  # the one rounding
    return result.reshape(shape)
