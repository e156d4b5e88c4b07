"""TLS for Redis behind Sentinel (``rediss+sentinel://``) and on a Redis Cluster
(``rediss+cluster://``), against real servers that serve TLS and ask for a client certificate:
the sentinels, the master (and after a failover the promoted replica), every cluster node and
the pub/sub listeners are reached over TLS with the URL's options, in the sync and the asyncio
API; a certificate the server or the client refuses is StoreUnavailable saying so.

Each server serves TLS on a port of its own and keeps its plain port for the readiness check
and the tests' admin connections (CLIENT LIST); the URLs name only TLS ports, and the servers
name TLS ports to clients that came over TLS (the sentinel the master's, a node the others'),
so every connection latchkey makes is over TLS or fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

import latchkey
from latchkey import StoreUnavailable
from tests.helpers import eventually
from tests.servers import RunningServer, ServerUnavailable
from tests.servers import redis_cluster as cluster_server
from tests.servers import redis_sentinel as sentinel_server
from tests.servers.redis import CLIENT_KEY_PASSWORD

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
CLUSTER = not _selected or "redis+cluster" in _selected
SENTINEL = not _selected or "redis+sentinel" in _selected
if not (CLUSTER or SENTINEL):
    pytest.skip("no redis+cluster/redis+sentinel row selected", allow_module_level=True)
needs_cluster = pytest.mark.skipif(not CLUSTER, reason="redis+cluster row not selected")
needs_sentinel = pytest.mark.skipif(not SENTINEL, reason="redis+sentinel row not selected")


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"redis TLS: servers required in CI but unavailable: {reason}")
    pytest.skip(f"not run: {reason}")


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A master, its replica and a sentinel, all serving TLS with client certificates."""
    try:
        setup = sentinel_server.start_setup(tmp_path_factory.mktemp("sentinel-tls"), tls=True)
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    yield setup
    setup.stop()


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Three masters serving TLS with client certificates, the cluster bus over TLS too."""
    try:
        cluster = cluster_server.start_cluster(tmp_path_factory.mktemp("cluster-tls"), tls=True)
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    yield cluster
    cluster.stop()


def _tls_url(server: RunningServer, *, without: str = "", **more: str) -> str:
    """The server's ``rediss+…`` URL with redis-py's TLS options (the client key encrypted,
    its password given), a client name of its own, a timeout and a key prefix; ``without``:
    one option left out (``ssl_certfile`` takes the key and its password with it)."""
    files: dict[str, Path] = server.extra["files"]  # type: ignore[assignment]
    options = {
        "ssl_ca_certs": str(files["ca.pem"]),
        "ssl_certfile": str(files["client.pem"]),
        "ssl_keyfile": str(files["client-enc.key"]),
        "ssl_password": CLIENT_KEY_PASSWORD,
        "client_name": f"tls-{uuid.uuid4().hex[:8]}",
        "timeout": "3s",
        "prefix": f"t{uuid.uuid4().hex[:8]}:",
        **more,
    }
    dropped = {without} | ({"ssl_keyfile", "ssl_password"} if without == "ssl_certfile" else set())
    query = "&".join(f"{k}={v}" for k, v in options.items() if k not in dropped)
    return f"{server.url}?{query}"


def _client_name(url: str) -> str:
    return url.split("client_name=", 1)[1].split("&", 1)[0]


def _commands(plain_ports: list[int], client_name: str) -> set[tuple[int, str]]:
    """(port, command) of the connections called ``client_name`` on the given servers, read
    over their plain ports."""
    found = set()
    for port in plain_ports:
        with redis.Redis(port=port, decode_responses=True) as admin:
            found |= {(port, c["cmd"]) for c in admin.client_list() if c["name"] == client_name}
    return found


def _master_plain_port(setup: RunningServer) -> int:
    """The plain port of the server the sentinel names master now (it names the TLS port)."""
    tls_ports: dict[str, int] = setup.extra["tls_ports"]  # type: ignore[assignment]
    ports: dict[str, int] = setup.extra["ports"]  # type: ignore[assignment]
    named = sentinel_server.master_of(ports["sentinel"])
    return next(ports[role] for role, port in tls_ports.items() if port == named)


def _woken_over_tls(
    store: latchkey.Store, name: str, listening: Callable[[], bool]
) -> None:
    """A waiter blocks on a held lock (its listener subscribed over TLS: ``listening``), and
    the release wakes it."""
    holder = store.lock(name, ttl="30s", wait=0)
    assert holder.acquire()
    got: list[bool] = []
    waiter = threading.Thread(
        target=lambda: got.append(store.lock(name, ttl="30s", wait="20s").acquire())
    )
    waiter.start()
    try:
        eventually(listening, timeout=10, what="the waiter's listener subscribed over TLS")
        assert holder.release()
    finally:
        waiter.join()
    assert got == [True]


# -- Sentinel ----------------------------------------------------------------------------------


@needs_sentinel
def test_a_rediss_sentinel_url_reaches_the_sentinel_and_the_master_over_tls(
    tls_sentinel: RunningServer, connect: Callable[[str], latchkey.Store]
) -> None:
    url = _tls_url(tls_sentinel)
    master = _master_plain_port(tls_sentinel)
    name = _client_name(url)
    store = connect(url)
    try:
        with store.lock("tls", ttl="10s", wait=0) as lock:
            assert lock.token is not None and store.inspect("tls") is not None
        assert (master, "evalsha") in _commands([master], name)  # client_name reached it

        def listening() -> bool:
            return (master, "subscribe") in _commands([master], name)

        _woken_over_tls(store, "tls:wait", listening)
        for shown in (repr(store), store.url):
            assert CLIENT_KEY_PASSWORD not in shown
    finally:
        store.close()


@needs_sentinel
def test_a_borrowed_sentinel_with_tls_is_followed_over_tls(
    tls_sentinel: RunningServer, api: str
) -> None:
    """The application's Sentinel, TLS to the sentinels (``sentinel_kwargs``) and to the
    master (``ssl=True`` and its options): latchkey's own connections use the same."""
    files: dict[str, Path] = tls_sentinel.extra["files"]  # type: ignore[assignment]
    tls: dict[str, Any] = {
        "ssl": True,
        "ssl_ca_certs": str(files["ca.pem"]),
        "ssl_certfile": str(files["client.pem"]),
        "ssl_keyfile": str(files["client-enc.key"]),
        "ssl_password": CLIENT_KEY_PASSWORD,
    }
    sentinels = [("127.0.0.1", tls_sentinel.extra["tls_ports"]["sentinel"])]  # type: ignore[index]
    service, prefix = sentinel_server.SERVICE, f"t{uuid.uuid4().hex[:8]}:"

    if api == "sync":
        app = redis.sentinel.Sentinel(sentinels, sentinel_kwargs=tls, **tls)
        with latchkey.connect(client=app, service=service, prefix=prefix) as store:
            assert store.url.startswith(f"rediss+sentinel://127.0.0.1:{sentinels[0][1]}/")
            assert store.lock("borrowed", ttl="10s", wait=0).acquire()
            assert CLIENT_KEY_PASSWORD not in store.url
        app.close()
        return

    async def body() -> None:
        app = redis.asyncio.sentinel.Sentinel(sentinels, sentinel_kwargs=tls, **tls)
        async with latchkey.connect_async(client=app, service=service, prefix=prefix) as store:
            assert store.url.startswith("rediss+sentinel://")
            assert await store.lock("borrowed", ttl="10s", wait=0).acquire()
        await app.aclose()

    asyncio.run(body())


