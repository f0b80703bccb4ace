"""The GRPO prompt pool: per-prompt reward statistics, and dropping prompts that teach nothing.

A prompt whose group is always solved (high mean), always fails (low best) or shows no reward
variance gives zero or useless advantages; once it has had ``min_groups`` groups it leaves the
pool. The pool is rebuilt on resume by replaying ``prompt_pool.jsonl`` up to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import PromptPoolConfig

logger = logging.getLogger("finetune")


@dataclass
class PromptStats:
    groups: int = 0
    mean: float = 0.0
    """Running mean of the total reward over every sample so far."""
    best: float = float("-inf")
    max_std: float = 0.0
    dropped: str | None = field(default=None)


class PromptPool:
    def __init__(self, prompts: list[str], config: PromptPoolConfig):
        self.prompts = prompts
        self.config = config
        self.stats = [PromptStats() for _ in prompts]

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.stats) if s.dropped is None]

    def sample(self, count: int, generator: torch.Generator) -> list[int]:
        """``count`` prompt ids from the active ones (without repeats while there are enough)."""
        active = self.active
        if not active:
            logger.warning("every prompt left the pool (solved, hopeless or no variance); sampling all of them again")
            active = list(range(len(self.prompts)))
        order = [active[i] for i in torch.randperm(len(active), generator=generator).tolist()]
        return [order[i % len(order)] for i in range(count)]

    def update(self, prompt_id: int, rewards: list[float]) -> None:
        """Record one group's total rewards for ``prompt_id`` and drop the prompt if it qualifies."""
        s, c = self.stats[prompt_id], self.config
        values = torch.tensor(rewards, dtype=torch.float64)
        seen = s.groups * 1.0
        s.groups += 1
        s.mean = (s.mean * seen + float(values.mean())) / s.groups
        s.best = max(s.best, float(values.max()))
        s.max_std = max(s.max_std, float(values.std(unbiased=False)))
        if s.dropped is not None or s.groups < c.min_groups:
            return
        if c.solved_above is not None and s.mean >= c.solved_above:
            s.dropped = "solved"
        elif c.hopeless_below is not None and s.best < c.hopeless_below:
            s.dropped = "hopeless"
        elif s.max_std < c.min_std:
            s.dropped = "no variance"
        if s.dropped:
            logger.info("prompt pool: dropping %r (%s; mean %.4g, best %.4g, std %.3g over %d groups)",
                        self.prompts[prompt_id], s.dropped, s.mean, s.best, s.max_std, s.groups)

    def summary(self) -> dict[str, float]:
        reasons = [s.dropped for s in self.stats if s.dropped]
        return {"pool/active": float(len(self.active)),
                **{f"pool/dropped_{r.replace(' ', '_')}": float(reasons.count(r)) for r in sorted(set(reasons))}}


class PoolLog:
    """``prompt_pool.jsonl``: one row per step ``{"step", "groups": [[prompt_id, [rewards]], ...]}``."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled

    def replay(self, pool: PromptPool, upto_step: int) -> None:
        """Re-apply the rows up to ``upto_step`` and cut the file there (rows after the checkpoint
        belong to steps that will be run again)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            if line.strip() and json.loads(line)["step"] <= upto_step:
                kept.append(line)
                for prompt_id, rewards in json.loads(line)["groups"]:
                    pool.update(prompt_id, rewards)
        if self.enabled:
            self.path.write_text("".join(r + "\n" for r in kept))

    def append(self, step: int, groups: list[tuple[int, list[float]]]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, "groups": groups}) + "\n")
            handle.flush()
