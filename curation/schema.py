"""The warehouse schema, created and migrated by the tool (versioned, forward only).

One ``images`` table holds every image's probe results, each job's result columns and its queue
state (``<job>_done_at``, ``<job>_last_tried_at``, ``<job>_attempts``, ``<job>_error``,
``<job>_claimed_by``, ``<job>_deaths``), the final ``status`` and the reason an image was dropped. A database whose
schema is newer than this code is refused: an old worker must never write rows it does not understand.
"""

from __future__ import annotations

from .hash_index import KEY_COLUMNS, backfill, rekey
from .server import WarehouseError

JOBS = ("probe", "filter", "dedup", "caption", "embed", "cluster")
"""Every job, in pipeline order."""
UPSTREAM = {"probe": None, "filter": "probe", "dedup": "filter", "caption": "dedup", "embed": "dedup", "cluster": "embed"}
"""The job whose result a job reads: a row is claimable for a job once its upstream job is done."""
SCREENING = ("probe", "filter", "dedup")
"""Jobs that decide whether an image is kept; they serve ``pending`` rows, the others ``kept`` rows."""
STATUSES = ("pending", "kept", "dropped", "failed")

# Any fixed 64-bit number: the key of the transaction lock that serialises schema migrations.
MIGRATION_LOCK = 0x6B72656132_01


def _job_columns(job: str) -> str:
    return (f"{job}_done_at timestamptz, {job}_last_tried_at timestamptz, "
            f"{job}_attempts integer NOT NULL DEFAULT 0, {job}_error text, {job}_claimed_by integer")


def _job_index(job: str) -> str:
    # The claim query's order, restricted to rows still waiting for the job: stays small as rows finish.
    return (f"CREATE INDEX images_{job}_queue ON images ({job}_last_tried_at NULLS FIRST, id) "
            f"WHERE {job}_done_at IS NULL AND status IN ('pending', 'kept');")


_V1 = f"""
CREATE TABLE images (
    id bigserial PRIMARY KEY,
    uri text NOT NULL UNIQUE,
    source_text text,
    ingested_at timestamptz NOT NULL DEFAULT now(),
    md5 text, size_bytes bigint, format text, width integer, height integer,
    filter_scores jsonb, phash bytea, colour_hash bytea,
    dedup_group bigint, duplicate_of bigint, dedup_seq bigint, dedup_distance real,
    caption_long text, caption_medium text, caption_short text,
    embedding_path text, embedding_row integer,
    cluster_ids integer[], semantic_duplicate_of bigint,
    status text NOT NULL DEFAULT 'pending' CHECK (status IN {STATUSES!r}),
    drop_reason text, drop_score real, drop_job text,
    {', '.join(_job_columns(job) for job in JOBS)}
);
CREATE INDEX images_md5 ON images (md5);
CREATE INDEX images_dedup_seq ON images (dedup_seq) WHERE dedup_seq IS NOT NULL;
CREATE INDEX images_status ON images (status, drop_reason);
{' '.join(_job_index(job) for job in JOBS)}
CREATE SEQUENCE dedup_seq;
CREATE TABLE claim_log (
    id bigserial PRIMARY KEY, job text NOT NULL, image_id bigint NOT NULL, worker text NOT NULL,
    backend_pid integer NOT NULL, claimed_at timestamptz NOT NULL, released_at timestamptz, outcome text
);
CREATE INDEX claim_log_image ON claim_log (job, image_id);
CREATE TABLE cluster_models (
    id serial PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now(), levels integer[] NOT NULL,
    num_embeddings integer NOT NULL, centroids bytea NOT NULL, semantic_duplicates jsonb NOT NULL
);
"""

def _status_queue_index(job: str, upstream_done: bool = False) -> str:
    # A queue index only on the rows the job serves (pending for screening, kept after it): a row
    # update inserts into every index whose predicate holds, so a pending row feeds 3 of them, not 6.
    # ``upstream_done`` (version 3): only rows whose upstream job is done, so a claim that finds
    # nothing reads the few rows in flight, not every row still waiting upstream.
    status = "pending" if job in SCREENING else "kept"
    ready = f" AND {UPSTREAM[job]}_done_at IS NOT NULL" if upstream_done and UPSTREAM[job] else ""
    return (f"DROP INDEX images_{job}_queue; CREATE INDEX images_{job}_queue ON images ({job}_last_tried_at NULLS FIRST, id) "
            f"WHERE {job}_done_at IS NULL AND status = '{status}'{ready};")


_V2 = f"""
ALTER TABLE images ADD COLUMN thumbnail bytea,
    {', '.join(f'ADD COLUMN {job}_deaths integer NOT NULL DEFAULT 0' for job in JOBS)};
{' '.join(_status_queue_index(job) for job in JOBS)}
"""
"""Version 2: the alignment thumbnail of near-duplicate verification (a filter result), per job
the number of workers that died holding the row (each one also counted an attempt), and queue
indexes restricted to the status each job serves."""

