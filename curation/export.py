"""``krea2 curate export``: kept images -> a ``krea2-pack-v1`` pack (the writer ``krea2 pack`` uses).

Captions come from the caption job (the source text fills ``caption_long`` when there is none);
``metadata`` keeps the warehouse id, md5, filter scores and cluster ids. ``balance="clusters"``
takes at most ``per_cluster`` images from every leaf cluster (default: the median leaf size), so
large clusters of near-identical content (product shots, screenshots) stop dominating the mix.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

from .warehouse import Warehouse

KEPT_QUERY = ("SELECT id, uri, source_text, caption_long, caption_medium, caption_short, md5, width, height, "
              "filter_scores, cluster_ids FROM images WHERE status = 'kept' ORDER BY id")


def balance_by_cluster(rows: list[dict], per_cluster: int | None, seed: int) -> list[dict]:
    """At most ``per_cluster`` rows (a seeded random choice) of each leaf cluster."""
    leaves: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["cluster_ids"] is None:
            raise ValueError(f"image {row['id']} ({row['uri']}) has no cluster: run the embed and cluster jobs "
                             "before exporting with --balance clusters")
        leaves[tuple(row["cluster_ids"])].append(row)
    sizes = sorted(len(v) for v in leaves.values())
    cap = per_cluster or sizes[len(sizes) // 2]
    rng = random.Random(seed)
    chosen = []
    for leaf in sorted(leaves):
        members = leaves[leaf]
        chosen += members if len(members) <= cap else rng.sample(members, cap)
    return sorted(chosen, key=lambda r: r["id"])


def export_pack(warehouse: Warehouse, out_dir: str | Path, resolution: int, batch_size: int, seed: int = 0,
                balance: str | None = None, per_cluster: int | None = None):
    """Write the kept images as a pack; returns the writer's stats."""
    from finetune.packs import PackRecord, write_pack

    with warehouse.conn.transaction():
        cur = warehouse.conn.execute(KEPT_QUERY)
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    if not rows:
        raise ValueError(f"{warehouse.where} has no kept images to export (run `krea2 curate work` first)")
    if balance == "clusters":
        rows = balance_by_cluster(rows, per_cluster, seed)
    elif balance is not None:
        raise ValueError(f"--balance {balance!r}: the only balancing is 'clusters'")
    records = (PackRecord(
        image=Path(row["uri"]), caption_long=row["caption_long"] or row["source_text"],
        caption_medium=row["caption_medium"], caption_short=row["caption_short"], source=row["uri"],
        sample_id=str(row["id"]),
        metadata={"warehouse_id": row["id"], "md5": row["md5"], "width": row["width"], "height": row["height"],
                  "filter_scores": row["filter_scores"], "cluster_ids": row["cluster_ids"]},
    ) for row in rows)
    return write_pack(records, out_dir, resolution=resolution, batch_size=batch_size, seed=seed)
