"""The curation tests' one embedded Postgres (pgserver) and their helpers.

Every curation test module takes the ``server`` fixture from here: the first one starts the server,
the others reuse it, the last one to finish stops it. Each case that needs a clean warehouse gets
its own database on it (``--dsn``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psycopg
import pytest

from curation.server import EmbeddedServer

FAST_QUEUE = "queue: {max_attempts: 2, backoff_s: 0.0, poll_s: 0.1}\n"
REPO = Path(__file__).resolve().parents[1]
_SHARED: dict = {"users": 0}


@pytest.fixture(scope="session")
def server():
    if not _SHARED["users"]:
        # Not under pytest's tmp_path: run as root, Postgres runs as another user that must traverse
        # the parents, and every pytest session resets /tmp/pytest-of-<user> to 0700.
        _SHARED["folder"] = Path(tempfile.mkdtemp(prefix="krea2-curation-"))
        _SHARED["server"] = EmbeddedServer(_SHARED["folder"] / "db", create=True)
    _SHARED["users"] += 1
    yield _SHARED["server"]
    _SHARED["users"] -= 1
    if not _SHARED["users"]:
        _SHARED.pop("server").close()
        shutil.rmtree(_SHARED.pop("folder"), ignore_errors=True)


def database(server, name: str) -> str:
    """A fresh database ``name`` on the test server; returns its DSN."""
    with psycopg.connect(server.uri("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.uri(name)


def query(dsn: str, sql: str, params=()) -> list[dict]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(sql, params)
        names = [d.name for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
