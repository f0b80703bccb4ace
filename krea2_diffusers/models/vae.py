"""Single-image fast path for the Qwen-Image VAE.

The Qwen-Image VAE is a causal *video* VAE. For a still image (one frame, no cache) every causal
3x3x3 convolution pads two zero frames in front, so only the last temporal tap of its kernel
ever meets data. Running those layers as 2-D convolutions with that tap gives the same result for
a third of the work. Multi-frame input and cached chunks keep the original 3-D path.
"""

from __future__ import annotations

import torch.nn.functional as F


def _single_frame_forward(self, x, cache_x=None):
    kt = self.kernel_size[0]
    temporal_pad = self._padding[4]
    if (
        x.shape[2] == 1 and cache_x is None and self.stride[0] == 1 and self.dilation[0] == 1
        and temporal_pad == kt - 1 and self.groups == 1
    ):
        spatial = F.pad(x[:, :, 0], self._padding[:4])
        out = F.conv2d(spatial, self.weight[:, :, -1], self.bias, stride=self.stride[1:], dilation=self.dilation[1:])
        return out[:, :, None]
    return type(self).__mro__[1].forward(self, x, cache_x)


def enable_single_frame_convs(vae) -> int:
    """Give every causal 3-D convolution of ``vae`` the single-frame fast path, in place.

    Returns the number of layers changed; weights and state dict are untouched. A VAE without
    causal 3-D convolutions is left as it is (returns 0).
    """
    try:
        from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
    except ImportError:  # another diffusers layout: nothing to speed up
        return 0
    fast_class = type("SingleFrameCausalConv3d", (QwenImageCausalConv3d,), {"forward": _single_frame_forward})
    changed = 0
    for module in vae.modules():
        if type(module) is QwenImageCausalConv3d:
            module.__class__ = fast_class
            changed += 1
    return changed
