"""Encoding a batch whose prompts repeat: ours (each distinct prompt once) against the alternatives.

A seed sweep or a proving-ground batch lists one prompt many times, and CFG adds as many empty
negatives. On the bench's proportioned components (bench_pipeline.build: the 36-layer encoder at
1/16 width, the real Qwen tokenizer), one process, the same list of ``--copies`` prompts:

- ``ours``: :func:`krea2_diffusers.conditioning.text.encode_prompts` (each distinct prompt once, rows
  gathered back);
- ``ours_distinct``: the same call on ``--copies`` different prompts of the same token length (what
  the call costs when nothing repeats: the cost without the deduplication);
- ``diffusers``: ``diffusers.Krea2Pipeline.encode_prompt`` on the same list (every row encoded, padded
  to its 512 tokens).

Prints each one's best wall time over ``--repeats`` rounds taken in turns (``bench_dequant.best_of``;
diffusers': one run), the ratios, and whether our rows equal the single
prompt's encoding bit for bit.

    python bench/bench_prompt_encoding.py [--copies 256] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = "a handwritten digit seven, black ink on white paper"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=256, help="rows in the batch (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.copies < 2:
        raise SystemExit(f"--copies must be at least 2, got {args.copies}")

    from bench_dequant import best_of
    from bench_pipeline import build

    from krea2_diffusers.conditioning.text import encode_prompts

    ours, theirs = build()
    encoder, tokenizer = ours.text_encoder, ours.tokenizer
    repeated = [PROMPT] * args.copies
    # Distinct prompts of one token length: the digit word varies, nothing else.
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    distinct = [f"a handwritten digit {words[i % 10]}, black ink on white paper {i}" for i in range(args.copies)]

    with torch.inference_mode():
        single, single_mask = encode_prompts(encoder, tokenizer, [PROMPT])
        embeds, mask = encode_prompts(encoder, tokenizer, repeated)
        identical = bool(torch.equal(embeds, single.expand_as(embeds)) and torch.equal(mask, single_mask.expand_as(mask)))
        best, _ = best_of({"ours": lambda: encode_prompts(encoder, tokenizer, repeated),
                           "ours_distinct": lambda: encode_prompts(encoder, tokenizer, distinct)}, args.repeats)
        # Once: 256 rows of 512 tokens take minutes, and the gap is far beyond the noise.
        best.update(best_of({"diffusers": lambda: theirs.encode_prompt(repeated, device=torch.device("cpu"))}, 1)[0])
        seconds = {name: usage.wall for name, usage in best.items()}
    result = {"copies": args.copies, "threads": torch.get_num_threads(), "seconds": seconds,
              "distinct_over_ours": seconds["ours_distinct"] / seconds["ours"],
              "diffusers_over_ours": seconds["diffusers"] / seconds["ours"], "rows_identical": identical}
    for name, value in seconds.items():
        print(f"{name:14s} {value:8.3f} s")
    print(f"without deduplication / ours: {result['distinct_over_ours']:.1f}x; diffusers / ours: "
          f"{result['diffusers_over_ours']:.1f}x; rows equal the single prompt's bit for bit: {identical}")
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(Path(args.json), "w") as handle:
            handle.write(json.dumps(result, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
