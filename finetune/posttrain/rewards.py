"""Reward plug-ins for GRPO: ``package.module:function(images, prompts, metadata) -> list[float]``
(DRaFT loads its differentiable ones here too and scores them in :mod:`.differentiable_rewards`).

``images`` is a list of PIL images, ``prompts`` a list of str, ``metadata`` a list of dicts
(``prompt_index``, ``seed``, ``step``); one float per image comes back. A target that is a class
is instantiated once with the reward's ``options`` (so a model loads once, on first use, never at
import); a function gets ``options`` as keyword arguments.

Built-ins (names starting ``krea2.``) live in :mod:`finetune.posttrain.builtin_rewards`.

Every reward is imported when the config is read, so a typo is refused before any model loads.
A reward that raises, returns the wrong number of values or a NaN/inf stops the step with the
function's name and the prompts (the last checkpoint is kept).
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ConfigError
from .config import RewardConfig

BUILTIN_PREFIX = "krea2."
BUILTINS = {
    "krea2.vlm_rubric": "finetune.posttrain.builtin_rewards:VLMRubricReward",
    "krea2.ocr": "finetune.posttrain.builtin_rewards:OCRReward",
    "krea2.clip": "finetune.posttrain.builtin_rewards:CLIPReward",
}


class RewardError(RuntimeError):
    """A reward function failed during a step; the message names it and the prompts."""


def resolve(spec: str) -> Callable:
    """Import ``package.module:function`` (or a built-in name); a clear error if it cannot."""
    target = BUILTINS.get(spec, spec)
    if spec.startswith(BUILTIN_PREFIX) and spec not in BUILTINS:
        raise ConfigError(f"unknown built-in reward {spec!r}; built-ins: {sorted(BUILTINS)}")
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"reward {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any failure while importing user code is a config problem
        raise ConfigError(f"reward {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err})") from err
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ConfigError(f"reward {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise ConfigError(f"reward {spec!r} is not callable")
    return function


@dataclass
class Reward:
    name: str
    function: Callable
    weight: float
    gate: float | None

    def label(self, prompts: list[str]) -> str:
        """How its errors name it: the function and the step's prompts."""
        return f"reward {self.name!r} on prompts {sorted(set(prompts))}"

    def call(self, images, prompts: list[str], metadata: list[dict]):
        """The function's raw output; anything it raises becomes a :class:`RewardError` naming it."""
        try:
            return self.function(images, prompts, metadata)
        except Exception as err:
            raise RewardError(f"{self.label(prompts)} raised {type(err).__name__}: {err}") from err


def load_rewards(configs: list[RewardConfig]) -> list[Reward]:
    rewards = []
    for config in configs:
        target = resolve(config.function)
        if isinstance(target, type):
            # A class: built once with its options; its model loads on the first call.
            function = target(**config.options)
        else:
            function = functools.partial(target, **config.options) if config.options else target
        rewards.append(Reward(config.function, function, config.weight, config.gate))
    return rewards


def score(rewards: list[Reward], images, prompts: list[str], metadata: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (n,) float64, {name: raw values (n,)}). The total is the weighted sum of the raw
    values, zeroed for a sample where any gated reward falls below its gate."""
    n = len(images)
    total = torch.zeros(n, dtype=torch.float64)
    keep = torch.ones(n, dtype=torch.bool)
    raw = {}
    for reward in rewards:
        where = reward.label(prompts)
        values = reward.call(images, prompts, metadata)
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise RewardError(f"{where} must return a list of floats, got {type(values).__name__} ({err})") from None
        if len(values) != n:
            raise RewardError(f"{where} returned {len(values)} values for {n} images")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RewardError(f"{where} returned {values[bad[0]]} for image {bad[0]} (prompt {prompts[bad[0]]!r})")
        tensor = torch.tensor(values, dtype=torch.float64)
        raw[reward.name] = tensor
        total += reward.weight * tensor
        if reward.gate is not None:
            keep &= tensor >= reward.gate
    return torch.where(keep, total, torch.zeros_like(total)), raw


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(n,) rewards in consecutive groups of ``group_size`` (one prompt each) -> advantages
    ``(r - group mean) / (group std + eps)``; a group without spread gets zeros."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True, unbiased=False)
    return ((groups - mean) / (std + eps)).view(-1)
