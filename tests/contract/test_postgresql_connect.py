"""Opening a PostgreSQL connection within the timeout, whatever the hosts (issue 14 item 2).

Hung hosts are fault proxies in blackhole mode (tests/faults/proxy.py): they accept TCP and
forward nothing, a host that answers nothing. Each test runs the sync and the asyncio API, on
both PostgreSQL stores: the call raises StoreUnavailable within the timeout (+ 0.5 s of slack),
and a live host behind a hung one is reached within it.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

import latchkey
from latchkey import StoreUnavailable
from tests.conftest import ServerPool
from tests.faults.proxy import Proxy
from tests.helpers import skip_or_fail
from tests.servers import RunningServer, ServerUnavailable
from tests.servers.postgresql import start as start_postgresql

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and not _selected & {"postgresql", "postgresql+advisory"}:
    pytest.skip("no PostgreSQL row is selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

KINDS = ["postgresql", "postgresql+advisory"]
APIS = ["sync", "asyncio"]
SLACK = 0.5


@pytest.fixture
def pg_port(server_pool: ServerPool) -> int:
    """The shared server's port (127.0.0.1, user and database postgres)."""
    try:
        url = server_pool.base_url("postgresql")
    except ServerUnavailable as exc:
        skip_or_fail("postgresql", str(exc))
        raise AssertionError("unreachable") from exc
    port = urlsplit(url).port
    assert port is not None
    return port


@pytest.fixture
def hung(pg_port: int) -> Iterator[list[Proxy]]:
    """Two hosts that accept and never answer (proxies to the shared server, blackholed)."""
    proxies = [Proxy("127.0.0.1", pg_port) for _ in range(2)]
    for proxy in proxies:
        proxy.set("blackhole")
    yield proxies
    for proxy in proxies:
        proxy.close()


def _url(kind: str, ports: list[int], timeout: str, query: str = "") -> str:
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    secret = f"pw-{uuid.uuid4().hex[:8]}"
    return f"{kind}://postgres:{secret}@{hosts}/postgres?timeout={timeout}{query}"


def _acquire(url: str, flavour: str) -> tuple[float, BaseException | None]:
    """One ``acquire(wait=0)`` of a fresh store (so it opens a connection): how long it took
    and what it raised (None: it acquired, and released)."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    if flavour == "sync":
        with latchkey.connect(url) as store:
            lock = store.lock(name, ttl="30s", wait=0)
            started = time.monotonic()
            try:
                assert lock.acquire()
            except StoreUnavailable as exc:
                return time.monotonic() - started, exc
            took = time.monotonic() - started
            lock.release()
            return took, None

    async def main() -> tuple[float, BaseException | None]:
        async with latchkey.connect_async(url) as store:
            lock = store.lock(name, ttl="30s", wait=0)
            started = time.monotonic()
            try:
                assert await lock.acquire()
            except StoreUnavailable as exc:
                return time.monotonic() - started, exc
            took = time.monotonic() - started
            await lock.release()
            return took, None

    return asyncio.run(main())


@pytest.mark.parametrize("flavour", APIS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2])
def test_hung_hosts_are_unavailable_within_the_timeout(
    hung: list[Proxy], kind: str, flavour: str, count: int
) -> None:
    """One or two hosts that accept and never answer, ``timeout=1s``: StoreUnavailable within
    1.5 s (it took 2 s for one host and 4 s for two while psycopg's connect gave each host its
    own connect_timeout of at least 2 s), naming every host tried and no password."""
    ports = [proxy.port for proxy in hung[:count]]
    url = _url(kind, ports, "1s")
    took, error = _acquire(url, flavour)
    assert isinstance(error, StoreUnavailable), f"acquired through {count} hung hosts"
    assert took < 1.0 + SLACK, f"{took:.2f}s to report {count} hung host(s) at timeout=1s"
    text = str(error)
    assert all(str(port) in text for port in ports), text
    assert "no answer within" in text and url.split(":")[2].split("@")[0] not in text


@pytest.mark.parametrize("flavour", APIS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_live_host_behind_a_hung_one_is_reached(
    hung: list[Proxy], pg_port: int, kind: str, flavour: str
) -> None:
    """A hung first host does not starve a live second one: with ``timeout=2s`` the first has
    its fair share, half, and the call succeeds on the second within about 1 s
    (target_session_attrs as the failover setups give it: the live host is a primary). It
    took 2 s while psycopg's connect gave the first host a whole connect_timeout."""
    url = _url(kind, [hung[0].port, pg_port], "2s", "&target_session_attrs=read-write")
    took, error = _acquire(url, flavour)
    assert error is None, f"{error} ({took:.2f}s)"
    assert took < 2.0 / 2 + SLACK, f"{took:.2f}s to reach the second host"


@pytest.fixture
def read_only_server(tmp_path: Path) -> Iterator[RunningServer]:
    """A private server whose sessions are read-only (``default_transaction_read_only``): to
    libpq's ``target_session_attrs=read-write`` check, a standby."""
    try:
        server = start_postgresql(tmp_path / "pg")
    except ServerUnavailable as exc:
        skip_or_fail("postgresql", str(exc))
        raise AssertionError("unreachable") from exc
    try:
        with psycopg.connect(server.url, autocommit=True) as sql:
            sql.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            sql.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("flavour", APIS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_read_only_first_host_is_passed_over_for_read_write(
    read_only_server: RunningServer, pg_port: int, kind: str, flavour: str
) -> None:
    """libpq still checks ``target_session_attrs`` on each host latchkey tries: a first host
    that is not read-write fails its attempt at once and the second, writable one, is used."""
    ro_port = urlsplit(read_only_server.url).port
    assert ro_port is not None
    url = _url(kind, [ro_port, pg_port], "2s", "&target_session_attrs=read-write")
    took, error = _acquire(url, flavour)
    assert error is None, f"{error} ({took:.2f}s)"
    assert took < 2.0, f"{took:.2f}s"
    only = _url(kind, [ro_port], "2s", "&target_session_attrs=read-write")
    _, error = _acquire(only, flavour)
    assert isinstance(error, StoreUnavailable) and "read-only" in str(error), error


@pytest.mark.parametrize("flavour", APIS)
@pytest.mark.parametrize("kind", KINDS)
def test_host_names_are_resolved_and_one_that_does_not_resolve_is_passed_over(
    pg_port: int, kind: str, flavour: str
) -> None:
    """Host names are looked up before connecting (the asyncio API on the loop's resolver): a
    name that does not resolve fails its attempt, named in the error if every host failed,
    and ``localhost`` reaches the server."""
    url = (f"{kind}://postgres@nohost.invalid:{pg_port},localhost:{pg_port}/postgres"
           "?timeout=2s")  # fmt: skip
    took, error = _acquire(url, flavour)
    assert error is None, f"{error} ({took:.2f}s)"
    _, error = _acquire(f"{kind}://postgres@nohost.invalid:{pg_port}/postgres?timeout=2s", flavour)
    assert isinstance(error, StoreUnavailable), error
    assert "nohost.invalid" in str(error) and "resolve" in str(error), error
