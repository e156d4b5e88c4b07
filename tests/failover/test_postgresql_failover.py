"""PostgreSQL failover (issue 16 item 4): a primary and a streaming replica, both local; the
primary is killed (SIGKILL) and the replica promoted while a holder keeps its leases.

latchkey reaches whichever host is the primary through a multi-host URL as libpq reads it
(``postgresql://h1,h2/db?target_session_attrs=read-write``) and reconnects by itself. With
synchronous replication, no acknowledged lease and no token is lost: the holder still holds,
nobody else can take its names, and the new primary's tokens are above every token given
before. With asynchronous replication the leases acknowledged in the replication lag can be
lost; the test measures how many of a burst right before the kill were, and what the page
(docs/concepts/guarantees.md) says about it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import latchkey
from tests.failover import first_grant_after
from tests.helpers import eventually
from tests.servers import RunningServer, ServerUnavailable, wait_port_closed
from tests.servers import postgresql as pg

pytestmark = pytest.mark.skipif(
    "postgresql" not in os.environ.get("LATCHKEY_TEST_STORES", "postgresql").split(","),
    reason="postgresql not selected by LATCHKEY_TEST_STORES",
)


@contextlib.contextmanager
def pair(tmp_path: Path, synchronous: bool) -> Iterator[tuple[RunningServer, RunningServer]]:
    try:
        primary = pg.start(tmp_path / "primary")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL here: {exc}")
    replica = None
    try:
        replica = pg.start_replica(primary, tmp_path / "replica")
        with psycopg.connect(primary.url, autocommit=True) as sql:
            if synchronous:
                sql.execute("ALTER SYSTEM SET synchronous_standby_names = 'replica1'")
                sql.execute("SELECT pg_reload_conf()")
            want = "sync" if synchronous else "async"

            def streaming() -> bool:
                row = sql.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = "
                    "'replica1' AND state = 'streaming'"
                ).fetchone()
                return row is not None and row[0] == want

            eventually(streaming, timeout=30, what=f"the replica streaming ({want})")
        yield primary, replica
    finally:
        for server in (replica, primary):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()


def url_of(primary: RunningServer, replica: RunningServer, table: str) -> str:
    return (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{replica.port}/postgres"
        f"?target_session_attrs=read-write&table={table}&timeout=2s"
    )


def kill_and_promote(primary: RunningServer, replica: RunningServer) -> float:
    """SIGKILL the primary's postmaster and its children; promote the replica. Returns the
    monotonic time of the kill."""
    killed = time.monotonic()
    for pid in primary.processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_port_closed(primary.port)
    pg.promote(replica)
    return killed


def test_with_synchronous_replication_no_lease_and_no_token_is_lost(tmp_path: Path) -> None:
    table = f"t_{uuid.uuid4().hex[:8]}"
    with pair(tmp_path, synchronous=True) as (primary, replica):
        url = url_of(primary, replica, table)
        with latchkey.connect(url) as holder, latchkey.connect(url) as other:
            locks = [holder.lock(f"held:{i}", ttl="120s") for i in range(20)]
            for lock in locks:
                assert lock.acquire(wait=0)
            tokens = {lock.name: lock.token for lock in locks}
            killed = kill_and_promote(primary, replica)
            resumed = first_grant_after(other, "after:failover")
            print(f"\nsynchronous: grants resumed {resumed - killed:.2f} s after the kill")
            for lock in locks:  # every acknowledged lease survived, still its holder's
                info = other.inspect(lock.name)
                assert info is not None and info.token == tokens[lock.name]
                assert other.lock(lock.name, ttl="30s").acquire(wait=0) is False
                lock.extend()  # the holder renews it on the new primary
            fresh = other.lock("after:tokens", ttl="30s")
            assert fresh.acquire(wait=0)
            assert fresh.token is not None and fresh.token > max(tokens.values())
            for lock in locks:
                assert lock.release()


def test_with_asynchronous_replication_the_store_follows_the_new_primary(tmp_path: Path) -> None:
    """What asynchronous replication keeps is not promised: the leases acknowledged in the
    replication lag may be lost, and their tokens given again. Measured, not asserted: the
    test asserts only that latchkey finds the new primary by itself and serves it."""
    table = f"t_{uuid.uuid4().hex[:8]}"
    with pair(tmp_path, synchronous=False) as (primary, replica):
        url = url_of(primary, replica, table)
        with latchkey.connect(url) as holder, latchkey.connect(url) as other:
            burst = [holder.lock(f"burst:{i}", ttl="120s") for i in range(200)]
            for lock in burst:  # acknowledged, as fast as one client goes, up to the kill
                assert lock.acquire(wait=0)
            killed = kill_and_promote(primary, replica)
            resumed = first_grant_after(other, "after:failover")
            lost = sum(other.inspect(lock.name) is None for lock in burst)
            print(f"\nasynchronous: grants resumed {resumed - killed:.2f} s after the kill; "
                  f"{lost} of the last {len(burst)} acknowledged leases lost")  # fmt: skip
            assert other.lock("after:again", ttl="30s").acquire(wait=0)
