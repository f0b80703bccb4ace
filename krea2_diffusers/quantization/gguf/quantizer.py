"""Numpy quantizers: float rows -> GGML block bytes.

The legacy types (Q8_0, Q4_0, ...) use gguf-py's own quantizers, which match ggml's reference.
gguf-py has none for the K-quants, so Q4_K, Q5_K and Q6_K are written here: a plain
min/max (or abs-max) fit per sub-block, scales quantized to the block's shared fp16 factor.
This is not ggml's error-minimising search (``make_qkx2_quants``), so the error is a little
larger than llama.cpp's files at the same type, but the blocks are valid and decode with any
GGML reader.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from .qtypes import block_geometry

Q = GGMLQuantizationType

QK_K = 256
SUB = 32  # Q4_K / Q5_K sub-block length
SCALE_MAX = 63  # Q4_K / Q5_K sub-block scales and mins are 6-bit
Q6_SUB = 16  # Q6_K sub-block length
Q6_SCALE_MAX = 127  # Q6_K sub-block scales are int8
Q6_LEVEL_MIN, Q6_LEVEL_MAX = -32, 31  # Q6_K values are 6-bit signed (stored +32)
ROWS_PER_CHUNK = 1024  # bounds the float32 temporaries for very large weights


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round to fp16; return ``(bytes (n, 2), value as float32 (n, 1))``."""
    half = x.astype(np.float16).reshape(-1, 1)
    return half.view(np.uint8), half.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b`` with 0 where ``b`` is 0 (an all-zero sub-block)."""
    out = np.zeros(np.broadcast(a, b).shape, dtype=np.float32)
    np.divide(a, b, out=out, where=b != 0)
    return out


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Two ``(n, 8)`` 6-bit arrays -> ``(n, 12)`` bytes (inverse of ggml's ``get_scale_min_k4``)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate((first, second, third), axis=1)


def _fit_k_affine(x: np.ndarray, levels: int):
    """Fit ``x ~ d*sc*q - dmin*m`` for ``(n, 8, 32)`` values with ``q`` in ``[0, levels]``.

    Returns ``(d bytes, dmin bytes, packed scales (n, 12), q (n, 8, 32) uint8)``.
    """
    lo = np.minimum(x.min(axis=-1), 0.0)  # ggml keeps the offset non-negative
    hi = x.max(axis=-1)
    offset = -lo
    step = (hi - lo) / levels
    d_bytes, d = _f16(step.max(axis=-1) / SCALE_MAX)
    dmin_bytes, dmin = _f16(offset.max(axis=-1) / SCALE_MAX)
    mn = np.clip(np.rint(_safe_div(offset, dmin)), 0, SCALE_MAX)
    eff_offset = dmin * mn
    # ceil so the quantized range still reaches the sub-block's maximum
    sc = np.clip(np.ceil(_safe_div(hi + eff_offset, d * levels)), 0, SCALE_MAX)
    eff_step = d * sc
    q = np.clip(np.rint(_safe_div(x + eff_offset[..., None], eff_step[..., None])), 0, levels).astype(np.uint8)
    return d_bytes, dmin_bytes, _pack_k_scales(sc, mn), q


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(-1, QK_K // SUB, SUB)
    d, dmin, scales, q = _fit_k_affine(x, levels=15)
    q = q.reshape(-1, 4, 2, SUB)  # chunk c holds sub-blocks 2c (low nibble) and 2c+1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, QK_K // 2)
    return np.concatenate((d, dmin, scales, qs), axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(-1, QK_K // SUB, SUB)
    d, dmin, scales, q = _fit_k_affine(x, levels=31)
    low = (q & 0x0F).reshape(-1, 4, 2, SUB)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, QK_K // 2)
    high = (q >> 4) & 1  # (n, 8, 32): bit i of qh[j] is sub-block i, value j
    qh = np.zeros((q.shape[0], SUB), dtype=np.uint8)
    for i in range(QK_K // SUB):
        qh |= high[:, i] << i
    return np.concatenate((d, dmin, scales, qh, qs), axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    x = blocks.reshape(-1, QK_K // Q6_SUB, Q6_SUB)
    step = np.abs(x).max(axis=-1) / Q6_LEVEL_MAX
    d_bytes, d = _f16(step.max(axis=-1) / Q6_SCALE_MAX)
    sc = np.clip(np.ceil(_safe_div(step, d)), 0, Q6_SCALE_MAX)
    eff = (d * sc)[..., None]
    q = np.clip(np.rint(_safe_div(x, eff)), Q6_LEVEL_MIN, Q6_LEVEL_MAX) - Q6_LEVEL_MIN
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # half h, quarter k (64 + 64 split below), 32 values
    # value p of a half: low nibble in byte p % 64 (shift 4 * (p // 64)), top 2 bits in byte p % 32 (shift 2 * (p // 32))
    low = q & 0x0F
    ql = (low[:, :, 0:2].reshape(-1, 2, 64) | (low[:, :, 2:4].reshape(-1, 2, 64) << 4)).reshape(-1, QK_K // 2)
    top = q >> 4
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, QK_K // 4)
    return np.concatenate((ql, qh, sc.astype(np.int8).view(np.uint8), d_bytes), axis=1)


_OWN = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize a float array row by row.

    Args:
        values: ``(..., n)`` float; ``n`` must be a multiple of the type's block size.
        qtype: target GGML type.
    Returns:
        uint8 ``(..., n // block_size * type_size)``.
    """
    block_size, type_size = block_geometry(qtype)
    values = np.asarray(values, dtype=np.float32)
    if values.shape[-1] % block_size:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_size} values, got {values.shape[-1]}")
    if not np.isfinite(values).all():
        raise ValueError(f"cannot quantize to {qtype.name}: the tensor holds NaN or infinite values")
    rows = values.reshape(-1, values.shape[-1])
    out_shape = (*values.shape[:-1], values.shape[-1] // block_size * type_size)
    fn = _OWN.get(qtype)
    if fn is None:
        return gguf_quants.quantize(values, qtype).reshape(out_shape)
    chunks = [
        fn(rows[i : i + ROWS_PER_CHUNK].reshape(-1, block_size)).reshape(-1, out_shape[-1])
        for i in range(0, rows.shape[0], ROWS_PER_CHUNK)
    ]
    return np.concatenate(chunks, axis=0).reshape(out_shape)
