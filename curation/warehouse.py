"""The warehouse: one ``images`` table that is also every job's queue.

A worker claims rows with ``... ORDER BY <job>_last_tried_at NULLS FIRST LIMIT n FOR UPDATE SKIP
LOCKED``, stamping ``<job>_last_tried_at``, ``<job>_attempts`` and ``<job>_claimed_by`` (its
backend pid) in the same statement, commits, works without holding locks, then writes results
guarded by ``<job>_claimed_by = pg_backend_pid()``. A claim is live while that backend is: a worker
killed with -9 loses its connection, its backend ends, and its rows are claimable again at once,
behind the never-tried rows (they carry a ``last_tried_at``). A row whose job raised waits
``backoff_s * 2**(attempts-1)`` and after ``max_attempts`` is ``failed`` with its last error.
All writes are set-based: one statement per batch (COPY for ingest, ``UPDATE ... FROM unnest``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .config import QueueConfig
from .hash_index import KEY_COLUMNS
from .schema import JOBS, SCREENING, UPSTREAM, check_version, migrate
from .server import EmbeddedServer, WarehouseError, connect

RESULT_COLUMNS = {
    "probe": {"md5": "text", "size_bytes": "bigint", "format": "text", "width": "integer", "height": "integer"},
    "filter": {"filter_scores": "jsonb", "phash": "bytea", "phash_weak": "bytea", "colour_hash": "bytea",
               "thumbnail": "bytea", "phash_bits": "varbit", "crop_windows": "bytea", **{c: "integer" for c in KEY_COLUMNS}},
    "dedup": {},  # written by the dedup job itself
    "caption": {"caption_long": "text", "caption_medium": "text", "caption_short": "text"},
    "embed": {"embedding_path": "text", "embedding_row": "integer"},
    "cluster": {"cluster_ids": "integer[]", "semantic_duplicate_of": "bigint"},
}
"""Result columns each job writes through :meth:`Warehouse.write` and their SQL types."""

CLAIM_COLUMNS = ("id", "uri", "source_text", "md5", "size_bytes", "width", "height", "phash", "phash_weak", "colour_hash",
                 "thumbnail", "crop_windows", "caption_long", "embedding_path", "embedding_row", "ingested_at")


@dataclass
class Outcome:
    """What one job did to one claimed row."""

    id: int
    values: dict[str, Any] = field(default_factory=dict)
    """Result columns (see RESULT_COLUMNS)."""
    drop: str | None = None
    """Reason the image is dropped (final); None keeps it in the pipeline."""
    score: float | None = None
    """The measurement behind ``drop`` (e.g. the neighbour correlation of a noise image)."""
    error: str | None = None
    """A retryable failure: the job is not done, the row is retried after its back-off."""
    detail: str | None = None
    """A message kept with a finished row in ``<job>_error`` (e.g. why a file did not decode)."""


def _status_of(job: str) -> str:
    return "pending" if job in SCREENING else "kept"


def _live_claim(job: str) -> str:
    """SQL: the row's claim for ``job`` belongs to a backend that is still connected."""
    return (f"EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = {job}_claimed_by "
            f"AND a.backend_start <= {job}_last_tried_at)")


def _ready(job: str) -> str:
    """SQL: `` AND <upstream>_done_at IS NOT NULL`` (nothing for probe): the row is in ``job``'s
    queue index (schema.py), which a claim's scans then read instead of the table."""
    upstream = UPSTREAM[job]
    return f" AND {upstream}_done_at IS NOT NULL" if upstream else ""


def _claimable(job: str) -> str:
    """SQL predicate of a row ``job`` may claim now (parameters ``backoff``: seconds, ``max``:
    max_attempts). A dead worker's claim counted an attempt: the row waits out the back-off like a
    row whose job raised, and once its attempts are used up it is reaped (:func:`_dead_exhausted`)."""
    return (f"status = '{_status_of(job)}' AND status IN ('pending', 'kept') AND {job}_done_at IS NULL{_ready(job)}"
            f" AND ({job}_claimed_by IS NULL OR ({job}_attempts < %(max)s AND NOT {_live_claim(job)}))"
            f" AND ({job}_attempts = 0 OR {job}_last_tried_at"
            f" + make_interval(secs => %(backoff)s * power(2, {job}_attempts - 1)) <= now())")


