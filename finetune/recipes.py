"""Named starting points for common budgets. A config picks one with ``recipe: NAME``; its own
values override the recipe's. Numbers follow what the community converged on for Krea 2 RAW
(rank 32 / alpha 32, lr 1e-4 .. 3e-4 constant, ~1000 steps for a small style set)."""

from __future__ import annotations

import copy
import difflib
from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    # 10-30 images of one look; train on RAW, run on Turbo.
    "lora-style": {
        "training": {"method": "lora", "max_steps": 1000, "batch_size": 1, "activation_checkpointing": "full",
                     "mixed_precision": "bf16"},
        "lora": {"rank": 32, "alpha": 32.0},
        "optimizer": {"name": "adamw8bit", "learning_rate": 1e-4},
        "lr_scheduler": {"name": "constant", "warmup_steps": 50},
        "data": {"resolution": 1024, "caption_dropout": 0.05},
        "checkpointing": {"every_n_steps": 250},
    },
    # A brand's product or character (30-100 images): more steps, decay at the end.
    "lora-brand": {
        "training": {"method": "lora", "max_steps": 2000, "batch_size": 1, "activation_checkpointing": "full",
                     "mixed_precision": "bf16"},
        "lora": {"rank": 32, "alpha": 32.0},
        "optimizer": {"name": "adamw8bit", "learning_rate": 1e-4},
        "lr_scheduler": {"name": "wsd", "warmup_steps": 100, "decay_fraction": 0.2},
        "data": {"resolution": 1024, "caption_dropout": 0.05},
        "checkpointing": {"every_n_steps": 250},
    },
    # Quick look at whether a dataset works at all: small rank, high lr, 512 px.
    "lora-quick": {
        "training": {"method": "lora", "max_steps": 400, "activation_checkpointing": "full", "mixed_precision": "bf16"},
        "lora": {"rank": 16, "alpha": 16.0},
        "optimizer": {"learning_rate": 3e-4},
        "data": {"resolution": 512},
        "checkpointing": {"every_n_steps": 100},
    },
    # Full fine-tune across GPUs: FSDP2, checkpointing, cosine decay, low lr.
    "full-finetune": {
        "training": {"method": "full", "max_steps": 5000, "activation_checkpointing": "full", "mixed_precision": "bf16"},
        "optimizer": {"learning_rate": 1e-5, "weight_decay": 0.01},
        "lr_scheduler": {"name": "cosine", "warmup_steps": 200, "min_lr_ratio": 0.1},
        "parallel": {"strategy": "fsdp"},
        "checkpointing": {"every_n_steps": 500, "keep_last": 2},
        "export": {"formats": ["diffusers", "original"]},
    },
}


class UnknownRecipe(KeyError):
    """A recipe name that is not in :data:`RECIPES`; ``message`` names the closest one.
    (:func:`finetune.config.build_config` reports it as a ``ConfigError``.)"""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def recipe_defaults(name: str) -> dict[str, Any]:
    if name not in RECIPES:
        hint = difflib.get_close_matches(name, list(RECIPES), n=1)
        more = f"; did you mean {hint[0]!r}?" if hint else ""
        raise UnknownRecipe(f"unknown recipe {name!r}{more} (known: {', '.join(RECIPES)})")
    return copy.deepcopy(RECIPES[name])
