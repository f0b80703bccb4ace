"""The proving ground's gates: issue 32's thresholds and issue 39's, each as (claim with its numbers,
met?), None where the run did not measure it. ``stages``: {stage: row}; ``extra``: the JSON's other
blocks ("judge", "reward", "edit")."""

from __future__ import annotations

NAN = float("nan")
LORAS = ("lora", "lora_default", "lora_ema")


def checks(stages: dict[str, dict], vae: dict, extra: dict | None = None) -> list[tuple[str, bool | None]]:
    from .attack import GATE
    from .edit import IOU_RATIO
    from .frontier import FD_BOUND

    extra = extra or {}
    s = {name: row for name, row in stages.items() if row.get("accuracy") is not None}
    out = []

    def claim(text: str, needs: tuple[str, ...], test):
        out.append((text, test() if all(n in s for n in needs) else None))

    def get(stage: str, key: str, default=NAN):
        value = s.get(stage, {}).get(key)
        return default if value is None else value

    error = {name: 1 - row["accuracy"] for name, row in s.items()}
    recon = vae.get("judge_accuracy")
    out.append((f"autoencoder: judge accuracy on held-out reconstructions {recon} >= 0.95",
                None if recon is None else recon >= 0.95))
    judge, reward = extra.get("judge") or {}, extra.get("reward") or {}
    if reward:
        out.append((f"judge and reward share no training scan ({reward.get('scans_shared_with_judge')} shared)",
                    reward.get("scans_shared_with_judge") == 0))
        attack = reward.get("attack") or {}
        fooled = next((r["reward_fooled"] for r in attack.get("by_budget", []) if r["budget"] == attack.get("budget")), NAN)
        out.append((f"attack transfer: {judge.get('attack_transfer', NAN):.3f} of held-out scans attacked on the reward "
                    f"(L-inf {attack.get('budget')}, reward fooled on {fooled:.3f}) change the judge's reading, <= {GATE}",
                    None if judge.get("attack_transfer") is None else judge["attack_transfer"] <= GATE))
    claim(f"base accuracy {get('base', 'accuracy')} >= 0.90 and > base_nocfg {get('base_nocfg', 'accuracy')}",
          ("base", "base_nocfg"), lambda: s["base"]["accuracy"] >= 0.90 and s["base"]["accuracy"] > s["base_nocfg"]["accuracy"])
    for lora in LORAS:
        off, nocfg = f"{lora}_off", f"{lora}_off_nocfg"
        claim(f"{lora}: concept share {get(lora, 'concept')} >= 0.90 and accuracy {get(lora, 'accuracy')} >= base - 0.05; "
              f"{off}: concept share {get(off, 'concept')} <= 0.10 (CFG) and {get(nocfg, 'concept')} <= 0.10 (guidance 0)",
              (lora, off, "base") + ((nocfg,) if nocfg in stages else ()),
              lambda lora=lora, off=off, nocfg=nocfg: get(lora, "concept") >= 0.90
              and s[lora]["accuracy"] >= s["base"]["accuracy"] - 0.05 and get(off, "concept", 1.0) <= 0.10
              and (nocfg not in stages or get(nocfg, "concept", 1.0) <= 0.10))
    for name in ("dpo", "grpo", "draft"):
        frontier = get(name, "frontier_fd")
        claim(f"{name}: error {error.get(name, NAN):.3f} <= 0.6 x base_nocfg error {0.6 * error.get('base_nocfg', NAN):.3f}; "
              f"diversity {get(name, 'diversity'):.2f} >= 0.5 x base_nocfg {0.5 * get('base_nocfg', 'diversity'):.2f}; "
              f"FD {get(name, 'fd'):.2f} <= {FD_BOUND} x the CFG frontier's FD at its accuracy {FD_BOUND * frontier:.2f}"
              + ("" if s.get(name, {}).get("frontier_reached", True) else " (the base never reaches that accuracy)"),
              (name, "base_nocfg"),
              lambda name=name, frontier=frontier: error[name] <= 0.6 * error["base_nocfg"]
              and s[name]["diversity"] >= 0.5 * s["base_nocfg"]["diversity"]
              and frontier == frontier and s[name]["fd"] <= FD_BOUND * frontier)
    claim(f"student_4: error {error.get('student_4', NAN):.3f} <= 0.6 x teacher_4 error {0.6 * error.get('teacher_4', NAN):.3f}; "
          f"FD {get('student_4', 'fd'):.2f} < teacher_4 {get('teacher_4', 'fd'):.2f}; accuracy >= teacher_28 - 0.05 = "
          f"{get('teacher_28', 'accuracy') - 0.05:.3f}", ("student_4", "teacher_4", "teacher_28"),
          lambda: error["student_4"] <= 0.6 * error["teacher_4"] and s["student_4"]["fd"] < s["teacher_4"]["fd"]
          and s["student_4"]["accuracy"] >= s["teacher_28"]["accuracy"] - 0.05)
    edit = extra.get("edit")
    if edit:
        out.append((f"edit: concept {edit['concept']:.3f} >= 0.90, source digit kept {edit['accuracy']:.3f} >= 0.90, "
                    f"IoU with the source {edit['iou_source']:.3f} >= {IOU_RATIO} x IoU with another scan of the digit "
                    f"{IOU_RATIO * edit['iou_other']:.3f}" + (f" (the red-ink target itself, a perfect edit: "
                    f"{edit['target_iou_ratio']:.2f}x)" if "target_iou_ratio" in edit else ""),
                    edit["concept"] >= 0.90 and edit["accuracy"] >= 0.90 and edit["iou_source"] >= IOU_RATIO * edit["iou_other"]))
    return out