def _dead_exhausted(job: str) -> str:
    """SQL predicate: the worker holding the row died and the row has no attempt left (parameter ``max``)."""
    # A claimed row's upstream job is done (_ready holds): said here too so the scan uses the queue index.
    return (f"({job}_claimed_by IS NOT NULL AND {job}_done_at IS NULL AND status = '{_status_of(job)}'{_ready(job)} "
            f"AND {job}_attempts >= %(max)s AND NOT {_live_claim(job)})")


def _take(job: str, source: str) -> str:
    """SQL: claim the rows of CTE ``source`` for ``job`` (an attempt each; a dead worker's claim
    taken over counts a death) and return them; logged in claim_log when ``%(log)s``."""
    columns = ", ".join(f"i.{c}" for c in CLAIM_COLUMNS)
    return (f"taken AS (UPDATE images i SET {job}_last_tried_at = clock_timestamp(), "
            f"{job}_attempts = i.{job}_attempts + 1, "
            f"{job}_deaths = i.{job}_deaths + (i.{job}_claimed_by IS NOT NULL)::int, "
            f"{job}_claimed_by = pg_backend_pid() FROM {source} c WHERE i.id = c.id "
            f"RETURNING {columns}, i.{job}_last_tried_at AS claimed_at), "
            f"logged AS (INSERT INTO claim_log (job, image_id, worker, backend_pid, claimed_at) "
            f"SELECT '{job}', id, %(worker)s, pg_backend_pid(), claimed_at FROM taken WHERE %(log)s) "
            f"SELECT * FROM taken")