_V3 = " ".join(_status_queue_index(job, upstream_done=True) for job in JOBS if UPSTREAM[job])
"""Version 3: a job's queue index holds only rows its upstream job finished. Before, the filter
queue listed every unprobed row first (never tried for filter), so each claim that found nothing
(the usual case: probe hands its rows to filter directly) read the whole table, three times."""

_V4 = f"""
ALTER TABLE images ADD COLUMN phash_weak bytea, ADD COLUMN phash_bits varbit, ADD COLUMN shard_duplicate_of text,
    {', '.join(f'ADD COLUMN {c} integer' for c in KEY_COLUMNS)};
{' '.join(f'CREATE INDEX images_{c} ON images ({c}) INCLUDE (id, phash_bits) WHERE {c} IS NOT NULL;' for c in KEY_COLUMNS)}
CREATE INDEX images_dedup_group ON images (dedup_group) WHERE dedup_group IS NOT NULL;
CREATE TABLE curation_shard (id uuid NOT NULL);
INSERT INTO curation_shard (id) VALUES (gen_random_uuid());
CREATE TABLE shard_progress (peer uuid PRIMARY KEY, last_id bigint NOT NULL);
"""
"""Version 4: the near-duplicate candidate index in the warehouse (curation/hash_index.py: pHash
substring keys, set when dedup places a row; ``phash_weak``, a filter result: the bits a copy is
likely to flip, which the query probes) and the group index that finds a group's members;
rows placed before get their keys (:func:`~curation.hash_index.backfill`); for ``dedup-shards``
(curation/shards.py) the warehouse's own id, the progress of its comparison with each peer, and
``shard_duplicate_of`` (the kept copy in another shard)."""

_V5 = f"""
ALTER TABLE images ADD COLUMN crop_windows bytea;
CREATE TABLE image_windows (id bigint NOT NULL, crop smallint NOT NULL, phash_bits varbit NOT NULL,
    {', '.join(f'{c} integer NOT NULL' for c in KEY_COLUMNS)}, PRIMARY KEY (id, crop));
{' '.join(f'CREATE INDEX image_windows_{c} ON image_windows ({c}) INCLUDE (id, crop, phash_bits);' for c in KEY_COLUMNS)}
"""
"""Version 5: crop windows (curation/windows.py), the second near-duplicate candidate source:
``crop_windows`` (a filter result: each centred window's pHash, weak bits and colour hash) and
``image_windows``, the windows' hashes under the same multi-index keys, one row a window, written
by the row's dedup batch before it looks for candidates. Rows filtered before it have no windows: they match by full frame only."""

_V6 = ""
"""Version 6: 26-bit index keys (issue 42: with 24 bits a query met 3,648 x rows / 2**24 rows by
chance, ~2,200 at 1e7, which doubled the per-image cost from 1e5 to 1e7) and 14 ranked weak bits a
key (curation/hash_index.py); :func:`~curation.hash_index.rekey` rewrites every stored key from the
hash bits (one UPDATE of each indexed row: time and a table's worth of dead rows, which autovacuum
takes back). ``phash_weak`` and the windows' weak bits stored before (6 a key) stay as they are and
are read through :func:`~curation.hash_index.ranked_weak`."""

MIGRATIONS = (_V1, _V2, _V3, (_V4, backfill), _V5, (_V6, rekey))
"""MIGRATIONS[i] takes a database from schema version i to i + 1: a script, or a script and then a
function of the connection (work SQL alone cannot do)."""
SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn) -> int:
    """The database's schema version (0: never initialised)."""
    exists = conn.execute("SELECT to_regclass('curation_schema') IS NOT NULL").fetchone()[0]
    if not exists:
        return 0
    row = conn.execute("SELECT version FROM curation_schema").fetchone()
    return row[0] if row else 0


def check_version(conn, where: str) -> None:
    """Refuse a database that is not initialised, or whose schema is newer than this code."""
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        raise WarehouseError(f"{where} has curation schema version {version}, newer than this krea2 "
                             f"(version {SCHEMA_VERSION}); upgrade krea2-diffusers to use it")
    if version == 0:
        raise WarehouseError(f"{where} holds no curation warehouse; create it with `krea2 curate init`")
    if version < SCHEMA_VERSION:
        raise WarehouseError(f"{where} has curation schema version {version}; run `krea2 curate init` to migrate "
                             f"it to version {SCHEMA_VERSION}")


def migrate(conn, where: str) -> tuple[int, int]:
    """Bring the schema to :data:`SCHEMA_VERSION`; returns (version before, version after)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS curation_schema (version integer NOT NULL)")
        before = schema_version(conn)
        if before > SCHEMA_VERSION:
            raise WarehouseError(f"{where} has curation schema version {before}, newer than this krea2 "
                                 f"(version {SCHEMA_VERSION}); refusing to touch it")
        for version in range(before, SCHEMA_VERSION):
            script, *then = MIGRATIONS[version] if isinstance(MIGRATIONS[version], tuple) else (MIGRATIONS[version],)
            if script:
                conn.execute(script)
            for step in then:
                step(conn)
        conn.execute("DELETE FROM curation_schema")
        conn.execute("INSERT INTO curation_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
    return before, SCHEMA_VERSION
