"""Where the warehouse lives: an embedded Postgres in a folder (``--db DIR``) or any server (``--dsn``).

The embedded server is the ``pgserver`` wheel's Postgres binaries (no system install, offline),
with its data in ``DIR/pgdata``. Every process using ``DIR`` holds a handle (its pid and start
time in ``DIR/handles.json``, changed under a file lock); the first one starts the server, the
last one to leave stops it. Handles of processes that died (``kill -9``) are pruned, so a crashed
worker never keeps a server alive or stops it under the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import uuid
import warnings
from pathlib import Path
from typing import Iterator

from krea2_diffusers.processes import process_start_time

logger = logging.getLogger(__name__)

DATABASE = "curation"
"""The database an embedded warehouse uses inside its server."""
PGDATA = "pgdata"
HANDLES = "handles.json"
LOCK = ".server.lock"
STOP_TIMEOUT_S = 60


class WarehouseError(RuntimeError):
    """The warehouse cannot be reached or used; the message names the server, database or row."""


def _alive(handle: list) -> bool:
    pid, started, _ = handle
    return process_start_time(pid) == started


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_handles(folder: Path) -> list:
    path = folder / HANDLES
    return [h for h in json.loads(path.read_text()) if _alive(h)] if path.exists() else []


def _write_handles(folder: Path, handles: list) -> None:
    tmp = folder / f".{HANDLES}.tmp"
    tmp.write_text(json.dumps(handles))
    os.replace(tmp, folder / HANDLES)


def _pgserver():
    with warnings.catch_warnings():  # platformdirs warns about an unset XDG_RUNTIME_DIR at import
        warnings.simplefilter("ignore")
        import pgserver
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    return pgserver


def _stop(pgdata: Path) -> None:
    """Fast shutdown (SIGINT to the postmaster, what ``pg_ctl -m fast stop`` sends), waiting for it.

    Signalled directly rather than through pg_ctl: run as root, pg_ctl runs as the server's user,
    which loses access to the data folder when another program tightens a parent's permissions
    (pytest resets /tmp/pytest-of-<user> to 0700 whenever a session starts).
    """
    import psutil

    try:
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        process = psutil.Process(pid)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=STOP_TIMEOUT_S)
    except (OSError, ValueError, IndexError, psutil.Error) as err:  # already stopped
        logger.debug("stopping the server in %s: %s", pgdata, err)


class EmbeddedServer:
    """A handle on the Postgres server of ``folder`` (started if none runs there)."""

    def __init__(self, folder: str | os.PathLike, create: bool = False):
        self.folder = Path(folder).expanduser().resolve()
        pgdata = self.folder / PGDATA
        if not (pgdata / "PG_VERSION").exists() and not create:
            raise WarehouseError(f"no warehouse in {self.folder} (no {PGDATA}/); create it with "
                                 f"`krea2 curate init --db {self.folder}`")
        self.folder.mkdir(parents=True, exist_ok=True)
        pgserver = _pgserver()
        # pid + start time tell a live process from a dead one whose pid was reused; the token tells
        # apart several handles of one process (a test session and the commands it runs in-process).
        me = [os.getpid(), process_start_time(os.getpid()), uuid.uuid4().hex]
        with _locked(self.folder):
            self._server = pgserver.get_server(pgdata, cleanup_mode=None)
            handles = [h for h in _read_handles(self.folder) if h != me] + [me]
            _write_handles(self.folder, handles)
        self._handle = me
        self.dsn = self._server.get_uri(DATABASE)
        self._ensure_database()

    def uri(self, database: str) -> str:
        """Connection URI of another database on this server (tests give each case its own)."""
        return self._server.get_uri(database)

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(self._server.get_uri("postgres"), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                try:
                    conn.execute(f'CREATE DATABASE "{DATABASE}"')
                except psycopg.errors.DuplicateDatabase:  # another process created it meanwhile
                    pass

    def close(self) -> None:
        """Drop this process's handle; the last live handle stops the server."""
        if self._handle is None:
            return
        with _locked(self.folder):
            handles = [h for h in _read_handles(self.folder) if h != self._handle]
            _write_handles(self.folder, handles)
            if not handles:
                _stop(self.folder / PGDATA)
        self._handle = None


def connect(dsn: str):
    """A psycopg connection to ``dsn``; a refused or failed connection raises :class:`WarehouseError`
    naming the host, port and database (never a driver traceback)."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as err:
        raise WarehouseError(f"invalid --dsn {dsn!r}: {err}") from None
    try:
        return psycopg.connect(dsn, connect_timeout=10)
    except psycopg.OperationalError as err:
        host = params.get("host") or "localhost"
        where = f"host {host} port {params.get('port') or 5432}, database {params.get('dbname') or params.get('user') or '?'}"
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise WarehouseError(f"cannot connect to Postgres at {where}: {reason}") from None