@needs_sentinel
def test_over_tls_the_store_follows_a_failover_to_the_promoted_replica(
    tmp_path: Path,
) -> None:
    """The sentinel is told to fail over (SENTINEL FAILOVER): it promotes the replica over
    TLS and names its TLS port; the sync and the asyncio stores, opened before, carry on
    against it (a call may meet the old master, now a replica: StoreUnavailable, then the next
    connection asks the sentinel again)."""
    try:
        setup = sentinel_server.start_setup(tmp_path / "sentinel-tls", tls=True)
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    ports: dict[str, int] = setup.extra["ports"]  # type: ignore[assignment]
    tls_ports: dict[str, int] = setup.extra["tls_ports"]  # type: ignore[assignment]
    try:
        url = _tls_url(setup)
        store = latchkey.connect(url)
        assert _try(store, "before")
        with redis.Redis(port=ports["sentinel"], decode_responses=True) as sentinel:
            eventually(
                lambda: any(r.get("master-link-status") == "ok"
                            for r in sentinel.sentinel_slaves(sentinel_server.SERVICE)),
                timeout=30, what="the sentinel knows the replica, in sync",
            )  # fmt: skip
            sentinel.execute_command("SENTINEL", "FAILOVER", sentinel_server.SERVICE)
        eventually(
            lambda: sentinel_server.master_of(ports["sentinel"]) == tls_ports["replica"],
            timeout=60, what="the sentinel promoted the replica",
        )  # fmt: skip
        eventually(lambda: _try(store, "after"), timeout=30, what="grants on the new master")
        with redis.Redis(port=ports["replica"], decode_responses=True) as promoted:
            assert promoted.info("replication")["role"] == "master"
            assert promoted.keys(f"{url.split('prefix=')[1].split('&')[0]}*")  # the fence
        store.close()

        async def async_side() -> None:
            async with latchkey.connect_async(url) as astore:
                lock = astore.lock("async", ttl="10s", wait=0)
                assert await lock.acquire()
                await lock.release()

        asyncio.run(async_side())
    finally:
        setup.stop()


