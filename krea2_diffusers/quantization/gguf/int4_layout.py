"""Q4_0, Q4_1 and Q4_K weights re-laid out for torch's CPU int4 matmul, and back.

Expanding a GGML weight in torch costs ~1.8 ns a weight with 2 threads (elementwise ops on small
integer types), so a 4-bit layer at 128 px spent ~80% of its forward expanding (issue 42). PyTorch
ships a fused kernel for 4-bit weights with a scale and a zero per group of 32 values
(``aten._weight_int4pack_mm_for_cpu``, the one torchao's int4 weight-only layout runs): it
expands each weight in registers inside the matmul and never writes the expanded matrix. All
three types are that form, per group of 32 values of a row (``q`` the 4-bit integer):

- Q4_0: ``w = d * (q - 8)``: scale ``d``, zero 0;
- Q4_1: ``w = d * q + m``: scale ``d``, zero ``8 d + m``;
- Q4_K: ``w = (d sc) q - (dmin mn)``: scale ``d sc``, zero ``8 d sc - dmin mn``;

as the kernel computes ``w = scale * (q - 8) + zero``. The kernel takes bf16 activations, scales
and zeros, so each group's scale and zero are rounded to bf16 once (computed in float32 from the
block's fp16 factors, exactly as :mod:`.dequant` does) and every product is summed in float32.
Measured on a 16384 x 6144 Q4_K layer (``bench/bench_int4.py``, 64-1024 rows): the
output's error against float64 is 1.04x the bf16 ``F.linear``'s on the once-rounded weights.

The layout holds the same bytes as the GGML blocks, rearranged: the 4-bit values in torch's
order (rows in blocks of 64, value ``(64 b + j, k)`` in byte ``(b, k, j % 32)``, low nibble for
``j < 32``; ``tests/test_gguf_int4_layout.py`` checks it against ``_convert_weight_to_int4pack_for_cpu``)
and each block's header (its fp16 factors and packed scales) as stored. So nothing is lost:
:func:`ggml_rows` rebuilds the GGML bytes of any 64-row slice, bit for bit, for every path the
kernel does not take (float32, gradients, other devices).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .dequant import k_scales_mins, split_nibbles
from .qtypes import block_geometry

Q = GGMLQuantizationType

GROUP = 32  # values per scale and zero, for all three types
ROW_BLOCK = 64  # rows per block of torch's CPU int4 layout
HALF_ROWS = ROW_BLOCK // 2  # rows j < 32 of a block take the low nibble
HEAD_BYTES = {Q.Q4_0: 2, Q.Q4_1: 4, Q.Q4_K: 16}  # bytes before a block's nibbles
CHUNK_BYTES = {Q.Q4_0: 16, Q.Q4_1: 16, Q.Q4_K: 32}  # a chunk's low nibbles are one group, its high the next
LEVEL_MID = 8  # the kernel's implicit offset: w = scale * (q - 8) + zero


def supported(qtype: GGMLQuantizationType, out_features: int, in_features: int) -> bool:
    """Whether a packed ``(out_features, in_features)`` weight of ``qtype`` has the int4 layout."""
    return qtype in HEAD_BYTES and out_features % ROW_BLOCK == 0 and in_features % block_geometry(qtype)[0] == 0


def _split(packed: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML rows ``(n, row_bytes)`` -> ``(heads (n, blocks, head), values (n, in_features) uint8)``."""
    block_size, type_size = block_geometry(qtype)
    head, chunk = HEAD_BYTES[qtype], CHUNK_BYTES[qtype]
    blocks = packed.reshape(packed.shape[0], in_features // block_size, type_size)
    values = split_nibbles(blocks[..., head:].reshape(-1, chunk))  # (n * chunks, 2, chunk)
    return blocks[..., :head], values.reshape(packed.shape[0], in_features)


def to_int4_layout(packed: torch.Tensor, qtype: GGMLQuantizationType, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML rows ``(n, row_bytes)`` uint8, ``n`` a multiple of 64 -> ``(nibbles (n, in_features // 2),
    heads (n, row_bytes - in_features // 2))`` uint8: the same bytes in the kernel's order."""
    heads, values = _split(packed, qtype, in_features)
    v = values.view(-1, 2, HALF_ROWS, in_features)  # (row blocks, low/high half, 32, in)
    nibbles = (v[:, 0] | (v[:, 1] << 4)).transpose(1, 2).contiguous()  # (row blocks, in, 32)
    return nibbles.view(packed.shape[0], in_features // 2), heads.reshape(packed.shape[0], -1).contiguous()


def ggml_rows(nibbles: torch.Tensor, heads: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
              rows: slice) -> torch.Tensor:
    """Rows ``rows`` (64-row aligned) of the GGML bytes, ``(len(rows), row_bytes)`` uint8, on the layout's device."""
    start, stop = rows.start // ROW_BLOCK, -(-min(rows.stop, nibbles.shape[0]) // ROW_BLOCK)
    packed = nibbles.view(-1, in_features, HALF_ROWS)[start:stop].transpose(1, 2)  # (row blocks, 32, in)
    values = split_nibbles(packed).reshape(-1, in_features)  # (row blocks, low/high, 32, in)
    block_size, type_size = block_geometry(qtype)
    head, chunk = HEAD_BYTES[qtype], CHUNK_BYTES[qtype]
    n = values.shape[0]
    v = values.view(n, -1, 2, chunk)
    out = torch.empty((n, in_features // block_size, type_size), dtype=torch.uint8, device=nibbles.device)
    out[..., :head] = heads[start * ROW_BLOCK : start * ROW_BLOCK + n].view(n, -1, head)
    out[..., head:] = (v[:, :, 0] | (v[:, :, 1] << 4)).view(n, in_features // block_size, -1)
    return out.view(n, -1)


def _fp16_planes(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two uint8 planes (an fp16's little-endian bytes) -> the values in float32 (exact)."""
    return (low.to(torch.int16) | (high.to(torch.int16) << 8)).view(torch.float16).float()


def scales_and_zeros(heads: torch.Tensor, qtype: GGMLQuantizationType, in_features: int,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel's ``(in_features // 32, n, 2)`` table of each group's (scale, zero), from the
    block heads ``(n, head bytes)``: computed in float32 as :mod:`.dequant` does, rounded once.

    Computed at every kernel call (cached, the table would add 4 bytes a group to the 2.25 the
    weight holds), so it is built in the table's own order: the heads are first turned into byte
    planes ``(blocks, head, n)``, each one contiguous over the rows, and every step after that
    writes its result where the table wants it. Computed row-major and transposed at the end, the
    copies took about half of the time: a 16384 x 6144 Q4_K layer's table 30-48 -> 18-25 ms, 2
    threads; all 256 of the full-size model's Q4_K layers 7.2 -> 4.2 s a step (the same bits)."""
    n = heads.shape[0]
    h = heads.view(n, -1, HEAD_BYTES[qtype]).permute(1, 2, 0).contiguous()  # (blocks, head, n)
    d = _fp16_planes(h[:, 0], h[:, 1])  # (blocks, n)
    if qtype == Q.Q4_0:
        scale, zero = d, torch.zeros_like(d)
    elif qtype == Q.Q4_1:
        scale, zero = d, LEVEL_MID * d + _fp16_planes(h[:, 2], h[:, 3])
    else:
        sc, mn = k_scales_mins(h[:, 4:16])  # (blocks, 8, n) each: the groups in order
        scale = d.unsqueeze(1) * sc  # d * sc, exact in float32
        # 8 * scale exact, dmin * mn exact, one rounding in the difference (as the expression before)
        zero = torch.addcmul(LEVEL_MID * scale, _fp16_planes(h[:, 2], h[:, 3]).unsqueeze(1), mn, value=-1)
    return torch.stack((scale.to(dtype), zero.to(dtype)), dim=-1).view(-1, n, 2)


def int4_matmul(x: torch.Tensor, nibbles: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x (..., in)`` bf16 on the CPU -> ``(..., out)``: ``x @ W.T`` by torch's fused int4 kernel."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, nibbles, GROUP, table)
    return out.view(*x.shape[:-1], nibbles.shape[0])


# Rows a call above which a CPU with bf16 matmul units expands instead: expanding a 16384 x 6144
# Q4_K matrix costs ~0.23 s whatever the rows, then the bf16 matmul runs at ~0.45-1 TFLOPS there,
# while this kernel computes in float32 FMAs (~0.13 TFLOPS measured on an AVX512 CPU without bf16
# units, 2 threads): the two meet near 170 rows. Without bf16 units the bf16 matmul is emulated
# and the kernel was faster at every size measured (128-1024 rows).
NATIVE_BF16_MAX_ROWS = 128


@torch.compiler.assume_constant_result
def row_limit() -> int | None:
    """Most rows a call for the kernel on this CPU (None: no limit). A constant to ``torch.compile``:
    traced, its /proc/cpuinfo read broke the graph at every 4-bit layer (``--compile``)."""
    from ...precision import cpu_has_bf16

    return NATIVE_BF16_MAX_ROWS if cpu_has_bf16() else None
