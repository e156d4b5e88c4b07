"""The event-queue how-to (docs/howto/event-queue-daemons.md) runs on every store it claims.

test_docs.py runs each how-to once, on SQLite. This page promises PostgreSQL and MariaDB too,
so its runnable blocks (the same program test_docs.py builds) run here once per store, against
the test servers, each time in a database of its own (SQLite: a fresh file). The program
fails if the page's code breaks or its exactly-once checks do not hold.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests import servers
from tests.acceptance.test_docs import DOCS, run_examples, script_for

PAGE = DOCS / "howto" / "event-queue-daemons.md"
STORES = ["postgresql", "mysql", "sqlite"]
_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s.strip()}


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, "", ""))


@pytest.fixture
def events_url(
    request: pytest.FixtureRequest, server_pool: object, tmp_path: Path
) -> Iterator[str]:
    """LATCHKEY_URL for the page: a database of its own on the store's test server."""
    store: str = request.param
    if _selected and store not in _selected:
        pytest.skip(f"{store}: not selected by LATCHKEY_TEST_STORES")
    if store == "sqlite":
        yield f"sqlite:///{tmp_path}/app.db"
        return
    try:
        base = server_pool.base_url(store)  # type: ignore[attr-defined]
    except servers.ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{store}: server required in CI but unavailable: {exc}")
        pytest.skip(f"{store}: not run: {exc}")
    database = f"howto_{uuid.uuid4().hex[:12]}"
    if store == "postgresql":
        import psycopg

        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        try:
            yield _with_database(base, database)
        finally:
            with psycopg.connect(base, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        return
    import pymysql

    parts = urlsplit(base)
    admin = pymysql.connect(host=parts.hostname, port=parts.port, user=parts.username or "root",
                            password=parts.password or "", autocommit=True)  # fmt: skip
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {database}")
        yield _with_database(base, database)
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {database}")
        admin.close()


@pytest.mark.parametrize("events_url", STORES, indirect=True)
def test_event_queue_howto_runs(events_url: str, tmp_path: Path) -> None:
    label = f"{PAGE.name} on {events_url.split(':', 1)[0]}"
    result = run_examples(script_for(PAGE), tmp_path, events_url, label)
    assert "200 events processed, 200 distinct" in result.stdout
    assert "0 events left" in result.stdout  # lease + complete marked every new event
