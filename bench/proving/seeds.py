"""Every seed of a proving-ground run, derived from the one ``--seed S`` (issue 39).

Training seeds: the held-out split, the judge / reward halves, the autoencoder's and the
transformer's initialisation and data order (``krea2 pack --seed``, ``training.seed``), every LoRA
and post-training run. At S = 0 the split, autoencoder, packs and pretraining keep the values the
settings were tuned with (all 0), so seed 0's base is the base those settings were chosen on.

Sampling seeds: ``sampling.generate`` draws sample k of digit d from noise seed ``base + 1000 d + k``
(k < 1000), so a ``base`` owns the block [base, base + 10,000). Blocks never overlap, within a run
or across runs (S owns [100,000 S, 100,000 (S + 1))), and none is the block the settings were
tuned on: every tuning run sampled its report from base 0 (and DPO's pools from 500 / 700) with
seed-0 models. The report's samples come from :attr:`Seeds.eval` only; choosing a checkpoint
(pretraining's base, the post-training curves' rule) uses :attr:`Seeds.select`, never ``eval``.
"""

from __future__ import annotations

from dataclasses import dataclass

TUNING_SAMPLING_SEED = 0
"""The sampling base every tuning run used (with training seed 0): documented, never used."""
BLOCK = 10_000
RUN_SPAN = 100_000


@dataclass(frozen=True)
class Seeds:
    """The seeds of run ``run`` (``--seed``); see the module docstring."""

    run: int = 0

    def __post_init__(self):
        if not 0 <= self.run < 20_000:
            raise ValueError(f"--seed must be in [0, 20000), got {self.run}")

    def training(self, offset: int) -> int:
        """A training seed: ``offset`` (the value seed 0 uses) + 1,000 S, so seed 0 keeps its values."""
        return offset + 1000 * self.run

    # Training: offsets are the values the tuned settings ran with where they existed.
    @property
    def split(self) -> int:
        return self.training(0)

    @property
    def autoencoder(self) -> int:
        return self.training(0)

    @property
    def pretrain(self) -> int:
        """``krea2 pack --seed`` (row order) and ``krea2 pretrain``'s ``training.seed`` (init, noise)."""
        return self.training(0)

    @property
    def halves(self) -> int:
        """Which training scans the judge and which the reward learns from."""
        return self.training(7)

    @property
    def judge(self) -> int:
        return self.training(1)

    @property
    def reward(self) -> int:
        return self.training(2)

    @property
    def lora(self) -> int:
        return self.training(3)

    @property
    def edit(self) -> int:
        return self.training(4)

    @property
    def posttrain(self) -> int:
        return self.training(5)

    # Sampling blocks (see the module docstring): base + 1000 d + k.
    def block(self, index: int) -> int:
        return RUN_SPAN * self.run + BLOCK * index

    @property
    def eval(self) -> int:
        """The report's samples (every stage, the CFG sweep, the edit's outputs)."""
        return self.block(1)

    @property
    def select(self) -> int:
        """Samples that choose a checkpoint (pretraining's base, the post-training curves)."""
        return self.block(2)

    @property
    def dpo_pool(self) -> int:
        """DPO's guidance-free candidates."""
        return self.block(3)

    @property
    def dpo_guided(self) -> int:
        """DPO's CFG candidates."""
        return self.block(4)

    def as_dict(self) -> dict:
        """The JSON's ``eval_seeds`` block: what the report's samples used, and what was tuned on."""
        return {"run": self.run, "eval_base": self.eval, "select_base": self.select,
                "rule": "sample k of digit d: noise seed base + 1000 d + k",
                "settings_tuned_on": {"training_seed": 0, "sampling_base": TUNING_SAMPLING_SEED}}
