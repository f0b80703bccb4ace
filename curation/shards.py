"""``krea2 curate dedup-shards``: near-duplicate groups merged across warehouses (shards).

Each warehouse deduplicates inside itself; this pass compares every shard's kept representatives
with every other shard's index (curation/hash_index.py: md5, then pHash candidates, colour and
alignment, :func:`~curation.dedup.best_match`, crop windows included), and of a representative and its best match in
another shard keeps the one the in-shard rule keeps: the largest (pixels), then the oldest (first
ingested; ties by shard id, then row id). The other is ``dropped`` (``exact_duplicate`` or
``near_duplicate``, ``drop_job = 'dedup-shards'``) with ``shard_duplicate_of = '<shard id>:<row id>'``,
the shard id being the uuid each warehouse holds in ``curation_shard``.

Resumable and idempotent: shard S records, per peer shard T, the last of its representatives it
compared with T (``shard_progress``), after the batch's decisions are written. A run killed
mid-batch redoes that batch, whose decisions are idempotent (a drop is written only to a row still
kept, and re-deciding a pair gives the same winner); a second run over finished shards reads no
row past its progress and changes nothing. Rows deduplicated later are picked up by the next run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .config import CurationConfig
from .dedup import DUPLICATE_REASONS, Fingerprint, best_match
from .hash_index import Query, batch_candidates
from .hash_scan import scan_candidates
from .windows import unpack
from .warehouse import Warehouse, open_warehouse

BATCH = 256
"""Representatives compared per committed step (what a killed run redoes)."""


@dataclass
class Shard:
    warehouse: Warehouse
    uuid: str


def _representatives(shard: Shard, after: int, batch: int) -> list[tuple]:
    return shard.warehouse.conn.execute(
        "SELECT id, md5, phash, phash_weak, colour_hash, thumbnail, width::bigint * height, ingested_at, crop_windows "
        "FROM images WHERE status = 'kept' AND dedup_group IS NOT NULL AND id > %s ORDER BY id LIMIT %s",
        (after, batch)).fetchall()


def _match(row: tuple, other: Shard, config: CurationConfig) -> tuple | None:
    """The kept row of ``other`` that ``row`` copies, as ``(id, distance, area, ingested_at, md5)``."""
    conn = other.warehouse.conn
    image_id, md5, phash, weak, colour, thumbnail, area, ingested, windows = row
    exact = conn.execute("SELECT id, width::bigint * height, ingested_at, md5 FROM images WHERE md5 = %s "
                         "AND status = 'kept' ORDER BY id LIMIT 1", (md5,)).fetchone()
    if exact:
        return exact[0], 0, exact[1], exact[2], exact[3]
    if phash is None or thumbnail is None:
        return None
    dedup = config.dedup
    windows = windows and bytes(windows)
    query = Query(bytes(phash), weak and bytes(weak),
                  [] if windows is None else [(h, w) for h, w, _ in unpack(windows, dedup.hash_size, dedup.colour_grid)])
    found = (scan_candidates(conn, [query], dedup.hash_size, dedup.max_hash_distance)
             or batch_candidates(conn, [query], dedup.hash_size, dedup.max_hash_distance))[0]
    if not found:
        return None
    kept = {r[0]: r[1:] for r in conn.execute(
        "SELECT id, width::bigint * height, ingested_at, md5 FROM images WHERE id = ANY(%s) AND status = 'kept'",
        ([c[0] for c in found],)).fetchall()}
    best = best_match(((c[0], c[1], c[2], Fingerprint(bytes(c[3]), c[4] and bytes(c[4]), c[6] and bytes(c[6])), c[5])
                       for c in found if c[0] in kept), Fingerprint(bytes(colour), bytes(thumbnail), windows), dedup)
    return None if best is None else (best[0], best[1], *kept[best[0]])


def _drop(loser: Shard, loser_id: int, winner: Shard, winner_id: int, reason: str, distance: float) -> None:
    loser.warehouse.conn.execute(
        "UPDATE images SET status = 'dropped', drop_reason = %s, drop_score = %s, drop_job = 'dedup-shards', "
        "shard_duplicate_of = %s WHERE id = %s AND status = 'kept'",
        (reason, distance, f"{winner.uuid}:{winner_id}", loser_id))


def _compare(shard: Shard, peer: Shard, config: CurationConfig, batch: int) -> int:
    """Compare ``shard``'s representatives past its progress with ``peer``; returns rows dropped."""
    conn = shard.warehouse.conn
    dropped = 0
    while True:
        after = conn.execute("SELECT last_id FROM shard_progress WHERE peer = %s", (peer.uuid,)).fetchone()
        rows = _representatives(shard, after[0] if after else 0, batch)
        if not rows:
            return dropped
        for row in rows:
            match = _match(row, peer, config)
            if match is None:
                continue
            other_id, distance, other_area, other_ingested, other_md5 = match
            ours = (row[6], -row[7].timestamp(), shard.uuid, -row[0])
            theirs = (other_area, -other_ingested.timestamp(), peer.uuid, -other_id)
            # max() of (area, -age): larger, then older; the shard uuid and id only break exact ties.
            winner, loser = ((shard, row[0]), (peer, other_id)) if max(ours, theirs) == ours else \
                ((peer, other_id), (shard, row[0]))
            reason = DUPLICATE_REASONS[0] if row[1] == other_md5 else DUPLICATE_REASONS[1]
            _drop(loser[0], loser[1], winner[0], winner[1], reason, float(distance))
            dropped += 1
        conn.execute("INSERT INTO shard_progress (peer, last_id) VALUES (%s, %s) ON CONFLICT (peer) "
                     "DO UPDATE SET last_id = excluded.last_id", (peer.uuid, rows[-1][0]))


def dedup_shards(dsns: list[str], config: CurationConfig, batch: int = BATCH) -> dict[str, int]:
    """Merge near-duplicate groups across the warehouses at ``dsns``; returns rows dropped per shard
    (by shard id). ``batch``: representatives compared per committed step."""
    if len(dsns) < 2 or len(set(dsns)) != len(dsns):
        raise ValueError(f"dedup-shards needs two or more distinct --dsn, got {len(set(dsns))} distinct of {len(dsns)}"
                         if len(dsns) >= 2 else f"dedup-shards needs two or more --dsn, got {len(dsns)}")
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    with contextlib.ExitStack() as stack:
        shards = []
        for dsn in dsns:
            warehouse = stack.enter_context(open_warehouse(dsn=dsn, queue=config.queue))
            uuid = str(warehouse.conn.execute("SELECT id FROM curation_shard").fetchone()[0])
            shards.append(Shard(warehouse, uuid))
        if len({s.uuid for s in shards}) != len(shards):
            raise ValueError("two --dsn name the same warehouse (same curation_shard id)")
        dropped = {}
        for shard in shards:
            count = 0
            for peer in shards:
                if peer is not shard:
                    count += _compare(shard, peer, config, batch)
            dropped[shard.uuid] = count
        return dropped
