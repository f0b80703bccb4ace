"""bitsandbytes NF4 and int8 storage computed on CPU in row chunks, bit-identical to bitsandbytes.

bitsandbytes quantizes a CPU matrix in one piece: NF4 through float32 copies of the whole matrix,
int8 through a float16 copy and float32 products (~13 bytes a weight of temporaries either way).
For the 12.8B transformer's largest matrices that is ~1.2 GiB on top of the streamed load, the
difference between fitting "quantized + 4 GiB" on a 24 GiB machine and not. Both schemes are
local (NF4: one absmax per 64 consecutive weights; int8: one scale per row), so quantizing chunk
by chunk with the same float expressions gives the same bytes with a few MiB of temporaries. The
NF4 statistics (1/64 of the weights) are then compressed by bitsandbytes itself, so the
``QuantState`` is the one bitsandbytes builds. CPU weights only: on other devices the layers keep
bitsandbytes' own kernels (quantization.bnb decides).
"""

from __future__ import annotations

import torch

NF4_BLOCKSIZE = 64  # bitsandbytes' default: one absmax per 64 weights
CHUNK_WEIGHTS = 1 << 21  # weights quantized at once: ~8 MiB of float32 temporaries


def _nf4_bounds() -> torch.Tensor:
    import bitsandbytes.functional as F

    code = F.get_4bit_type("nf4", device="cpu")
    return (code[:-1] + code[1:]) / 2  # the NF4 table is sorted: its midpoints are the thresholds


def quantize_nf4(weight: torch.Tensor):
    """``bitsandbytes.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
    quant_type="nf4")``, bit for bit, for a CPU ``weight`` (out, in) in bf16 / fp16 / fp32.

    Returns ``(packed (out*in/2, 1) uint8, QuantState)``. Per 64-weight block, bitsandbytes'
    kernel takes ``scaled = clamp(w * (1/absmax), -1, 1)`` and the code ``bucketize(scaled,
    midpoints)``; codes are packed two a byte, high nibble first. Sizes that are not a multiple
    of 128 (a padded tail block; none in Krea 2) go to bitsandbytes itself.
    """
    import bitsandbytes.functional as F

    n = weight.numel()
    if n % (2 * NF4_BLOCKSIZE):
        return F.quantize_4bit(weight, blocksize=NF4_BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    bounds = _nf4_bounds()
    flat = weight.contiguous().reshape(-1)
    packed = torch.empty(n // 2, dtype=torch.uint8)
    absmax = torch.empty(n // NF4_BLOCKSIZE, dtype=torch.float32)
    for start in range(0, n, CHUNK_WEIGHTS):
        chunk = flat[start:start + CHUNK_WEIGHTS].float().view(-1, NF4_BLOCKSIZE)
        amax = chunk.abs().amax(dim=-1)
        absmax[start // NF4_BLOCKSIZE:start // NF4_BLOCKSIZE + amax.numel()] = amax
        # The same expression as bitsandbytes, so that every float rounds the same way.
        scaled = torch.clamp(chunk * (1.0 / amax.clamp(min=1e-38).view(-1, 1)), -1, 1).view(-1)
        codes = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
        packed[start // 2:(start + codes.numel()) // 2] = (codes[::2] << 4) | codes[1::2]
    offset = absmax.mean()
    qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
    state = F.QuantState(absmax=qabsmax, shape=weight.shape, dtype=weight.dtype, blocksize=NF4_BLOCKSIZE,
                         code=F.get_4bit_type("nf4", device="cpu"), quant_type="nf4", offset=offset, state2=state2)
    return packed.unsqueeze(1), state


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``bitsandbytes.nn.Int8Params`` stores for ``weight`` (out, in): ``(CB (out, in) int8,
    SCB (out,) float32)`` = ``int8_vectorwise_quant(weight.half())``, row chunk by row chunk (CPU)."""
    import bitsandbytes.functional as F

    rows = max(1, CHUNK_WEIGHTS // weight.shape[1])
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        part, scale, _ = F.int8_vectorwise_quant(weight[start:start + rows].to(torch.float16))
        codes[start:start + rows] = part
        scales[start:start + rows] = scale
    return codes, scales
