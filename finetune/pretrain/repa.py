"""iREPA: align an intermediate block's image tokens with a frozen vision encoder's patch features.

The auxiliary loss is ``weight * mean(1 - cos(projector(h), normalise(f)))`` over image tokens,
where ``h`` (B, N, D) are the image tokens leaving block ``repa.block``, the projector is a small
trainable 3x3 convolution over the token grid (iREPA's choice over REPA's MLP: it keeps spatial
structure), and ``f`` (B, N, E) the encoder's patch features of the clean image, resized so that
its patch grid equals the transformer's token grid, with iREPA's spatial normalisation (the mean
over tokens removed, per channel). The projector is registered on the transformer as
``repa_projector`` (so it is checkpointed with it); PMA files and exports leave it out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from krea2_diffusers.models.tiny import is_tiny

PROJECTOR_NAME = "repa_projector"
# ImageNet statistics (DINOv2/v3); encoders whose config names other ones use those.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SPATIAL_NORM_EPS = 1e-6


def tiny_vision_encoder() -> nn.Module:
    """A random 2-layer DINOv2 (patch 8), built offline, for tests."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    patch_size=8, image_size=32))


class VisionTarget:
    """A frozen vision tower: (B, 3, H, W) pixels in [0, 1] -> (B, gh * gw, E) patch features."""

    def __init__(self, spec: str, device: torch.device, dtype: torch.dtype = torch.float32):
        if is_tiny(spec):
            model = tiny_vision_encoder()
        else:
            from transformers import AutoModel

            model = AutoModel.from_pretrained(spec, dtype=dtype)
        # SigLIP / CLIP style checkpoints hold text and vision towers: keep the vision one.
        self.model = getattr(model, "vision_model", model).to(device).eval().requires_grad_(False)
        config = self.model.config
        self.patch_size = int(getattr(config, "patch_size"))
        self.dim = int(getattr(config, "hidden_size"))
        self.dtype = dtype
        mean, std = getattr(config, "image_mean", IMAGENET_MEAN), getattr(config, "image_std", IMAGENET_STD)
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1)

    @torch.no_grad()
    def features(self, pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        gh, gw = grid
        size = (gh * self.patch_size, gw * self.patch_size)
        x = F.interpolate(pixels.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
        x = ((x - self.mean) / self.std).to(self.dtype)
        tokens = self.model(pixel_values=x).last_hidden_state
        patches = tokens[:, -gh * gw:].float()  # drop CLS / register tokens, which come first
        return patches - patches.mean(dim=1, keepdim=True)


def make_projector(dim: int, target_dim: int) -> nn.Conv2d:
    return nn.Conv2d(dim, target_dim, kernel_size=3, padding=1)


@contextlib.contextmanager
def capture_block_output(block: nn.Module):
    """Record the block's output (B, S, D) in ``box[0]`` during the forward inside the context."""
    box: list[torch.Tensor] = []
    handle = block.register_forward_hook(lambda module, args, output: box.append(output))
    try:
        yield box
    finally:
        handle.remove()


def alignment_loss(tokens: torch.Tensor, grid: tuple[int, int], projector: nn.Module, target: torch.Tensor) -> torch.Tensor:
    """Mean ``1 - cos`` between projected image tokens (B, N, D) and targets (B, N, E)."""
    gh, gw = grid
    batch, n, dim = tokens.shape
    spatial = tokens.float().transpose(1, 2).reshape(batch, dim, gh, gw)
    projected = projector(spatial).flatten(2).transpose(1, 2)  # (B, N, E)
    return (1 - F.cosine_similarity(projected, target, dim=-1, eps=SPATIAL_NORM_EPS)).mean()
