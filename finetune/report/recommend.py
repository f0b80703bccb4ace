"""The rule that picks the checkpoint to use, and its reasons.

**The rule.** A checkpoint is *admissible* when

* its ``leak`` is at most :data:`LEAK_BOUND` (the samples without the trigger moved less than half
  as far from the base's as a change of seed moves them),
* its copying is below :data:`COPY_BOUND` of the way from the base's level to a near copy's
  (``copy level = (copying - base copying) / (near copy - base copying)``: 1 is a sample as close to
  a training image as that image through the VAE),
* its ``diversity`` is at least :data:`DIVERSITY_FLOOR` of the base's (the seeds still differ).

Among the admissible checkpoints the recommendation is the **one with the highest concept**: the
harms of over-training (leak, copying, lost variety) are measured and bounded above, so nothing is
gained by stopping short of the best measured concept. (Until issue 41's proof, the rule took the
earliest checkpoint within 10% of the best concept gain, as a hedge against over-training; on the
digits' LoRA, whose concept still rose at the last checkpoint, that gave up 0.07 of the judged
concept share for no measured harm. The rule was changed after seeing seed 0's proof; on seed 1's,
whose base no rule was chosen on, both rules pick the same checkpoint.) A measure that was not
taken (no prompt without the trigger, one seed, no base samples) is not checked.

When no checkpoint is admissible, the one that exceeds its bounds least (the smallest largest
``value / bound``) is named, with what it exceeds. Without trigger prompts (nothing measures the
concept) the latest admissible checkpoint is named.
"""

from __future__ import annotations

from .metrics import Reference

LEAK_BOUND = 0.5
COPY_BOUND = 0.9
DIVERSITY_FLOOR = 0.5
SHOWN = 3  # out-of-bounds checkpoints named in a reason

RULE = (f"the checkpoint with the highest concept, among those "
        f"with leak <= {LEAK_BOUND}, copying under {COPY_BOUND} of the way from the base to a near copy and diversity "
        f">= {DIVERSITY_FLOOR} of the base's")


def copy_level(row: dict, reference: Reference) -> float | None:
    """How far a checkpoint's copying went from the base's level (0) to a near copy's (1)."""
    base, near = reference.base_copying, reference.near_copy
    if base is None or row.get("copying") is None or near - base <= 1e-9:
        return None
    return (row["copying"] - base) / (near - base)


def excesses(row: dict, reference: Reference) -> dict[str, float]:
    """``value / bound`` of each measure taken (above 1: out of bounds; the diversity as ``floor / value``)."""
    out = {}
    if row.get("leak") is not None:
        out["leak"] = row["leak"] / LEAK_BOUND
    level = copy_level(row, reference)
    if level is not None:
        out["copying"] = level / COPY_BOUND
    if row.get("diversity") is not None and reference.base_diversity:
        floor = DIVERSITY_FLOOR * reference.base_diversity
        out["diversity"] = floor / max(row["diversity"], 1e-12)
    return out


def _describe(row: dict, reference: Reference) -> str:
    parts = []
    if row.get("leak") is not None:
        parts.append(f"leak {row['leak']:.2f}")
    level = copy_level(row, reference)
    if level is not None:
        parts.append(f"copying {level:.2f} of a near copy")
    if row.get("diversity") is not None and reference.base_diversity:
        parts.append(f"diversity {row['diversity'] / reference.base_diversity:.2f}x the base's")
    return ", ".join(parts)


def _failures(row: dict, reference: Reference) -> list[str]:
    return [name for name, ratio in excesses(row, reference).items() if ratio > 1.0]


def recommend(rows: list[dict], reference: Reference) -> dict | None:
    """``{"step", "reason"}`` for the measured checkpoints ``rows`` (step order), None without any."""
    if not rows:
        return None
    admissible = [r for r in rows if not _failures(r, reference)]
    refused = [f"step {r['step']} ({', '.join(_failures(r, reference))} out of bounds: {_describe(r, reference)})"
               for r in rows if _failures(r, reference)]
    if not admissible:
        row = min(rows, key=lambda r: max(excesses(r, reference).values()))
        return {"step": row["step"], "reason": (
            f"no checkpoint stays within the bounds; this one exceeds them least: {_describe(row, reference)}. "
            "Lower the learning rate or the steps, or add regularization images.")}
    measured = [r for r in admissible if r.get("concept") is not None]
    if not measured:
        row = admissible[-1]
        return {"step": row["step"], "reason": "no prompt with the trigger measures the concept: the latest checkpoint "
                                               f"within the bounds ({_describe(row, reference) or 'none measured'})."}
    base = reference.base_concept if reference.base_concept is not None else min(r["concept"] for r in rows)
    best = max(measured, key=lambda r: r["concept"])
    gain = best["concept"] - base
    if gain <= 0:
        return {"step": best["step"], "reason": (
            f"the concept never rose above the base's ({base:.3f}); this checkpoint comes closest ({best['concept']:.3f}). "
            "Train longer, raise the learning rate, or check that the validation prompts hold the trigger.")}
    row = best
    later = [r for r in rows if r["step"] > row["step"]]
    reason = (f"the checkpoint within the bounds with the highest concept: {row['concept']:.3f} (base {base:.3f})"
              + (f", over {len(later)} later checkpoint(s) that measured less or went out of bounds" if later else ""))
    described = _describe(row, reference)
    reason += f"; {described}." if described else "."
    if refused:
        more = f"; and {len(refused) - SHOWN} more" if len(refused) > SHOWN else ""
        reason += " Out of bounds: " + "; ".join(refused[:SHOWN]) + more + "."
    return {"step": row["step"], "reason": reason}
