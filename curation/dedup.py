"""The ``dedup`` job: exact (md5) and near duplicates, one representative per group.

Near duplicates share a close perceptual hash, a close colour hash AND align: the 144-bit pHash
within ``max_hash_distance`` only proposes candidates (a 5%-per-side crop moves it as far as a
photograph that merely shares the layout), the colour hash keeps equal-luma colour variants
apart, and the crop-tolerant detail correlation of the two grey thumbnails (curation.alignment)
decides (:func:`best_match`). A second candidate source pairs a full frame with a centred crop
window of the other image (curation/windows.py: crops of 5-15% a side, 16:9 and 1:1 centre
crops), decided by the same colour and alignment rules on that window. Workers take candidates
from the warehouse: an exact scan of its hashes while it is small (curation/hash_scan.py), the
multi-index probes beyond (curation/hash_index.py: per-image cost flat in the table, thumbnails
fetched for candidates only), and keep nothing between batches; row locks, not a lock over the
warehouse, settle two workers placing near duplicates at once (:class:`DedupJob`).
:class:`Deduplicator` is the in-memory reference (the exact scan, :class:`HashIndex`) that the
quality tests and the bench's recall use. The representative is the largest image (pixels), then
the oldest (first ingested); a larger late arrival takes over its group.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import psycopg

from .config import DedupConfig
from .alignment import similarity
from .hash_index import FULL, Query, batch_candidates, bit_order, bit_text, keys
from .hash_scan import HashIndex, scan_candidates
from .hashing import colour_distance, hash_int
from .warehouse import Warehouse
from .windows import WINDOWS, unpack, window_hashes, window_thumbnail

DUPLICATE_REASONS = ("exact_duplicate", "near_duplicate")


@dataclass(frozen=True)
class Fingerprint:
    """What the near-duplicate decision compares of one image: its colour hash, its grey alignment
    thumbnail (None for rows deduplicated before schema 2: md5 only) and its crop windows' bytes
    (curation/windows.py; None for rows filtered before schema 5: full frame only)."""

    colour: bytes
    thumbnail: bytes | None
    windows: bytes | None = None

    def through(self, window: int | None, config: DedupConfig) -> tuple[bytes, bytes | None] | None:
        """``(colour hash, thumbnail)`` of the full frame (``window`` None) or of a crop window;
        None when the image has no such window."""
        if window is None:
            return self.colour, self.thumbnail
        if self.windows is None or self.thumbnail is None:
            return None
        return unpack(self.windows, config.hash_size, config.colour_grid)[window][2], window_thumbnail(self.thumbnail, window)


def matches(found: Iterable[tuple[int, int, int, Fingerprint, object]], image: Fingerprint,
            config: DedupConfig) -> list[tuple[int, int, object]]:
    """The candidates an image copies, best first, as ``(key, distance, extra)``. ``found``:
    candidates within ``max_hash_distance`` as ``(key, distance, view, fingerprint, extra)``,
    ``view`` saying which frames the hashes compared (curation.hash_index.FULL: both full frames;
    ``1 + j``: the candidate's crop window j; ``-(1 + j)``: this image's window j); the same two
    frames must be as close in colour and align (crop-tolerant detail correlation >=
    ``min_similarity``). Ordered by alignment, then the closer hash."""
    passed = []
    for key, distance, view, other, extra in found:
        own_side = image.through(-view - 1 if view < 0 else None, config)
        other_side = other.through(view - 1 if view > 0 else None, config)
        if own_side is None or other_side is None or own_side[1] is None or other_side[1] is None:
            continue
        if colour_distance(other_side[0], own_side[0]) > config.max_colour_distance:
            continue
        score = similarity(other_side[1], own_side[1])
        if score >= config.min_similarity:
            passed.append(((score, -distance), (key, distance, extra)))
    passed.sort(key=lambda p: p[0], reverse=True)
    return [p[1] for p in passed]


def best_match(found: Iterable[tuple[int, int, int, Fingerprint, int]], image: Fingerprint,
               config: DedupConfig) -> tuple[int, int, int] | None:
    """The candidate an image copies, as ``(key, distance, group)``, or None: the first of
    :func:`matches` (``found``'s last field: the candidate's group)."""
    ranked = matches(found, image, config)
    return ranked[0] if ranked else None


def representative(members: Iterable[tuple[int, int]]) -> int:
    """Of ``(id, area)`` members: the largest (pixels), then the oldest (smallest id = first ingested)."""
    return max(members, key=lambda m: (m[1], -m[0]))[0]


@dataclass
class Member:
    group: int
    area: int
    md5: str
    fingerprint: Fingerprint


class Deduplicator:
    """Groups hashes incrementally: md5 first, then the nearest near-duplicate by (phash, colour),
    over both candidate sources: full frame against full frame, and full frame against crop window
    either way (curation/windows.py), each by the exact scan."""

    def __init__(self, config: DedupConfig):
        self.config = config
        self.index = HashIndex(config.hash_size ** 2, config.max_hash_distance)
        self.window_index = HashIndex(config.hash_size ** 2, config.max_hash_distance)
        """Crop windows' hashes, key ``image_id * len(WINDOWS) + j``."""
        self.members: dict[int, Member] = {}
        self.groups: dict[int, list[int]] = defaultdict(list)
        self.by_md5: dict[str, int] = {}

    def match(self, value: int, image: Fingerprint) -> tuple[int, float] | None:
        """The indexed image this one copies, as ``(key, distance)``, or None. Candidates come from
        the hashes within ``max_hash_distance`` (full frames, and a full frame against a crop
        window), then must be as close in colour and align (crop-tolerant detail correlation >=
        ``min_similarity``) in the same frames; the best-aligned candidate wins."""
        found = [(key, distance, FULL) for key, distance in self.index.query(value)]
        found += [(key // len(WINDOWS), distance, 1 + key % len(WINDOWS)) for key, distance in self.window_index.query(value)]
        if image.windows is not None:
            for j, (window_hash, _, _) in enumerate(unpack(image.windows, self.config.hash_size, self.config.colour_grid)):
                found += [(key, distance, -(1 + j)) for key, distance in self.index.query(hash_int(window_hash))]
        best = best_match(((key, distance, view, self.members[key].fingerprint, self.members[key].group)
                           for key, distance, view in found), image, self.config)
        return None if best is None else (best[0], float(best[1]))

    def place(self, image_id: int, md5: str, phash: bytes, colour: bytes, thumbnail: bytes | None,
              area: int, windows: bytes | None = None) -> tuple[int, float]:
        """Put an image in a group (its own when nothing matches); returns (group, distance).
        ``windows``: its crop windows (curation.windows.window_fingerprints), None for none."""
        value = hash_int(phash)
        image = Fingerprint(colour, thumbnail, windows)
        if md5 in self.by_md5:
            group, distance = self.members[self.by_md5[md5]].group, 0.0
        else:
            found = self.match(value, image)
            group, distance = (self.members[found[0]].group, found[1]) if found else (image_id, 0.0)
            self.by_md5[md5] = image_id
        self.index.add(image_id, value)
        if windows is not None:
            for j, (window_hash, _, _) in enumerate(unpack(windows, self.config.hash_size, self.config.colour_grid)):
                self.window_index.add(image_id * len(WINDOWS) + j, hash_int(window_hash))
        self.members[image_id] = Member(group, area, md5, image)
        self.groups[group].append(image_id)
        return group, distance

    def representative(self, group: int) -> int:
        """Largest (pixels), then oldest (smallest id = first ingested)."""
        return representative((i, self.members[i].area) for i in self.groups[group])

    def reason(self, image_id: int, representative: int) -> str:
        same = self.members[image_id].md5 == self.members[representative].md5
        return DUPLICATE_REASONS[0] if same else DUPLICATE_REASONS[1]


class DedupJob:
    """The dedup step of one worker: every batch reads and writes the warehouse (no state kept).

    No lock spans the warehouse. A row enters the index when the filter job writes its hash, so of
    two copies deduplicated at once, each worker having committed its rows' hashes before probing,
    at least one sees the other. A candidate not placed yet is locked (``FOR UPDATE``; each batch
    locks its own rows first, in id order): the worker waits until its owner placed it and joins
    its group, or, if nobody holds it, leaves it, and its owner, waiting on the lock, then sees
    this row placed. Two workers waiting on each other's rows are a deadlock Postgres breaks by
    aborting one, which re-runs its batch. Nothing is grouped twice.

    Crop windows enter the window index when their row's dedup batch starts (committed with it):
    of an original and its crop deduplicated at once, the original's windows probe the crop's
    full frame, which is in the index from its filter job on, so the same rule holds."""

    RETRIES = 100

    def __init__(self, config: DedupConfig):
        self.config = config
        bit_order(config.hash_size)  # refuses a hash too short for the index before any claim

    def ready(self, warehouse: Warehouse) -> bool:
        return True

    def run(self, warehouse: Warehouse, rows: list[dict]) -> None:
        conn = warehouse.conn
        for attempt in range(self.RETRIES):
            try:
                with conn.transaction():
                    self._place(conn, rows)
                    # In the same transaction: a worker killed after the commit has no claim left open.
                    warehouse.release_log("dedup", [r["id"] for r in rows], "done")
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == self.RETRIES - 1:
                    raise
                time.sleep(random.uniform(0, 0.01 * min(attempt + 1, 20)))  # de-synchronise the retries

    @staticmethod
    def _placed(conn, image_id: int) -> int | None:
        """The group of a candidate nobody had placed when it was found: waits for the worker
        holding it, if any, to finish (its row lock); None while it is still unplaced."""
        return conn.execute("SELECT dedup_group FROM images WHERE id = %s FOR UPDATE", (image_id,)).fetchone()[0]

    def _place(self, conn, rows: list[dict]) -> None:
        """Place a batch in a fixed number of statements (lock, md5, candidates, write, windows,
        settle), whatever its size; rows of the batch see the ones placed before them (id order)."""
        config = self.config
        ids = [r["id"] for r in rows]
        conn.execute("SELECT id FROM images WHERE id = ANY(%s) ORDER BY id FOR UPDATE", (ids,))
        same_md5: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
        for other, md5, other_group in conn.execute("SELECT id, md5, dedup_group FROM images WHERE md5 = ANY(%s) "
                                                    "AND phash IS NOT NULL ORDER BY id", (list({r["md5"] for r in rows}),)):
            same_md5[md5].append((other, other_group))
        windows = [r["crop_windows"] and bytes(r["crop_windows"]) for r in rows]
        queries = [Query(bytes(r["phash"]), r["phash_weak"] and bytes(r["phash_weak"]),
                         [] if w is None else [(h, weak) for h, weak, _ in unpack(w, config.hash_size, config.colour_grid)])
                   for r, w in zip(rows, windows)]
        # The batch's own windows go in first: a crop later in the batch then finds its original
        # earlier in it, as it finds the full frames (entries of a row placed again are kept once).
        self.index_windows(conn, [(i, w) for i, w in zip(ids, windows) if w is not None])
        near = scan_candidates(conn, queries, config.hash_size, config.max_hash_distance)
        if near is None:  # a warehouse beyond SCAN_ROWS: the index
            near = batch_candidates(conn, queries, config.hash_size, config.max_hash_distance)
        batch, placed, waited = set(ids), {}, {}

        def group_of(other: int, known: int | None) -> int | None:
            # A row of this batch counts once placed above; any other unplaced row is waited for.
            if other in batch:
                return placed.get(other)
            if known is None and other not in waited:
                waited[other] = self._placed(conn, other)
            return known if known is not None else waited[other]

        results = []
        for row, found, window_bytes in zip(rows, near, windows):
            group, distance = None, 0.0
            for other, other_group in same_md5[row["md5"]]:
                if other != row["id"] and (group := group_of(other, other_group)) is not None:
                    break
            if group is None:
                # Only a candidate that matches is waited for (a wait on every candidate within the
                # radius chained 16 workers' batches into deadlocks faster than they resolved).
                image = Fingerprint(bytes(row["colour_hash"]), bytes(row["thumbnail"]), window_bytes)
                for key, hamming, known in matches(
                        ((c[0], c[1], c[2], Fingerprint(bytes(c[3]), c[4] and bytes(c[4]), c[6] and bytes(c[6])), c[5])
                         for c in found if c[0] != row["id"]), image, config):
                    if (group := group_of(key, known)) is not None:
                        distance = float(hamming)
                        break
                if group is None:
                    group = row["id"]
            placed[row["id"]] = group
            results.append((row["id"], group, distance))
        done = [r[0] for r in conn.execute(
            "UPDATE images i SET dedup_group = v.g, dedup_distance = v.d, dedup_seq = nextval('dedup_seq'), "
            "dedup_done_at = clock_timestamp(), dedup_claimed_by = NULL, dedup_error = NULL "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::real[]) AS v(id, g, d) "
            "WHERE i.id = v.id AND i.dedup_claimed_by = pg_backend_pid() RETURNING i.id",
            ([r[0] for r in results], [r[1] for r in results], [r[2] for r in results])).fetchall()]
        self._settle(conn, sorted({placed[i] for i in done}))

    def index_windows(self, conn, rows: list[tuple[int, bytes]]) -> None:
        """Put ``(id, crop_windows bytes)`` rows' windows in the window index (image_windows): one
        row a window, their hashes as bit strings and their multi-index keys; a window already
        there is kept (a batch run again)."""
        if not rows:
            return
        config = self.config
        table = window_hashes([w for _, w in rows], config.hash_size)
        ids = np.repeat([i for i, _ in rows], len(WINDOWS))
        crops = np.tile(np.arange(len(WINDOWS)), len(rows))
        key_values = keys(table, config.hash_size)
        bits = [bit_text(h.tobytes()) for h in table]
        conn.execute("INSERT INTO image_windows (id, crop, phash_bits, phash_k0, phash_k1, phash_k2) "
                     "SELECT * FROM unnest(%s::bigint[], %s::smallint[], %s::varbit[], %s::int[], %s::int[], %s::int[]) "
                     "ON CONFLICT (id, crop) DO NOTHING",
                     (ids.tolist(), crops.tolist(), bits, *(key_values[:, k].tolist() for k in range(key_values.shape[1]))))

    @staticmethod
    def _settle(conn, groups: list[int]) -> None:
        """Point every member of each of ``groups`` at its representative (largest, then oldest)
        and set the statuses: members dropped for another reason (filters never reach dedup, but a
        semantic duplicate may) keep it, and so do those ``dedup-shards`` dropped (their kept copy
        lives in another shard; a larger late arrival becomes kept here and meets it at the next
        ``dedup-shards`` run)."""
        if not groups:
            return
        members = defaultdict(list)
        for image_id, area, md5, group in conn.execute(
                "SELECT id, width::bigint * height, md5, dedup_group FROM images WHERE dedup_group = ANY(%s) "
                "ORDER BY id FOR UPDATE", (groups,)).fetchall():
            members[group].append((image_id, area, md5))
        ids, reps, reasons = [], [], []
        for group_members in members.values():
            rep = representative([(m[0], m[1]) for m in group_members])
            rep_md5 = next(m[2] for m in group_members if m[0] == rep)
            for m in group_members:
                ids.append(m[0])
                reps.append(rep)
                reasons.append(None if m[0] == rep else DUPLICATE_REASONS[0] if m[2] == rep_md5 else DUPLICATE_REASONS[1])
        conn.execute(
            "UPDATE images i SET duplicate_of = CASE WHEN v.reason IS NULL THEN NULL ELSE v.rep END, "
            "status = CASE WHEN v.reason IS NULL THEN 'kept' ELSE 'dropped' END, drop_reason = v.reason, "
            "drop_score = CASE WHEN v.reason IS NULL THEN NULL ELSE i.dedup_distance END, "
            "drop_job = CASE WHEN v.reason IS NULL THEN NULL ELSE 'dedup' END "
            "FROM unnest(%s::bigint[], %s::bigint[], %s::text[]) AS v(id, rep, reason) WHERE i.id = v.id "
            "AND (i.status IN ('kept', 'pending') OR i.drop_reason IN ('exact_duplicate', 'near_duplicate')) "
            "AND i.drop_job IS DISTINCT FROM 'dedup-shards' "
            "AND (i.duplicate_of IS DISTINCT FROM CASE WHEN v.reason IS NULL THEN NULL ELSE v.rep END "
            "     OR i.drop_reason IS DISTINCT FROM v.reason OR i.status = 'pending')",
            (ids, reps, reasons))