class Warehouse:
    """A connection to one warehouse (embedded or remote) and the queue operations on it."""

    def __init__(self, conn, where: str, store: Path | None, queue: QueueConfig, server: EmbeddedServer | None = None):
        self.conn = conn
        self.where = where
        self.store = store
        self.queue = queue
        self.server = server
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.log_claims = False
        """Record every claim and release in ``claim_log`` (``work --claim-log``)."""

    def close(self) -> None:
        self.conn.close()
        if self.server is not None:
            self.server.close()

    def require_store(self) -> Path:
        if self.store is None:
            raise WarehouseError("this job writes files: pass --store DIR (a folder every worker can reach) with --dsn")
        return self.store

    # -- ingest -------------------------------------------------------------------------------
    def ingest(self, records: Iterable[tuple[str, str | None]]) -> dict[str, int]:
        """Add ``(uri, source_text)`` rows; known URIs are left untouched. Returns counts
        ``{"new", "known", "repeated"}`` (``repeated``: URIs given more than once in this call)."""
        seen: dict[str, str | None] = {}
        repeated = 0
        for uri, text in records:
            if uri in seen:
                repeated += 1
                continue
            seen[uri] = text
        with self.conn.transaction():
            self.conn.execute("CREATE TEMP TABLE incoming (uri text, source_text text) ON COMMIT DROP")
            with self.conn.cursor().copy("COPY incoming (uri, source_text) FROM STDIN") as copy:
                for uri, text in seen.items():
                    copy.write_row((uri, text))
            new = self.conn.execute("INSERT INTO images (uri, source_text) SELECT uri, source_text FROM incoming "
                                    "ORDER BY uri ON CONFLICT (uri) DO NOTHING").rowcount
        return {"new": new, "known": len(seen) - new, "repeated": repeated}

    # -- queue --------------------------------------------------------------------------------
    def _params(self, **extra) -> dict[str, Any]:
        return {"backoff": self.queue.backoff_s, "max": self.queue.max_attempts, "worker": self.worker, **extra}

    def claim(self, job: str, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` rows for ``job`` (oldest attempt first, never-tried rows first) in
        one statement, one round trip. Rows a dead worker held are suspects: each is claimed alone,
        and only when no other row is claimable, so a row that kills its worker takes no innocent
        rows down with it; a suspect with no attempt left is reaped as ``failed`` first."""
        # Suspects and reaping look at claimed rows, which no index lists (one more index on a
        # column every claim changes slows every claim): both only run once no ordinary row is
        # left, i.e. at the end of a queue, where the scan is short.
        sql = (f"WITH normal AS (SELECT id FROM images WHERE {_claimable(job)} AND {job}_claimed_by IS NULL "
               f"AND {job}_deaths = 0 ORDER BY {job}_last_tried_at NULLS FIRST, id LIMIT %(limit)s "
               f"FOR UPDATE SKIP LOCKED), "
               f"reaped AS (UPDATE images SET status = 'failed', drop_reason = 'failed:{job}', drop_job = '{job}', "
               f"{job}_deaths = {job}_deaths + 1, {job}_claimed_by = NULL, "
               f"{job}_error = 'worker died while processing (' || ({job}_deaths + 1) || ' times)' "
               f"WHERE {_dead_exhausted(job)} AND NOT EXISTS (SELECT 1 FROM normal) RETURNING id), "
               f"suspect AS (SELECT id FROM images WHERE {_claimable(job)} AND ({job}_claimed_by IS NOT NULL "
               f"OR {job}_deaths > 0) AND NOT EXISTS (SELECT 1 FROM normal) "
               f"ORDER BY {job}_last_tried_at NULLS FIRST, id LIMIT 1 FOR UPDATE SKIP LOCKED), "
               f"chosen AS (SELECT id FROM normal UNION ALL SELECT id FROM suspect), " + _take(job, "chosen"))
        cur = self.conn.execute(sql, self._params(limit=limit, log=self.log_claims))
        return self._rows(cur)

    @staticmethod
    def _rows(cur) -> list[dict[str, Any]]:
        names = [d.name for d in cur.description]
        return sorted((dict(zip(names, r)) for r in cur.fetchall()), key=lambda r: r["id"])

    def release_log(self, job: str, ids: list[int], outcome: str) -> None:
        """Close our open claim_log entries of ``ids`` (only a worker that logs claims has any)."""
        if not self.log_claims:
            return
        self.conn.execute("UPDATE claim_log SET released_at = clock_timestamp(), outcome = %s WHERE job = %s AND "
                          "image_id = ANY(%s) AND backend_pid = pg_backend_pid() AND released_at IS NULL",
                          (outcome, job, ids))

    def write(self, job: str, outcomes: list[Outcome], keep: bool = False,
              hand_off: str | None = None) -> list[dict[str, Any]]:
        """Write a batch's outcomes in one transaction and one round trip (rows no longer claimed by
        us are skipped). ``keep``: rows that are not dropped become ``kept`` (the last screening job).
        ``hand_off``: the same UPDATE claims the rows it finished that are still in the pipeline for
        that next job (an attempt each, as :meth:`claim` would) and returns them, so a worker
        serving both runs them through without another claim (and without decoding them again)."""
        handed = None
        with self.conn.pipeline(), self.conn.transaction():
            done = [o for o in outcomes if o.error is None]
            failed = [o for o in outcomes if o.error is not None]
            if done:
                handed = self._write_done(job, done, keep, hand_off)
            if failed:
                self._write_failed(job, failed)
        return [] if handed is None else self._rows(handed)

    def _write_done(self, job: str, done: list[Outcome], keep: bool, hand_off: str | None):
        columns = RESULT_COLUMNS[job]
        names = ["id", "drop_reason", "drop_score", "detail", *columns]
        types = ["bigint", "text", "real", "text", *("text" if t in ("jsonb", "integer[]") else t for t in columns.values())]
        arrays = [[o.id for o in done], [o.drop for o in done], [o.score for o in done], [o.detail for o in done]]
        for name, sql_type in columns.items():
            values = [o.values.get(name) for o in done]
            if sql_type == "jsonb":
                values = [None if v is None else json.dumps(v) for v in values]
            elif sql_type == "integer[]":  # unnest flattens arrays of arrays: pass Postgres array text
                values = [None if v is None else "{" + ",".join(str(int(x)) for x in v) + "}" for v in values]
            arrays.append(values)
        sets = [f"{name} = v.{name}::{sql_type}" for name, sql_type in columns.items()]
        kept = "'kept'" if keep else "i.status"
        returning = ""
        if hand_off is not None:
            # A row just finished upstream was never seen by the next job: it is ours to claim
            # unless this job dropped it.
            fresh = f"(v.drop_reason IS NULL AND i.{hand_off}_done_at IS NULL AND i.{hand_off}_claimed_by IS NULL)"
            sets += [f"{hand_off}_last_tried_at = CASE WHEN {fresh} THEN clock_timestamp() ELSE i.{hand_off}_last_tried_at END",
                     f"{hand_off}_attempts = i.{hand_off}_attempts + {fresh}::int",
                     f"{hand_off}_claimed_by = CASE WHEN {fresh} THEN pg_backend_pid() ELSE i.{hand_off}_claimed_by END"]
            returning = (f" RETURNING {', '.join(f'i.{c}' for c in CLAIM_COLUMNS)}, "
                         f"i.{hand_off}_last_tried_at AS claimed_at, i.{hand_off}_claimed_by AS holder")
        update = (f"UPDATE images i SET {''.join(s + ', ' for s in sets)}{job}_done_at = clock_timestamp(), "
                  f"{job}_claimed_by = NULL, {job}_error = v.detail, "
                  f"status = CASE WHEN v.drop_reason IS NOT NULL THEN 'dropped' ELSE {kept} END, "
                  f"drop_reason = coalesce(v.drop_reason, i.drop_reason), drop_score = coalesce(v.drop_score, i.drop_score), "
                  f"drop_job = CASE WHEN v.drop_reason IS NOT NULL THEN '{job}' ELSE i.drop_job END "
                  f"FROM unnest({', '.join(f'%s::{t}[]' for t in types)}) AS v({', '.join(names)}) "
                  f"WHERE i.id = v.id AND i.{job}_claimed_by = pg_backend_pid()")
        self.release_log(job, [o.id for o in done], "done")
        if hand_off is None:
            self.conn.execute(update, arrays)
            return None
        return self.conn.execute(
            f"WITH written AS ({update}{returning}), "
            f"taken AS (SELECT * FROM written WHERE holder = pg_backend_pid()), "
            f"logged AS (INSERT INTO claim_log (job, image_id, worker, backend_pid, claimed_at) "
            f"SELECT '{hand_off}', id, %s, pg_backend_pid(), claimed_at FROM taken WHERE %s) "
            f"SELECT {', '.join(CLAIM_COLUMNS)}, claimed_at FROM taken", [*arrays, self.worker, self.log_claims])

    def _write_failed(self, job: str, failed: list[Outcome]) -> None:
        self.conn.execute(
            f"UPDATE images i SET {job}_error = v.error, {job}_claimed_by = NULL, "
            f"status = CASE WHEN i.{job}_attempts >= %s THEN 'failed' ELSE i.status END, "
            f"drop_reason = CASE WHEN i.{job}_attempts >= %s THEN 'failed:{job}' ELSE i.drop_reason END, "
            f"drop_job = CASE WHEN i.{job}_attempts >= %s THEN '{job}' ELSE i.drop_job END "
            f"FROM unnest(%s::bigint[], %s::text[]) AS v(id, error) "
            f"WHERE i.id = v.id AND i.{job}_claimed_by = pg_backend_pid()",
            (self.queue.max_attempts,) * 3 + ([o.id for o in failed], [o.error for o in failed]))
        self.release_log(job, [o.id for o in failed], "error")

    def waiting(self, jobs: Iterable[str]) -> bool:
        """True while rows for ``jobs`` may still come: a live worker holds rows of these jobs or of
        a job upstream of them, or a row of these jobs waits out its back-off (after an error or a
        dead worker)."""
        jobs = list(jobs)
        upstream: set[str] = set()
        for job in jobs:
            step = UPSTREAM[job]
            while step is not None:
                upstream.add(step)
                step = UPSTREAM[step]
        held = [f"({j}_claimed_by IS NOT NULL AND {_live_claim(j)})" for j in sorted(set(jobs) | upstream)]
        backoff = [f"({j}_done_at IS NULL AND {j}_attempts > 0 AND {j}_attempts < %(max)s AND status = '{_status_of(j)}' "
                   f"AND ({j}_claimed_by IS NULL OR NOT {_live_claim(j)}))" for j in jobs]
        sql = f"SELECT EXISTS (SELECT 1 FROM images WHERE status IN ('pending', 'kept') AND ({' OR '.join(held + backoff)}))"
        return bool(self.conn.execute(sql, {"max": self.queue.max_attempts}).fetchone()[0])

    # -- status -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Counts for ``krea2 curate status``: images, kept, pending, failed, dropped per reason and,
        per job, done / claimable / in_flight / failed / deaths / rows_per_s (over ``rate_window_s``).
        A row whose worker died with no attempt left counts as failed before a worker reaps it."""
        window = self.queue.rate_window_s
        dead = " OR ".join(_dead_exhausted(job) for job in JOBS)
        parts = []
        for job in JOBS:
            parts += [f"count({job}_done_at)", f"count(*) FILTER (WHERE {_claimable(job)})",
                      f"count(*) FILTER (WHERE {job}_claimed_by IS NOT NULL AND {_live_claim(job)})",
                      f"count(*) FILTER (WHERE (status = 'failed' AND drop_job = '{job}') OR {_dead_exhausted(job)})",
                      f"coalesce(sum({job}_deaths), 0) + count(*) FILTER (WHERE {job}_claimed_by IS NOT NULL "
                      f"AND {job}_done_at IS NULL AND NOT {_live_claim(job)})",
                      f"count(*) FILTER (WHERE {job}_done_at > now() - make_interval(secs => %(window)s))"]
        with self.conn.transaction():
            row = self.conn.execute(
                f"SELECT count(*), count(*) FILTER (WHERE status = 'kept' AND NOT ({dead})), "
                f"count(*) FILTER (WHERE status = 'pending' AND NOT ({dead})), "
                f"count(*) FILTER (WHERE status = 'failed' OR {dead}), {', '.join(parts)} FROM images",
                self._params(window=window)).fetchone()
            dropped = dict(self.conn.execute(
                "SELECT drop_reason, count(*) FROM images WHERE status = 'dropped' GROUP BY drop_reason ORDER BY 1").fetchall())
        jobs = {}
        width = 6
        for index, job in enumerate(JOBS):
            done, claimable, in_flight, failed, deaths, recent = row[4 + width * index: 4 + width * (index + 1)]
            jobs[job] = {"done": done, "claimable": claimable, "in_flight": in_flight, "failed": failed,
                         "deaths": int(deaths), "rows_per_s": round(recent / window, 3)}
        return {"images": row[0], "kept": row[1], "pending": row[2], "failed": row[3], "dropped": dropped, "jobs": jobs}


@contextlib.contextmanager
def open_warehouse(db: str | None = None, dsn: str | None = None, store: str | None = None,
                   queue: QueueConfig | None = None, create: bool = False) -> Iterator[Warehouse]:
    """Connect to the warehouse in folder ``db`` (embedded server, started if needed) or at ``dsn``.

    ``create``: initialise or migrate the schema (``init``); otherwise the schema must be current.
    ``store``: folder for files jobs write (embeddings); defaults to ``db``.
    """
    if (db is None) == (dsn is None):
        raise WarehouseError("give exactly one of --db DIR (embedded Postgres) or --dsn postgresql://...")
    server = EmbeddedServer(db, create=create) if db is not None else None
    try:
        conn = connect(server.dsn if server else dsn)
    except BaseException:
        if server is not None:
            server.close()
        raise
    conn.autocommit = True  # every operation opens its own transaction block
    # Commits return without waiting for the WAL flush: a server crash may forget the last moments'
    # results, which only sends those rows back to the queue (every job is idempotent); the data
    # stays consistent. Per batch this saves a disk flush per commit, most of a small batch's time.
    conn.execute("SET synchronous_commit = off")
    where = f"warehouse {db}" if db is not None else "the --dsn database"
    warehouse = Warehouse(conn, where, Path(store or db).resolve() if (store or db) else None, queue or QueueConfig(), server)
    try:
        if create:
            migrate(conn, where)
        else:
            with conn.transaction():
                check_version(conn, where)
        # Every statement from here on is prepared at its first run, not its sixth (psycopg's
        # default): planning a claim's CTEs costs more server time than running it on an empty
        # queue, and a worker repeats a dozen statements. (The migrations above are multi-statement
        # scripts, which cannot be prepared.)
        conn.prepare_threshold = 0
        yield warehouse
    finally:
        warehouse.close()
