"""Does fooling the reward fool the judge? A sign-gradient (L-infinity PGD) attack on the reward over the
held-out scans, and the share of attacked images whose digit the judge then reads differently
(issue 39: the attack-transfer figure, gated at :data:`GATE`).

The attack moves each 64 px image (float (N, 3, H, W) in [0, 1]) by at most ``budget`` per pixel and
channel, :data:`STEPS` steps of ``budget / 4``, each up the reward's cross-entropy for the true digit
(untargeted), projected back into the budget and [0, 1]. A reward fooled by changes the judge does
not see is a reward post-training can hack without the judge reporting it, and the other way round
the judge would report the hack as progress.

Budgets (stated in advance): the gate is at :data:`BUDGET` = 0.1, where the reward is fooled on
most held-out scans (measured 0.86-0.90 at seed 0); 0.2 (:data:`REPORTED_BUDGETS`) is reported too.
The reward reads 8x8 area means, so its attack can only move whole 8x8-pixel blocks: at 0.2 per
pixel that is a fifth of the ink's contrast over whole cells, visible grey blocks that change what
any reader of 8x8 shape sees (measured 0.24-0.36 transfer to gradient-feature and pixel readers of
other data, 0.44-0.51 to a reward trained adversarially, whose attacks become more digit-like).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

BUDGET = 0.1
REPORTED_BUDGETS = (0.1, 0.2)
STEPS = 10
GATE = 0.10
"""At most this share of reward-attacked images may change the judge's reading (at :data:`BUDGET`)."""


def attack(reward_net, images, labels, budget: float, steps: int = STEPS) -> torch.Tensor:
    """uint8 (N, H, W, 3) ``images`` with int ``labels`` (N,) -> the attacked float (N, 3, H, W) in [0, 1]."""
    from .judge import grayscale, to_tensor
    from .rewards import REWARD_SIZE

    start = to_tensor(images)
    target = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    x = start.clone()
    for _ in range(steps):
        x.requires_grad_(True)
        loss = F.cross_entropy(reward_net(grayscale(x, REWARD_SIZE)), target)
        (grad,) = torch.autograd.grad(loss, x)
        x = (start + (x.detach() + budget / 4 * grad.sign() - start).clamp(-budget, budget)).clamp(0, 1)
    return x.detach()


def transfer(reward_path, judge, images, labels, budgets=REPORTED_BUDGETS) -> dict:
    """Attack the reward at each budget on ``images`` (uint8 (N, H, W, 3), digits ``labels``) and read
    the results with ``judge`` (:class:`proving.judge.Judge`). Returns {"budget", "gate", "steps",
    "share": the judge's gated share at :data:`BUDGET`, "by_budget": [{"budget", "reward_fooled" (share
    the reward now reads wrong), "judge_flipped" (share whose judge reading changed), "judge_flipped_when_fooled"}]}."""
    from .judge import grayscale
    from .rewards import REWARD_SIZE, load_reward_net

    net = load_reward_net(reward_path)
    labels = np.asarray(labels)
    clean = judge.predict(images)
    rows = []
    for budget in budgets:
        attacked = attack(net, images, labels, budget)
        with torch.no_grad():
            fooled = net(grayscale(attacked, REWARD_SIZE)).argmax(1).numpy() != labels
        flipped = judge.predict(attacked) != clean
        rows.append({"budget": budget, "reward_fooled": float(fooled.mean()), "judge_flipped": float(flipped.mean()),
                     "judge_flipped_when_fooled": float((flipped & fooled).sum() / max(int(fooled.sum()), 1))})
    gated = next((r for r in rows if r["budget"] == BUDGET), None)
    return {"budget": BUDGET, "steps": STEPS, "gate": GATE, "share": None if gated is None else gated["judge_flipped"],
            "by_budget": rows}
