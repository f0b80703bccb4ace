"""Loading a model folder's tokenizer, side by side: ``AutoTokenizer.from_pretrained`` (what diffusers'
``from_pretrained`` does for each pipeline) against :func:`krea2_diffusers.conditioning.tokenizer.folder_tokenizer`
(parsed once per process for each content, then a wrapper copy per call), on the Qwen tokenizer every
folder this project writes holds.

    python bench/bench_tokenizer.py [--loads 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=5, help="pipelines' worth of loads to time (each candidate)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from krea2_diffusers.conditioning.tokenizer import folder_tokenizer, qwen_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / f"model{i}" / "tokenizer" for i in range(args.loads)]  # one folder per model, same content
        for folder in folders:
            qwen_tokenizer().save_pretrained(folder)
        timings = {}
        for name, load in (("AutoTokenizer.from_pretrained", AutoTokenizer.from_pretrained), ("folder_tokenizer", folder_tokenizer)):
            start = time.perf_counter()
            for folder in folders:
                load(folder)
            timings[name] = (time.perf_counter() - start) / len(folders)
            print(f"{name}: {timings[name] * 1000:.0f} ms a load (mean of {len(folders)}, first included)", flush=True)
        print(f"folder_tokenizer is {timings['AutoTokenizer.from_pretrained'] / timings['folder_tokenizer']:.1f}x faster a load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
