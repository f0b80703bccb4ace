"""Recall of the near-duplicate index's probes on real copy pairs, without a database
(``python bench/dedup_probes.py [--pairs 1600] [--seeds 1,2]``; issue 42).

Each draw: originals (smooth photographs and natural-statistics ones, alternating, as in
bench/dedup_scale.py) with 4 copies each (crops <= 5% a side, resizes to 50-100%, JPEG q60-95, all
three), fingerprinted on the filter job's analysis thumbnail. Of the pairs within
``max_hash_distance`` (the exact scan's answer), the share whose original key a copy's probes reach
on at least one key (what the warehouse's query then keeps):

- ``ranked``: the product's probes (curation/hash_index.py: 26-bit keys, the 1,216 cheapest
  patterns of 14 ranked weak bits a key);
- ``legacy_weak``: the same keys probed with weak bits stored under schema 4-5 (6 per 24-bit key),
  read through ``hash_index.ranked_weak``;
- ``no_weak``: single-bit flips alone (rows filtered before schema 4);
- ``schema5``: schema 5's own index for reference (24-bit keys, every subset of 6 weak bits with
  any one other bit), reimplemented here;
- ``schema5_template_26``: schema 5's template on 26-bit keys (4,032 probes).

Also the probes a query sends and the chance matches they meet per 1e7 uniform rows.
"""

from __future__ import annotations

import argparse
import io
import json

import numpy as np

from curation.config import CurationConfig
from curation.hash_index import PROBES, SUBSTRING_BITS, SUBSTRINGS, keys, probe_arrays, row_keys, weak_bits


def pairs(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(original bits, copy bits, copy margins)`` of dedup_scale's planted copies: (hash_size**2,) arrays."""
    from PIL import Image

    from curation.filters import thumbnail
    from curation.hashing import perceptual_hash_margins
    from dedup_scale import fingerprinted_pairs

    config = CurationConfig()
    side = config.dedup.hash_size ** 2

    def fingerprint(image):
        small = thumbnail(Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image.copy(),
                          config.filter.analysis_side)
        phash, margins = perceptual_hash_margins(small.convert("L"), config.dedup.hash_size)
        return np.unpackbits(np.frombuffer(phash, np.uint8))[:side], margins

    return fingerprinted_pairs(count, seed, fingerprint)


def _frequency_order(hash_size: int) -> np.ndarray:
    return np.array(sorted(range(1, hash_size ** 2), key=lambda i: (i // hash_size + i % hash_size, i)))


def schema5_found(original: np.ndarray, copy: np.ndarray, margins: np.ndarray, hash_size: int,
                  key_bits: int = 24) -> bool:
    """Schema 5's rule: on some key, every differing bit but at most one is among the copy's 6 weak bits."""
    order = _frequency_order(hash_size)
    for k in range(SUBSTRINGS):
        bits = order[k * key_bits:(k + 1) * key_bits]
        weak = set(np.argsort(margins[bits], kind="stable")[:6].tolist())
        if len(set(np.flatnonzero(original[bits] != copy[bits]).tolist()) - weak) <= 1:
            return True
    return False


def legacy_weak(margins: np.ndarray, hash_size: int) -> bytes:
    """Schema 4-5's ``phash_weak``: per 24-bit key, its 6 positions with the smallest margins."""
    per_key = margins[_frequency_order(hash_size)[:SUBSTRINGS * 24]].reshape(SUBSTRINGS, 24)
    return np.argsort(per_key, axis=1, kind="stable")[:, :6].astype(np.uint8).tobytes()


def recall(draw: list, hash_size: int, radius: int) -> dict:
    near = [(o, c, m) for o, c, m in draw if int((o != c).sum()) <= radius]
    found = {"ranked": 0, "legacy_weak": 0, "no_weak": 0, "schema5": 0, "schema5_template_26": 0}
    for original, copy, margins in near:
        want = keys(np.packbits(original)[None], hash_size)[0]
        row = row_keys(np.packbits(copy).tobytes(), hash_size)
        for name, weak in (("ranked", weak_bits(margins, hash_size)), ("legacy_weak", legacy_weak(margins, hash_size)),
                           ("no_weak", None)):
            probed = probe_arrays(row, weak)
            found[name] += any(np.isin(want[k], probed[k]) for k in range(SUBSTRINGS))
        found["schema5"] += schema5_found(original, copy, margins, hash_size)
        found["schema5_template_26"] += schema5_found(original, copy, margins, hash_size, SUBSTRING_BITS)
    return {"pairs_within_radius": len(near), **{k: round(v / max(len(near), 1), 4) for k, v in found.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1600)
    parser.add_argument("--seeds", default="1,2", help="one draw per seed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dedup = CurationConfig().dedup
    probes = SUBSTRINGS * PROBES
    results = {"probes": probes, "chance_matches_per_1e7_rows": round(probes * 1e7 / 2 ** SUBSTRING_BITS, 1),
               "schema5_chance_matches_per_1e7_rows": round(probes * 1e7 / 2 ** 24, 1), "draws": {}}
    for seed in (int(s) for s in args.seeds.split(",")):
        results["draws"][seed] = row = recall(pairs(args.pairs, seed), dedup.hash_size, dedup.max_hash_distance)
        print(f"seed {seed}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(json.dumps(results))
    if args.json:
        from krea2_diffusers.files import atomic_write

        with atomic_write(args.json, "w") as f:
            f.write(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
