"""bitsandbytes' LLM.int8 layer, training on the CPU in output-row chunks.

Imported only once bitsandbytes is known to be importable (:mod:`.bnb` checks it first).
"""

from __future__ import annotations

from functools import partial

import bitsandbytes as bnb
import torch

from .chunked_linear import chunked_linear


def _int8_rows(codes: torch.Tensor, scales: torch.Tensor, rows: slice, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Rows ``rows`` of ``codes * scales / 127``, (len(rows), in) in ``dtype``: the expression of
    bitsandbytes' CPU training matmul (``MatMul8bitFp``) on a slice, so every element is the same."""
    return codes[rows].to(device=device, dtype=dtype).mul_(scales[rows].to(device).unsqueeze(1).mul(1.0 / 127.0))


class Int8Linear(bnb.nn.Linear8bitLt):
    """``bnb.nn.Linear8bitLt`` (so PEFT wraps it as one) whose training forward on the CPU computes
    in output-row chunks (:mod:`.chunked_linear`). bitsandbytes' own CPU training path dequantizes
    the whole matrix to float32 at each call, forward and backward: 0.56 GiB for the 12.8B model's
    largest, which took a full-size int8 LoRA run over "quantized + 4 GiB". Inference and GPUs
    keep bitsandbytes' kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        if not (self.training and x.device.type == "cpu"):
            return super().forward(x)
        self.state.is_training = True
        if self.weight.CB is not None:  # bitsandbytes moves the codes and scales into its state first
            self.init_8bit_state()
        rows = partial(_int8_rows, self.state.CB, self.state.SCB)
        return chunked_linear(x, rows, self.out_features, self.in_features, self.bias)
