#!/usr/bin/env python
"""Issue 39's verdicts, read two ways: which seeds meet each gate on the evaluation block (the bench's own
``checks`` in each run's JSON) and on the means of several sampling blocks that no stage selected on.

    python bench/proving/verdicts.py bench/proving/results/zen4/seed{0,1,2}.json \\
        bench/proving/results/zen4/heldout_seed{3,4}.json [--blocks bench/proving/results/zen4]

``--blocks`` (default: the first run's folder) holds, per seed S, ``spread_seedS.json``
(``fd_spread.py --blocks ...`` with the run's DPO, GRPO and DRaFT) and ``lora_blocks_seedS.json``
(``lora_check.py --blocks ... --stage lora,lora_default,lora_ema``); a seed without them has no
five-block verdict. The five-block verdict is the same gate (:func:`proving.gates.checks`, one
implementation) on the block means: for the post-trained models, their accuracy and FD and
``base_nocfg``'s accuracy averaged over the blocks, against the frontier drawn through the base's block
means; their diversity is the evaluation block's (the blocks do not re-read it). The LoRA stages' verdicts
are ``lora_check``'s, which reads the same gate on its block means. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

from proving.across_seeds import gate_name, gate_results, seeds_met  # noqa: E402
from proving.gates import checks  # noqa: E402


def block_means(spread: dict) -> dict[str, dict[str, float]]:
    """{row name: {"accuracy", "fd"}} means over the blocks of an ``fd_spread.py`` JSON."""
    from proving.fd_spread import summary

    return {name: {m: values[2] for m, values in summary(rows).items()} for name, rows in spread["rows"].items()}


def five_block_verdicts(run: dict, spread: dict | None, lora_blocks: dict | None) -> dict[str, bool]:
    """{gate name: met on the block means} for the stages the block JSON measured (see the module docstring)."""
    out = {stage: bool(result["gate"][1]) for stage, result in (lora_blocks or {}).get("results", {}).items()}
    if spread:
        means = block_means(spread)
        stages = {name: dict(row) for name, row in run["stages"].items()}
        stages["base_nocfg"]["accuracy"] = means["base, guidance 0.0"]["accuracy"]
        for name, frontier in spread["frontier"].items():
            stages[name].update(means[name], frontier_fd=frontier["frontier_fd"])
        for claim, met in checks(stages, run.get("vae", {}), run):
            if gate_name(claim) in spread["frontier"]:
                out[gate_name(claim)] = bool(met)
    return out


def table(runs: list[dict], blocks: Path) -> str:
    """Markdown: one row per gate, the seeds that meet it on the evaluation block and on the block means."""
    means: dict[str, list] = {}
    for run in runs:
        seed = run["seed"]
        spread, loras = (blocks / f"{kind}_seed{seed}.json" for kind in ("spread", "lora_blocks"))
        found = five_block_verdicts(run, json.loads(spread.read_text()) if spread.is_file() else None,
                                    json.loads(loras.read_text()) if loras.is_file() else None)
        for name, met in found.items():
            means.setdefault(name, []).append((seed, met))
    lines = ["| gate | evaluation block: seeds met | five blocks: seeds met |", "|---|---|---|"]
    lines += [f"| {name} | {seeds_met(results)} | {seeds_met(means[name]) if name in means else ''} |"
              for name, results in gate_results(runs).items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="proving-ground JSON files (one per seed)")
    parser.add_argument("--blocks", help="folder of spread_seedS.json and lora_blocks_seedS.json (default: the first run's)")
    args = parser.parse_args(argv)
    blocks = Path(args.blocks) if args.blocks else Path(args.runs[0]).parent
    print(table([json.loads(Path(p).read_text()) for p in args.runs], blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
