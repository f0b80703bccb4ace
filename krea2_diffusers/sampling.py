"""Flow-matching sampler pieces, per the released model's schedule: the Euler step of the flow
ODE, and an SDE step with the same marginals (for RL exploration, with its Gaussian log-density).

Convention: ``x_t = (1 - t) x0 + t noise``, the model predicts ``v = noise - x0``, t runs 1 -> 0.
Guidance uses Krea's convention ``v = v_cond + g (v_cond - v_uncond)``: g = 0 is off, and g
equals ``s - 1`` for the standard ``v_uncond + s (v_cond - v_uncond)`` scale used by ComfyUI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Resolution-dependent shift for RAW: mu is linear in the image token count through
# (256 tokens, 0.5) and (6400 tokens, 1.15), i.e. 256 px and 1280 px squares.
BASE_IMAGE_SEQ_LEN = 256
MAX_IMAGE_SEQ_LEN = 6400
BASE_SHIFT = 0.5
MAX_SHIFT = 1.15
# Turbo was distilled at one fixed shift.
DISTILLED_SHIFT = 1.15


def compute_mu(image_seq_len: int) -> float:
    """RAW's shift parameter for an image of ``image_seq_len`` transformer tokens."""
    slope = (MAX_SHIFT - BASE_SHIFT) / (MAX_IMAGE_SEQ_LEN - BASE_IMAGE_SEQ_LEN)
    return BASE_SHIFT + slope * (image_seq_len - BASE_IMAGE_SEQ_LEN)


def time_shift(t: torch.Tensor, mu: float) -> torch.Tensor:
    """Exponential time shift ``e^mu / (e^mu + (1/t - 1))``; t = 0 stays 0."""
    t = torch.as_tensor(t, dtype=torch.float64)
    shifted = math.exp(mu) / (math.exp(mu) + (1.0 / t.clamp_min(torch.finfo(t.dtype).tiny) - 1.0))
    return torch.where(t > 0, shifted, torch.zeros_like(t))


def sigma_schedule(
    num_inference_steps: int, mu: float, sigmas: Sequence[float] | None = None
) -> torch.Tensor:
    """The ``steps + 1`` shifted time points, from 1 (noise) to 0 (data), float64.

    Args:
        num_inference_steps: number of Euler steps (ignored when ``sigmas`` is given).
        mu: shift parameter (:func:`compute_mu` for RAW, :data:`DISTILLED_SHIFT` for Turbo).
        sigmas: optional custom unshifted grid without the final 0, as in diffusers (``N`` values).
    """
    if sigmas is None:
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive integer, got {num_inference_steps!r}")
        grid = torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float64)
    else:
        grid = torch.tensor([*sigmas, 0.0], dtype=torch.float64)
        if grid.ndim != 1 or len(grid) < 2 or bool((grid[:-1] <= 0).any()) or bool((grid > 1).any()):
            raise ValueError(f"sigmas must be a non-empty list of values in (0, 1], got {list(sigmas)!r}")
    return time_shift(grid, mu)


def schedule_mu(image_seq_len: int, is_distilled: bool) -> float:
    return DISTILLED_SHIFT if is_distilled else compute_mu(image_seq_len)


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, t: float, t_next: float) -> torch.Tensor:
    """One Euler step of the flow ODE, accumulated in float32 at least."""
    dtype = torch.promote_types(latents.dtype, torch.float32)
    return (latents.to(dtype) + (t_next - t) * velocity.to(dtype)).to(latents.dtype)