def _try(store: latchkey.Store, name: str) -> bool:
    with contextlib.suppress(StoreUnavailable):
        lock = store.lock(name, ttl="30s", wait=0)
        if lock.acquire():
            lock.release()
            return True
    return False


# -- Cluster -----------------------------------------------------------------------------------


@needs_cluster
def test_a_rediss_cluster_url_reaches_every_node_over_tls(
    tls_cluster: RunningServer, connect: Callable[[str], latchkey.Store]
) -> None:
    """A claim spread over every master, a listing of every master and a waiter woken by
    sharded pub/sub, all over TLS; the client name reached each master's connections."""
    url = _tls_url(tls_cluster)
    masters = list(tls_cluster.extra["nodes"])  # type: ignore[call-overload]
    name = _client_name(url)
    store = connect(url)
    try:
        names = [f"c:{i}" for i in range(60)]  # 60 names: slots on all three masters
        with store.claim(names, ttl="30s") as claim:
            assert claim.acquired == names
            assert len(list(store.list(prefix="c:"))) == 60
        on = _commands(masters, name)
        assert {port for port, cmd in on if cmd == "evalsha"} == set(masters), on

        def listening() -> bool:
            return any(cmd == "ssubscribe" for _, cmd in _commands(masters, name))

        _woken_over_tls(store, "tls:wait", listening)
        for shown in (repr(store), store.url):
            assert CLIENT_KEY_PASSWORD not in shown
    finally:
        store.close()


@needs_cluster
def test_a_borrowed_cluster_client_with_tls_is_followed_over_tls(
    tls_cluster: RunningServer, api: str
) -> None:
    """The application's cluster client over TLS: latchkey's own cluster client and listener
    connections use its TLS settings (to every node: a claim over every master)."""
    files: dict[str, Path] = tls_cluster.extra["files"]  # type: ignore[assignment]
    tls: dict[str, Any] = {
        "ssl": True,
        "ssl_ca_certs": str(files["ca.pem"]),
        "ssl_certfile": str(files["client.pem"]),
        "ssl_keyfile": str(files["client.key"]),
    }
    seed = ("127.0.0.1", int(tls_cluster.url.rsplit(":", 1)[1]))
    prefix, names = f"t{uuid.uuid4().hex[:8]}:", [f"b:{i}" for i in range(60)]

    if api == "sync":
        app = redis.cluster.RedisCluster(host=seed[0], port=seed[1], **tls)
        with latchkey.connect(client=app, prefix=prefix) as store:
            assert store.url.startswith(f"rediss+cluster://{seed[0]}:{seed[1]}")
            with store.claim(names, ttl="10s") as claim:
                assert claim.acquired == names
        app.close()
        return

    async def body() -> None:
        app = redis.asyncio.cluster.RedisCluster(host=seed[0], port=seed[1], **tls)
        async with latchkey.connect_async(client=app, prefix=prefix) as store:
            assert store.url.startswith("rediss+cluster://")
            async with store.claim(names, ttl="10s") as claim:
                assert claim.acquired == names
        await app.aclose()

    asyncio.run(body())


# -- refused certificates ------------------------------------------------------------------


@pytest.mark.parametrize("deployment", [
    pytest.param("sentinel", marks=needs_sentinel),
    pytest.param("cluster", marks=needs_cluster),
])  # fmt: skip
@pytest.mark.parametrize(
    ("left_out", "why"),
    [
        # TLS 1.3: the server's refusal comes after the handshake, read or met while writing
        ("ssl_certfile", "CERTIFICATE_REQUIRED|EOF occurred in violation of protocol|reset"),
        ("ssl_ca_certs", "CERTIFICATE_VERIFY_FAILED"),
    ],
)
def test_a_refused_certificate_is_unavailable_saying_why(
    request: pytest.FixtureRequest,
    deployment: str,
    left_out: str,
    why: str,
    connect: Callable[[str], latchkey.Store],
) -> None:
    """Without the client certificate the servers hang up; without the CA their certificate
    is not trusted: StoreUnavailable within the timeout, the TLS error's own words in it (the
    Sentinel store's too: redis-py's own message shows only the error's kind), never the key's
    password."""
    server = request.getfixturevalue(f"tls_{deployment}")
    store = connect(_tls_url(server, without=left_out))
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=why) as caught:
            store.lock("tls", ttl="10s", wait=0).acquire()
        assert time.monotonic() - started < 3 + 1
    finally:
        store.close()
    assert CLIENT_KEY_PASSWORD not in str(caught.value)
