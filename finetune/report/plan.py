"""Which images the report samples: the prompts with the trigger (``concept``) and without it
(``plain``, whose samples measure the leak), each at ``validation.seeds_per_prompt`` seeds, and
the base model's samples of the same prompts at ``base_copies`` seeds (two at least: the distance
between two seeds of the base is the leak's unit).

A run without trigger words applies its LoRA to every prompt: all validation prompts are
``concept`` prompts and only explicit ``validation.leak_prompts`` are ``plain``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Literal

SEED_STRIDE = 1000
"""Copy ``k`` of a prompt samples seed ``validation.seed + seed_index + k * SEED_STRIDE``: copy 0 is
the seed of the ordinary validation sample of that prompt, later copies keep clear of the seeds of
the other prompts (validation prompt ``i`` samples ``validation.seed + i``)."""

Kind = Literal["concept", "plain"]


@dataclass(frozen=True)
class ReportPrompt:
    text: str
    kind: Kind
    index: int
    """Its position among the prompts of its kind."""
    seed_index: int
    validation_index: int | None
    """The validation prompt it is (its copy 0 is then the ordinary validation sample), or None."""


@dataclass(frozen=True)
class SamplePlan:
    prompts: tuple[ReportPrompt, ...]
    seeds_per_prompt: int
    base_copies: int
    seed: int

    @property
    def concept(self) -> list[ReportPrompt]:
        return [p for p in self.prompts if p.kind == "concept"]

    @property
    def plain(self) -> list[ReportPrompt]:
        return [p for p in self.prompts if p.kind == "plain"]

    def seed_of(self, prompt: ReportPrompt, copy: int) -> int:
        return self.seed + prompt.seed_index + copy * SEED_STRIDE

    def extra_samples(self) -> list[tuple[ReportPrompt, int]]:
        """(prompt, copy) of the trained model's samples that the ordinary validation does not make."""
        return [(p, k) for p in self.prompts for k in range(self.seeds_per_prompt)
                if not (k == 0 and p.validation_index is not None)]

    def base_samples(self) -> list[tuple[ReportPrompt, int]]:
        return [(p, k) for p in self.prompts for k in range(self.base_copies)]

    def to_dict(self) -> dict:
        return asdict(self)


def trigger_words(config) -> list[str]:
    """``export.trigger_words`` and the ``caption_prefix`` of every dataset that is not regularization."""
    words = list(config.export.trigger_words)
    words += [entry.caption_prefix for entry in config.data.datasets if entry.caption_prefix and not entry.is_regularization]
    return [w.strip() for w in dict.fromkeys(words) if w.strip()]


def _pattern(word: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)")


def has_trigger(prompt: str, words: list[str]) -> bool:
    return any(_pattern(w).search(prompt) for w in words)


def strip_triggers(prompt: str, words: list[str]) -> str:
    """The prompt without its trigger words, and without the commas and spaces they leave:
    ``"sks, a photo of a dog"`` -> ``"a photo of a dog"``, ``"a photo of sks dog"`` -> ``"a photo of dog"``."""
    for word in words:
        prompt = _pattern(word).sub("", prompt)
    prompt = re.sub(r"\s*,(\s*,)+", ",", prompt)
    prompt = re.sub(r"\s+([,.;:])", r"\1", prompt)
    return re.sub(r"\s{2,}", " ", prompt).strip(" ,;")


def plan_for(config) -> SamplePlan:
    """The report's prompts and seeds for a run (see the module docstring)."""
    v = config.validation
    words = trigger_words(config)
    prompts: list[ReportPrompt] = []

    def add(text: str, kind: Kind, seed_index: int, validation_index: int | None) -> None:
        if text and not any(p.text == text and p.kind == kind for p in prompts):
            index = sum(p.kind == kind for p in prompts)
            prompts.append(ReportPrompt(text, kind, index, seed_index, validation_index))

    for i, text in enumerate(v.prompts):
        if not words or has_trigger(text, words):
            add(text, "concept", i, i)
    if v.leak_prompts is not None:
        for j, text in enumerate(v.leak_prompts):
            index = v.prompts.index(text) if text in v.prompts else None
            add(text, "plain", j if index is None else index, index)
    elif words:
        for i, text in enumerate(v.prompts):
            plain = strip_triggers(text, words)
            add(plain, "plain", i, i if plain == text else None)
    return SamplePlan(tuple(prompts), v.seeds_per_prompt, max(2, v.seeds_per_prompt), v.seed)