def sde_step(
    latents: torch.Tensor, velocity: torch.Tensor, t: float, t_next: float, noise_level: float,
    noise: torch.Tensor | None = None, generator: torch.Generator | None = None, t_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One step of the reverse SDE whose marginals equal the Euler ODE's (Flow-GRPO's sampler).

    With ``x_t = (1 - t) x0 + t eps`` the score is ``-(x + (1 - t) v) / t``; the reverse-time SDE
    ``dx = [v + s_t^2 / (2t) (x + (1 - t) v)] dt + s_t dW`` (dt < 0) keeps every marginal for any
    diffusion ``s_t = noise_level * sqrt(t / (1 - t))``. ``noise_level = 0`` is exactly
    :func:`euler_step`.

    Args:
        latents, velocity: (B, N, C) at time t.
        t, t_next: current and next time, ``t > t_next >= 0``.
        noise: optional (B, N, C) standard normal draw (else from ``generator``).
        t_cap: ``s_t`` is evaluated at ``min(t, t_cap)``: it diverges at t = 1, the first step.

    Returns:
        (next latents, the step's mean, the step's standard deviation ``s_t sqrt(t - t_next)``);
        latents and mean in float32 at least.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)
    x, v = latents.to(dtype), velocity.to(dtype)
    dt = t_next - t
    t_std = min(t, t_cap) if t_cap is not None else t
    diffusion = noise_level * math.sqrt(t_std / (1.0 - t_std)) if t_std < 1.0 else 0.0
    mean = x + v * dt + (diffusion**2 / (2.0 * t)) * (x + (1.0 - t) * v) * dt
    std = diffusion * math.sqrt(-dt)
    if std == 0.0:
        return mean, mean, 0.0
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, dtype=dtype, device="cpu" if generator is None else generator.device)
    return mean + std * noise.to(device=x.device, dtype=dtype), mean, std


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """(B,) log-density of ``sample`` under N(mean, std^2 I), averaged over the (N, C) elements
    (a per-element mean keeps ratios of huge latent vectors in a usable range, as Flow-GRPO does)."""
    sample, mean = sample.float(), mean.float()
    log_density = -((sample - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(1)


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Krea-convention CFG: ``cond + g (cond - uncond)``."""
    return cond + guidance_scale * (cond - uncond)


def guidance_active(t: float, guidance_scale: float, interval: tuple[float, float] | None) -> bool:
    """Whether CFG runs at time ``t``: g > 0 and t inside the closed ``interval`` (None = always)."""
    if guidance_scale <= 0:
        return False
    if interval is None:
        return True
    low, high = interval
    return low <= t <= high


def check_guidance_interval(interval) -> tuple[float, float] | None:
    if interval is None:
        return None
    try:
        low, high = (float(v) for v in interval)
    except (TypeError, ValueError):
        raise ValueError(f"guidance_interval must be a pair (low, high), got {interval!r}") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"guidance_interval must satisfy 0 <= low <= high <= 1, got {interval!r}")
    return low, high


# ---------------------------------------------------------------------------- image-to-image
def check_strength(strength) -> float:
    """img2img / inpainting strength: a number in [0, 1] (0 = the input image, 1 = pure noise)."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise ValueError(f"strength must be a number in [0, 1], got {strength!r}")
    if not 0.0 <= float(strength) <= 1.0:
        raise ValueError(f"strength must lie in [0, 1] (0 returns the input image, 1 ignores it), got {strength!r}")
    return float(strength)


def truncate_for_strength(times: torch.Tensor, strength: float) -> torch.Tensor:
    """The tail of a shifted grid that img2img runs, diffusers' rule: of N steps the last
    ``int(N * strength)`` run (strength 1: all, strength 0: none).

    Args:
        times: (N + 1,) shifted time points from :func:`sigma_schedule`, 1 -> 0.
    Returns:
        (M + 1,) the points from the start time ``times[N - M]`` down to 0.
    """
    steps = len(times) - 1
    start = int(max(steps - min(steps * strength, steps), 0))
    return times[start:]


def denoise_sigmas(num_inference_steps: int, denoise: float) -> list[float]:
    """ComfyUI's ``denoise`` as a custom unshifted grid: the last ``num_inference_steps`` points (no
    final 0) of an ``int(num_inference_steps / denoise)``-step grid.

    ComfyUI runs all of ``steps`` from part-way into a longer schedule, where diffusers'
    ``strength`` (:func:`truncate_for_strength`) runs part of ``steps``. Passed as ``sigmas`` with
    ``strength=1`` (run the whole grid given) to the img2img / inpainting pipelines, sampling starts
    on the image noised at this grid's first (shifted) time: ComfyUI's rule, on the one img2img path.
    """
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must be in (0, 1], got {denoise!r}")
    if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be a positive integer, got {num_inference_steps!r}")
    total = max(num_inference_steps, int(num_inference_steps / denoise))
    grid = torch.linspace(1.0, 0.0, total + 1, dtype=torch.float64)
    return grid[-(num_inference_steps + 1):-1].tolist()


def noised(x0: torch.Tensor, noise: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """The flow's point at time t: ``(1 - t) x0 + t noise``, in float32 at least (t = 1 gives the noise exactly).

    The one noising step of the project (sampling, img2img, training objectives): ``t`` a float, or
    a (B,) tensor of per-sample times for x0/noise (B, ...)."""
    dtype = torch.promote_types(x0.dtype, torch.float32)
    if isinstance(t, torch.Tensor):
        t = t.to(dtype).view(-1, *([1] * (x0.ndim - 1)))
    return ((1.0 - t) * x0.to(dtype) + t * noise.to(dtype)).to(x0.dtype)


def keep_known(latents: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, repaint: torch.Tensor, t: float) -> torch.Tensor:
    """Inpainting: outside the ``repaint`` mask put back the known image's point at time t
    (at t = 0: exactly ``x0``). ``repaint`` is bool and broadcasts against ``latents``."""
    return torch.where(repaint, latents, noised(x0, noise, t))


@dataclass
class ImageStart:
    """Where image-to-image sampling starts instead of pure noise.

    Passed as ``Krea2Pipeline.__call__(..., image_start=...)`` (the img2img and inpainting pipelines
    build it). The run starts at the first time of the (custom or default) schedule after
    :func:`truncate_for_strength`; so ComfyUI's ``denoise`` d over S steps is
    ``sigmas=<the last S points of a round(S / d)-step grid>`` with ``strength=1``.

    Attributes:
        image_latents: (K, N, 64) packed model latents x0 of the input image(s) (normalised, as
            ``latents.encode_images`` returns them; the posterior mode for an encoded image); K is 1
            (shared by the batch) or one per prompt.
        strength: in [0, 1]: how much of the schedule runs (see :func:`truncate_for_strength`); with
            custom ``sigmas`` it truncates that grid (strength 1 with :func:`denoise_sigmas` is ComfyUI's ``denoise``).
        repaint: (K, N, 64) bool, True where inpainting repaints; None for plain img2img.
    """

    image_latents: torch.Tensor
    strength: float
    repaint: torch.Tensor | None = None

    def __post_init__(self):
        self.strength = check_strength(self.strength)
        if self.image_latents.ndim != 3:
            raise ValueError(f"image_latents must be packed (K, N, 64), got shape {tuple(self.image_latents.shape)}")
        if self.repaint is not None and self.repaint.shape != self.image_latents.shape:
            raise ValueError(f"repaint mask has shape {tuple(self.repaint.shape)}, image latents {tuple(self.image_latents.shape)}")

    def rows(self, batch: int, per_prompt: int) -> "ImageStart":
        """Expanded to ``batch * per_prompt`` rows (one image for all, or one per prompt)."""
        count = self.image_latents.shape[0]
        if count not in (1, batch):
            raise ValueError(f"got {count} input images for {batch} prompts; pass one image, or one per prompt")
        grow = (lambda x: x.expand(batch * per_prompt, -1, -1)) if count == 1 else (lambda x: x.repeat_interleave(per_prompt, 0))
        return ImageStart(grow(self.image_latents), self.strength, None if self.repaint is None else grow(self.repaint))
