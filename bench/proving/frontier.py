"""Realism against CFG (issue 39): the pretrained base sampled at guidance 0 and at :data:`CFG_SCALES`
traces an accuracy / FD frontier, what guidance alone buys and what it costs in realism. A
post-trained model (guidance 0, half the network evaluations of CFG) is measured against it: the
FD the base needs to reach the same accuracy (:func:`frontier_fd`), and the gate FD <= :data:`FD_BOUND`
x that. The post-training checkpoint is chosen by :func:`choose_checkpoint`, a rule stated here in
advance and applied to the curve's own samples (selection seeds), never to the report's.
"""

from __future__ import annotations

import numpy as np

CFG_SCALES = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
FD_BOUND = 1.1


def guidance_name(guidance: float) -> str:
    """The sample folder's name for a CFG scale, as the JSON writes it: ``1.5``, ``3.0``."""
    return repr(float(guidance))


def frontier_fd(sweep: list[dict], accuracy: float) -> dict:
    """The base's FD at ``accuracy`` on the frontier ``sweep`` ([{"guidance", "accuracy", "fd"}], any
    order): the points in order of guidance joined by straight lines (accuracy, FD), read at the first
    segment that reaches ``accuracy``. Returns {"fd", "reached"}: below the guidance-0 accuracy, the
    guidance-0 FD (the base needs no guidance); above every point's accuracy, the FD of the most
    accurate point and reached False (the base never gets there: no fair bound exists)."""
    points = sorted(sweep, key=lambda p: p["guidance"])
    if not points:
        raise ValueError("frontier_fd needs at least the guidance-0 point")
    if accuracy <= points[0]["accuracy"]:
        return {"fd": float(points[0]["fd"]), "reached": True}
    for low, high in zip(points, points[1:]):
        if high["accuracy"] >= accuracy:  # the first to reach it: every earlier point, ``low`` too, is below
            share = (accuracy - low["accuracy"]) / (high["accuracy"] - low["accuracy"])
            return {"fd": float(low["fd"] + share * (high["fd"] - low["fd"])), "reached": True}
    best = max(points, key=lambda p: (p["accuracy"], -p["fd"]))
    return {"fd": float(best["fd"]), "reached": False}


def within_bound(point: dict, sweep: list[dict]) -> bool:
    """Whether a (guidance-0) model's {"accuracy", "fd"} is within :data:`FD_BOUND` x the frontier's FD."""
    return point["fd"] <= FD_BOUND * frontier_fd(sweep, point["accuracy"])["fd"]


def choose_checkpoint(curve: list[dict], sweep: list[dict]) -> dict:
    """THE RULE (stated in advance): of the post-training checkpoints evaluated on the selection seeds
    (``curve``: [{"step", "accuracy", "fd", ...}], step 0 = the base, never chosen), the LAST whose FD
    is within :data:`FD_BOUND` x the frontier's FD at its accuracy (later = more trained, while realism
    holds); if none is, the one with the lowest FD / frontier-FD ratio. Returns {"step", "why"}."""
    trained = [p for p in sorted(curve, key=lambda p: p["step"]) if p["step"] > 0]
    if not trained:
        raise ValueError("choose_checkpoint needs at least one trained checkpoint")
    inside = [p for p in trained if within_bound(p, sweep)]
    if inside:
        return {"step": inside[-1]["step"], "why": f"last checkpoint with FD <= {FD_BOUND} x the frontier's FD at its accuracy"}
    ratio = [p["fd"] / max(frontier_fd(sweep, p["accuracy"])["fd"], 1e-9) for p in trained]
    return {"step": trained[int(np.argmin(ratio))]["step"],
            "why": f"no checkpoint within {FD_BOUND} x the frontier's FD: the lowest FD / frontier-FD ratio"}
