"""Near-duplicate recall per kind of copy and precision, beyond the CI corpus (``bench_curation.py --crops N``).

N originals of 512x384 (smooth photographs and natural-statistics ones, alternating), each with one
copy of every kind of :data:`curation.synthetic.COPY_KINDS` (crops up to 5%, 5-10% and 10-15% a
side, 16:9 and 1:1 centre crops, resizes, JPEG q60-95), an equal-luma colour variant and, for every
other one, a photograph sharing its layout (both must stay apart), fingerprinted by the filter job's
own function. Then:

1. the decision (curation.dedup.Deduplicator: exact candidates from the full frames and the crop
   windows, colour, alignment) in two arrival orders: every original before its copies (a crop
   finds its original's window) and every copy before its original (the original's windows find
   the crop): recall per kind, precision over every merge;
2. the warehouse's candidate probes (curation/hash_index.py, what a warehouse beyond SCAN_ROWS
   runs) against the exact scan over the same rows: of the copies whose original the exact scan
   proposes, the share the probes propose too, per kind and per arrival direction.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np

from curation.config import CurationConfig
from curation.synthetic import COPY_KINDS, colour_variant, layout, natural, near_copies, photo


def corpus(originals: int, seed: int = 0) -> list[tuple[int, str, dict]]:
    """``(source, kind, fingerprint)`` in ingest order (each original, its copies, its look-alikes);
    source -1 for images of their own. A fingerprint is the filter job's stored values plus ``area``."""
    from PIL import Image

    from curation.filters import thumbnail
    from curation.screening import filter_outcome

    config = CurationConfig()

    def fingerprint(image) -> dict:
        small = thumbnail(Image.open(io.BytesIO(image)) if isinstance(image, bytes) else image.copy(),
                          config.filter.analysis_side)
        return {**filter_outcome({"id": 0}, small, config).values, "area": small.width * small.height}

    rng = np.random.default_rng(seed)
    out = []
    for n in range(originals):
        shared = layout(rng)
        picture = photo(rng, (512, 384), layout=shared) if n % 2 else natural(rng, (512, 384), grain=4.0)
        out.append((n, "original", fingerprint(picture)))
        out += [(n, kind, fingerprint(data)) for kind, data in near_copies(rng, picture)]
        out.append((-1, "colour variant", fingerprint(colour_variant(picture))))
        if n % 2:
            out.append((-1, "layout", fingerprint(photo(rng, (512, 384), layout=shared))))
    return out


def decisions(images: list[tuple[int, str, dict]], copies_first: bool) -> dict:
    """Recall per kind and precision of the Deduplicator, originals first or copies first."""
    from curation.dedup import Deduplicator

    order = list(range(len(images)))
    if copies_first:  # each original after its copies (its look-alikes after it)
        owner, last = [], -1
        for source, _, _ in images:
            last = source if source >= 0 else last
            owner.append(last)
        order.sort(key=lambda i: (owner[i], images[i][0] < 0, images[i][1] == "original", i))
    dedup = Deduplicator(CurationConfig().dedup)
    group_of = {}
    for i in order:
        f = images[i][2]
        group_of[i], _ = dedup.place(i, f"md5-{i}", f["phash"], f["colour_hash"], f["thumbnail"], f["area"], f["crop_windows"])
    source = {i: s if s >= 0 else ("own", i) for i, (s, _, _) in enumerate(images)}
    original = {s: i for i, (s, kind, _) in enumerate(images) if kind == "original"}
    recall = {}
    for kind in COPY_KINDS:
        of_kind = [i for i, (_, k, _) in enumerate(images) if k == kind]
        recall[kind] = round(sum(group_of[i] == group_of[original[images[i][0]]] for i in of_kind) / len(of_kind), 4)
    merged = [i for i in order if group_of[i] != i]
    correct = sum(source[i] == source[group_of[i]] for i in merged)
    return {"recall": recall, "precision": round(correct / max(len(merged), 1), 4), "merges": len(merged),
            "wrong_merges": len(merged) - correct}


def probe_recall(images: list[tuple[int, str, dict]], folder: Path) -> dict:
    """Per kind and direction, of the copy-original pairs the exact scan proposes, the share the
    multi-index probes propose, on a warehouse holding every image (ids = list positions + 1)."""
    import psycopg

    from curation.dedup import DedupJob
    from curation.hash_index import KEY_COLUMNS, Query, batch_candidates
    from curation.hash_scan import scan_candidates
    from curation.schema import migrate
    from curation.server import EmbeddedServer
    from curation.windows import unpack

    config = CurationConfig().dedup
    server = EmbeddedServer(folder, create=True)
    try:
        with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS crops")
            conn.execute("CREATE DATABASE crops")
        with psycopg.connect(server.uri("crops"), autocommit=True) as conn:
            migrate(conn, "the crops bench")
            columns = ["uri", "phash", "phash_weak", "phash_bits", "colour_hash", "thumbnail", "crop_windows", *KEY_COLUMNS]
            with conn.cursor().copy(f"COPY images ({', '.join(columns)}) FROM STDIN") as copy:
                for i, (_, _, f) in enumerate(images):
                    copy.write_row([f"/bench/{i}", *(f[c] for c in columns[1:])])
            ids = [r[0] for r in conn.execute("SELECT id FROM images ORDER BY id").fetchall()]
            DedupJob(config).index_windows(conn, [(i, bytes(f["crop_windows"])) for i, (_, _, f) in zip(ids, images)])
            conn.execute("VACUUM ANALYZE")
            queries = [Query(f["phash"], f["phash_weak"], [(h, w) for h, w, _ in unpack(f["crop_windows"], config.hash_size,
                                                                                       config.colour_grid)])
                       for _, _, f in images]
            exact, probed = [], []
            for start in range(0, len(queries), 64):
                part = queries[start:start + 64]
                exact += scan_candidates(conn, part, config.hash_size, config.max_hash_distance, limit=10 ** 9)
                probed += batch_candidates(conn, part, config.hash_size, config.max_hash_distance)
    finally:
        server.close()
    original = {s: i for i, (s, kind, _) in enumerate(images) if kind == "original"}
    out = {}
    for kind in COPY_KINDS:
        counts = {"copy finds original": [0, 0], "original finds copy": [0, 0]}
        for i, (source, k, _) in enumerate(images):
            if k != kind:
                continue
            o = original[source]
            for name, a, b in (("copy finds original", i, o), ("original finds copy", o, i)):
                if any(c[0] == ids[b] for c in exact[a]):
                    counts[name][1] += 1
                    counts[name][0] += any(c[0] == ids[b] for c in probed[a])
        out[kind] = {name: round(found / max(total, 1), 4) for name, (found, total) in counts.items()}
        out[kind]["pairs_within_radius"] = max(total for _, total in counts.values())
    return out


def run(originals: int, folder: Path) -> dict:
    start = time.perf_counter()
    images = corpus(originals)
    print(f"{len(images)} images fingerprinted in {time.perf_counter() - start:.1f} s", flush=True)
    result = {"originals": originals, "copies_per_kind": originals}
    for name, copies_first in (("originals_first", False), ("copies_first", True)):
        result[name] = decisions(images, copies_first)
        print(name, result[name], flush=True)
    result["probe_recall_vs_exact"] = probe_recall(images, folder)
    print("probes vs exact scan", result["probe_recall_vs_exact"], flush=True)
    return result
