"""The single-frame fast path of the Qwen-Image VAE equals diffusers' 3-D path."""

import copy

import torch
from diffusers import AutoencoderKLQwenImage

from krea2_diffusers.latents import decode_latents, encode_images
from krea2_diffusers.models.tiny import randomize_, tiny_vae_config
from krea2_diffusers.models.vae import enable_single_frame_convs


def vaes():
    torch.manual_seed(0)
    reference = AutoencoderKLQwenImage(**tiny_vae_config()).eval()
    randomize_(reference, torch.Generator().manual_seed(0))
    fast = copy.deepcopy(reference)
    assert enable_single_frame_convs(fast) > 0
    return reference, fast


def test_decode_and_encode_equal_the_3d_path():
    reference, fast = vaes()
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(1))
    images = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(decode_latents(fast, latents), decode_latents(reference, latents), rtol=0, atol=1e-5)
        torch.testing.assert_close(encode_images(fast, images), encode_images(reference, images), rtol=0, atol=1e-5)
    assert fast.state_dict().keys() == reference.state_dict().keys()


def test_video_input_keeps_the_3d_path():
    reference, fast = vaes()
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(fast.encode(video).latent_dist.mode(), reference.encode(video).latent_dist.mode(), rtol=0, atol=1e-5)


def test_fast_path_is_really_taken(monkeypatch):
    _, fast = vaes()
    calls = []
    real = torch.nn.functional.conv3d
    monkeypatch.setattr(torch.nn.functional, "conv3d", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        decode_latents(fast, torch.randn(1, 16, 4, 4))
    assert not calls
