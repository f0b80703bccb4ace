"""Differentiable reward plug-ins for DRaFT: ``package.module:function(images, prompts, metadata) -> tensor``.

The plug-ins are loaded by :func:`finetune.posttrain.rewards.load_rewards` (the same imports,
classes built once with ``options``, weights and gates as GRPO's), so an unimportable function
is refused before any model loads. Here they are called on a differentiable float tensor
``images`` (B, 3, H, W) in [0, 1] and must return a tensor of B values through which the
gradient reaches the images. A reward that returns something else, the wrong number of values,
a NaN/inf, or a tensor with no gradient path to the images (detached, computed under
``no_grad``, or not from the images at all) stops the step with one line naming it
(:class:`~finetune.posttrain.rewards.RewardError`).
"""

from __future__ import annotations

import torch

from .rewards import Reward, RewardError


def reaches(output: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``target`` (a non-leaf tensor) is on ``output``'s autograd graph. Walks the graph
    from ``output`` and stops at ``target``'s node, so only the reward's own part is visited."""
    goal, seen = target.grad_fn, set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node is goal:
            return True
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return False


def score_images(rewards: list[Reward], images: torch.Tensor, prompts: list[str],
                 metadata: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,) float32 carrying gradients, {name: raw values (B,) detached}).

    The total is the weighted sum of the raw values, zeroed for a sample where any gated reward
    falls below its gate. ``images``: (B, 3, H, W) in [0, 1]; when it requires grad (training),
    every reward's output must reach it.
    """
    n = images.shape[0]
    total = torch.zeros(n, dtype=torch.float32, device=images.device)
    keep = torch.ones(n, dtype=torch.bool, device=images.device)
    raw = {}
    for reward in rewards:
        where = reward.label(prompts)
        values = reward.call(images, prompts, metadata)
        if not isinstance(values, torch.Tensor):
            raise RewardError(f"{where} must return a tensor of {n} values, got {type(values).__name__}")
        if values.numel() != n:
            raise RewardError(f"{where} returned {values.numel()} values (shape {tuple(values.shape)}) for {n} images")
        values = values.reshape(n).to(device=images.device, dtype=torch.float32)
        bad = (~torch.isfinite(values.detach())).nonzero().flatten().tolist()
        if bad:
            raise RewardError(f"{where} returned {float(values.detach()[bad[0]])} for image {bad[0]} (prompt {prompts[bad[0]]!r})")
        if images.requires_grad and not (values.requires_grad and reaches(values, images)):
            raise RewardError(f"{where} returned a tensor with no gradient path to the images "
                              "(detached, computed under no_grad, or not from the images): DRaFT needs a differentiable reward")
        raw[reward.name] = values.detach()
        total = total + reward.weight * values
        if reward.gate is not None:
            keep &= values.detach() >= reward.gate
    return torch.where(keep, total, torch.zeros_like(total)), raw
