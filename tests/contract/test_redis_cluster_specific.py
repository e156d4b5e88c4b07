"""What only the Redis Cluster and Sentinel stores have to show: slots, batches split by slot
and given back whole, listing every master, sharded wake-ups, the URLs, and a Sentinel
failover with the store following the new master by itself.

The shared semantics run in the rest of tests/contract on both rows. Tests that freeze or kill
a server start their own cluster or Sentinel setup, so the shared ones stay up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio.sentinel
import redis.sentinel
from redis.crc import key_slot

import latchkey
from latchkey import ConfigError, LockLost, StoreUnavailable
from latchkey._types import Busy, Grant
from latchkey.stores import open_backend
from latchkey.stores.redis_cluster import (
    RedisClusterBackend,
    RedisSentinelBackend,
)
from tests.conftest import ServerPool
from tests.helpers import eventually
from tests.servers import RunningServer, ServerUnavailable, free_port
from tests.servers import redis_cluster as cluster_server
from tests.servers import redis_sentinel as sentinel_server

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
CLUSTER = not _selected or "redis+cluster" in _selected
SENTINEL = not _selected or "redis+sentinel" in _selected
if not (CLUSTER or SENTINEL):
    pytest.skip("no redis+cluster/redis+sentinel row selected", allow_module_level=True)
needs_cluster = pytest.mark.skipif(not CLUSTER, reason="redis+cluster row not selected")
needs_sentinel = pytest.mark.skipif(not SENTINEL, reason="redis+sentinel row not selected")

INFO = '{"host":"h","pid":1}'


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"redis cluster/sentinel: server required in CI but unavailable: {reason}")
    pytest.skip(f"not run: {reason}")


def _owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def cluster_url(server_pool: ServerPool) -> str:
    try:
        base = server_pool.base_url("redis_cluster")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    return f"{base}?prefix=t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def sentinel_url(server_pool: ServerPool) -> str:
    """The shared Sentinel setup's URL (the sentinel and the service), without a query."""
    try:
        return server_pool.base_url("redis_sentinel")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise AssertionError("unreachable") from exc


def _sentinel_port(sentinel_url: str) -> int:
    return int(sentinel_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


def _clients_named(ports: list[tuple[str, int]], client_name: str) -> list[dict[str, str]]:
    """CLIENT LIST entries of connections called ``client_name`` on the given servers."""
    found = []
    for host, port in ports:
        with redis.Redis(host=host, port=port, decode_responses=True) as admin:
            found += [c for c in admin.client_list() if c["name"] == client_name]
    return found


@pytest.fixture
def backend(cluster_url: str) -> Iterator[RedisClusterBackend]:
    b = open_backend(cluster_url)
    assert isinstance(b, RedisClusterBackend)
    yield b
    b.close()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[cluster_server.RunningCluster]:
    try:
        server = cluster_server.start(tmp_path / "cluster")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    assert isinstance(server, cluster_server.RunningCluster)
    yield server
    server.stop()


def _names_on_every_master(backend: RedisClusterBackend, per_master: int = 3) -> list[str]:
    """Names whose slots fall on each of the cluster's masters, ``per_master`` each."""
    client = backend.io.client  # type: ignore[attr-defined]
    found: dict[str, list[str]] = {}
    i = 0
    while len(found) < 3 or min(len(v) for v in found.values()) < per_master:
        name = f"n:{i}"
        node = client.get_node_from_key(backend.store.base(name)).name
        found.setdefault(node, [])
        if len(found[node]) < per_master:
            found[node].append(name)
        i += 1
    return [n for names in found.values() for n in names]


# -- slots ---------------------------------------------------------------------------------


@needs_cluster
def test_the_store_computes_redis_cluster_slots() -> None:
    backend = open_backend("redis+cluster://127.0.0.1:1?timeout=1")
    assert isinstance(backend, RedisClusterBackend)
    for name in ["plain", "{tag}", "a}b{c", "nul\x00inside", "é" * 127, "x" * 255]:
        assert backend.store.slot(name) == key_slot(backend.store.base(name).encode())
    backend.close()


@needs_cluster
def test_a_claim_across_masters_is_one_script_per_slot(backend: RedisClusterBackend) -> None:
    names = _names_on_every_master(backend)
    grants = backend.claim(names, _owner(), INFO, 30)
    assert sorted(grants) == sorted(names)
    assert all(isinstance(g, Grant) for g in grants.values())
    assert [i.name for i in backend.list("n:")] == sorted(names)  # SCAN on every master


@needs_cluster
def test_list_and_purge_span_every_master(backend: RedisClusterBackend) -> None:
    names = _names_on_every_master(backend, per_master=2)
    for name in names:
        assert isinstance(backend.acquire(name, _owner(), INFO, 30, limit=3), Grant)
    assert [i.name for i in backend.list("")] == sorted(names)
    assert backend.purge_expired() == 0
    # no expiry index on a cluster: it would be a key of another slot than the names'
    assert backend.io.client.exists(backend.store.index_key()) == 0  # type: ignore[attr-defined]


@needs_cluster
def test_a_failed_slot_gives_the_whole_claim_back(
    own_cluster: cluster_server.RunningCluster,
) -> None:
    """One master frozen: its part of a claim times out, the claim raises StoreUnavailable
    within one timeout (the masters are asked at once), and every part — those the other
    masters granted, and the frozen one's, which runs when it thaws — is given back in the
    background."""
    timeout = 1.0
    store = latchkey.connect(f"{own_cluster.url}?timeout={timeout:g}s")
    backend = store.backend
    assert isinstance(backend, RedisClusterBackend)
    try:
        names = _names_on_every_master(backend)
        client = backend.io.client  # type: ignore[attr-defined]
        frozen = client.get_node_from_key(backend.store.base(names[-1]))
        pid = own_cluster.extra["nodes"][frozen.port]  # type: ignore[index]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                store.claim(names, ttl="60s")
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < timeout + 0.5, f"{took:.2f}s"
        nodes = [
            redis.Redis(port=port, decode_responses=True)
            for port in own_cluster.extra["nodes"]  # type: ignore[attr-defined]
        ]
        prefix = backend.store.prefix
        eventually(
            lambda: all(node.keys(f"{prefix}*:lease") == [] for node in nodes),
            timeout=20,
            what="every part of the claim given back",
        )
        for node in nodes:
            node.close()
    finally:
        store.close()


@needs_cluster
def test_a_url_with_a_dead_seed_finds_the_cluster(cluster_url: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    url = cluster_url.replace("redis+cluster://", f"redis+cluster://{dead},")
    store = latchkey.connect(url)
    assert store.lock("x", ttl="10s", wait=0).acquire()
    store.close()


# -- scripts on each master's own connections, redirections through redis-py -----------------


def _admin(node: object) -> redis.Redis:
    return redis.Redis(host=node.host, port=node.port, decode_responses=True)  # type: ignore[attr-defined]


@needs_cluster
def test_a_script_goes_to_its_masters_connections_not_through_redis_py(
    backend: RedisClusterBackend,
) -> None:
    """The hot path (module docstring of io/redis_cluster.py): an uncontended acquire and
    release are sent over the slot master's own connections, never through the cluster
    client's ``execute_command`` (about twice the client CPU of the pair)."""
    client = backend.io.client  # type: ignore[attr-defined]
    name, owner = "hot:" + uuid.uuid4().hex, _owner()
    assert isinstance(backend.acquire(name, owner, INFO, 30), Grant)  # warm: scripts loaded
    assert backend.release(name, owner) is True
    routed: list[object] = []
    through = client.execute_command
    client.execute_command = lambda *a, **k: routed.append(a) or through(*a, **k)
    try:
        assert isinstance(backend.acquire(name, owner, INFO, 30), Grant)
        assert backend.release(name, owner) is True
    finally:
        del client.execute_command
    assert routed == []
    master = client.get_node_from_key(backend.store.base(name)).name
    assert backend.io._masters[master].idle  # type: ignore[attr-defined]


@needs_cluster
def test_a_moving_slot_is_followed_through_ask_and_moved(
    own_cluster: cluster_server.RunningCluster,
) -> None:
    """A name's slot moves to another master while the store runs (resharding). A script the
    old master answers ASK (slot migrating) or MOVED (slot moved) has not run, and is sent
    again through redis-py, which follows the redirection; after MOVED its map names the new
    master and the next script goes straight there.

    While the slot migrates, its names are unavailable, never granted twice: a script's one
    declared key (the name's hash-tag base) is not a key of its own, so the old master
    answers ASK even for a name whose lease it holds, and the importing master refuses the
    script's lease keys, not yet moved to it ("non local key")."""
    backend = open_backend(f"{own_cluster.url}?timeout=2s")
    assert isinstance(backend, RedisClusterBackend)
    try:
        client = backend.io.client  # type: ignore[attr-defined]
        held, owner = "moving:held", _owner()
        base, slot = backend.store.base(held), backend.store.slot(held)
        assert isinstance(backend.acquire(held, owner, INFO, 60), Grant)
        source = client.get_node_from_key(base)
        target = next(n for n in client.get_primaries() if n.name != source.name)
        with _admin(source) as src, _admin(target) as dst:
            src_id = src.execute_command("CLUSTER MYID")
            dst_id = dst.execute_command("CLUSTER MYID")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            with pytest.raises(StoreUnavailable, match="non local key"):  # ASK followed
                backend.acquire(held, _owner(), INFO, 60)
            keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
            for node in client.get_primaries():
                with _admin(node) as admin:
                    admin.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        assert client.get_node_from_key(base).name == source.name  # not told yet
        assert isinstance(backend.acquire(held, _owner(), INFO, 60), Busy)  # MOVED, followed
        assert client.get_node_from_key(base).name == target.name  # redis-py's map updated
        assert backend.release(held, owner) is True  # straight to the new master
        assert backend.io._masters[target.name].idle  # type: ignore[attr-defined]
    finally:
        backend.close()


@needs_cluster
def test_a_flushed_script_cache_on_a_master_is_reloaded(backend: RedisClusterBackend) -> None:
    client = backend.io.client  # type: ignore[attr-defined]
    name, owner = "flush:" + uuid.uuid4().hex, _owner()
    assert isinstance(backend.acquire(name, owner, INFO, 30), Grant)
    with _admin(client.get_node_from_key(backend.store.base(name))) as master:
        master.script_flush()
    assert backend.release(name, owner) is True  # NOSCRIPT, SCRIPT LOAD, sent again


@needs_cluster
def test_waiters_subscribe_on_the_slot_master_with_sharded_pubsub(
    backend: RedisClusterBackend,
) -> None:
    client = backend.io.client  # type: ignore[attr-defined]
    name = "wake:" + uuid.uuid4().hex
    assert isinstance(backend.acquire(name, "a" * 32, INFO, 30), Grant)
    waiter = backend.wait_in_line(name, "b" * 32, INFO, 30, 1)
    channel = backend.store.waiters_channel(name)  # type: ignore[attr-defined]
    node = client.get_node_from_key(channel)
    try:
        assert channel in client.execute_command("PUBSUB", "SHARDCHANNELS", target_nodes=node)
        # the attempt after subscribing (the core's second) puts this process in line
        assert isinstance(backend.acquire(name, "b" * 32, INFO, 30), Busy)
        assert client.execute_command("PUBSUB", "CHANNELS", target_nodes=node) == []
        started = time.monotonic()
        threading.Timer(0.2, lambda: backend.release(name, "a" * 32)).start()
        assert waiter.wait(5.0) is True
        assert time.monotonic() - started < 2.0
    finally:
        waiter.close()


@needs_cluster
def test_redis_py_options_in_the_url_reach_the_cluster_connections_and_the_listener(
    cluster_url: str,
) -> None:
    client_name = f"c-{uuid.uuid4().hex[:8]}"
    backend = open_backend(f"{cluster_url}&client_name={client_name}&socket_keepalive=yes")
    assert isinstance(backend, RedisClusterBackend)
    name = "opt:" + uuid.uuid4().hex
    try:
        assert isinstance(backend.acquire(name, "a" * 32, INFO, 30), Grant)
        waiter = backend.wait_in_line(name, "b" * 32, INFO, 30, 1)
        try:
            client = backend.io.client  # type: ignore[attr-defined]
            primaries = [(n.host, n.port) for n in client.get_primaries()]
            commands = {c["cmd"] for c in _clients_named(primaries, client_name)}
            assert {"evalsha", "ssubscribe"} <= commands, commands  # a script's, the listener's
        finally:
            waiter.close()
    finally:
        backend.close()


@needs_sentinel
def test_redis_py_options_in_the_url_reach_the_sentinels_master(
    sentinel_url: str, api: str
) -> None:
    client_name = f"s-{uuid.uuid4().hex[:8]}"
    url = f"{sentinel_url}?prefix=t{uuid.uuid4().hex[:8]}:&client_name={client_name}"
    master = sentinel_server.master_of(_sentinel_port(sentinel_url))
    assert master is not None

    def named() -> set[str]:
        return {c["cmd"] for c in _clients_named([("127.0.0.1", master)], client_name)}

    if api == "sync":
        with latchkey.connect(url) as store:
            assert store.lock("opt", ttl="10s", wait=0).acquire()
            assert "evalsha" in named()
        return

    async def body() -> None:
        async with latchkey.connect_async(url) as store:
            assert await store.lock("opt", ttl="10s", wait=0).acquire()
            assert "evalsha" in named()

    asyncio.run(body())


@needs_sentinel
def test_a_borrowed_sentinels_settings_are_followed(sentinel_url: str, api: str) -> None:
    """Over the application's Sentinel: its db and client name reach latchkey's connections
    to the master; ``db=`` given to connect() wins over the Sentinel's."""
    port = _sentinel_port(sentinel_url)
    master = sentinel_server.master_of(port)
    assert master is not None
    client_name = f"app-{uuid.uuid4().hex[:8]}"
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    kwargs = {"db": 2, "client_name": client_name}

    def key_in(db: int) -> bool:
        with redis.Redis(port=master, db=db) as admin:
            return bool(admin.keys(f"{prefix}*"))

    if api == "sync":
        app = redis.sentinel.Sentinel([("127.0.0.1", port)], **kwargs)
        with latchkey.connect(client=app, service=sentinel_server.SERVICE, prefix=prefix) as store:
            assert store.url.startswith(
                f"redis+sentinel://127.0.0.1:{port}/{sentinel_server.SERVICE}?prefix="
            )
            assert "db=2" in store.url and "(client redis.sentinel.Sentinel)" in store.url
            assert store.lock("followed", ttl="10s", wait=0).acquire()
            assert "evalsha" in {c["cmd"] for c in _clients_named([("127.0.0.1", master)],
                                                                  client_name)}  # fmt: skip
        assert key_in(2) and not key_in(0)
        with latchkey.connect(client=app, service=sentinel_server.SERVICE, prefix=prefix,
                              db=3) as store:  # fmt: skip
            assert store.lock("followed", ttl="10s", wait=0).acquire()
        assert key_in(3)
        app.close()
        return

    async def body() -> None:
        app = redis.asyncio.sentinel.Sentinel([("127.0.0.1", port)], **kwargs)
        store = latchkey.connect_async(client=app, service=sentinel_server.SERVICE, prefix=prefix)
        async with store:
            assert await store.lock("followed", ttl="10s", wait=0).acquire()
            named = _clients_named([("127.0.0.1", master)], client_name)
            assert "evalsha" in {c["cmd"] for c in named}
        assert key_in(2) and not key_in(0)
        await app.aclose()

    asyncio.run(body())


@needs_cluster
def test_async_claim_and_list_across_masters(cluster_url: str) -> None:
    async def body() -> None:
        async with latchkey.connect_async(cluster_url) as store:
            names = [f"a:{i}" for i in range(200)]
            async with store.claim(names, ttl="30s") as claim:
                assert claim.acquired == names
                assert len([i async for i in store.list(prefix="a:")]) == 200
            assert [i async for i in store.list(prefix="a:")] == []

    asyncio.run(body())


@needs_cluster
@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",  # no node
        "redis+cluster://127.0.0.1:7000/1",  # a cluster has db 0 only
        "redis+cluster://127.0.0.1:7000?prefix=bad{x",
        "redis+cluster://127.0.0.1:7000?db=1",
    ],
)
def test_bad_cluster_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(url)


# -- Sentinel ----------------------------------------------------------------------------------


@needs_sentinel
@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://127.0.0.1:26379",  # no service
        "redis+sentinel://127.0.0.1:26379/a/b",
        "redis+sentinel:///mymaster",  # no sentinel
        "redis+sentinel://127.0.0.1:26379/mymaster?db=x",
    ],
)
def test_bad_sentinel_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(url)


@needs_sentinel
def test_sentinel_url_keeps_passwords_out_of_reprs() -> None:
    backend = open_backend(
        "redis+sentinel://:pw-Zq8@127.0.0.1:1,127.0.0.1:2/svc?db=3&sentinel_auth=yes&timeout=1"
    )
    assert isinstance(backend, RedisSentinelBackend)
    assert backend.store.service == "svc" and backend.store.db == 3
    assert "pw-Zq8" not in repr(backend)
    with pytest.raises(StoreUnavailable) as caught:
        backend.now()
    assert "pw-Zq8" not in str(caught.value)
    backend.close()


def _try(store: latchkey.Store, name: str) -> bool:
    with contextlib.suppress(StoreUnavailable):
        lock = store.lock(name, ttl="30s", wait=0)
        if lock.acquire():
            lock.release()
            return True
    return False


@needs_sentinel
@pytest.mark.parametrize("via", ["url", "client"])
def test_sentinel_failover_the_store_follows_the_new_master(tmp_path: Path, via: str) -> None:
    """The master is killed (SIGKILL); the sentinel promotes the replica; a worker that keeps
    taking and releasing locks sees StoreUnavailable for a while, then carries on against the
    new master without being told. A lease written well before the kill (replicated: WAIT)
    is still there; the sync and the asyncio store both reconnect by themselves. ``client``:
    the store is opened over the application's own redis-py Sentinel (sync and asyncio), made
    without socket timeouts: latchkey's own bound the calls all the same."""
    try:
        setup = sentinel_server.start_setup(tmp_path / "sentinel")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    ports = setup.extra["ports"]  # type: ignore[index]
    try:
        eventually(
            lambda: _sentinel_knows_a_replica(ports["sentinel"]),
            timeout=30,
            what="the sentinel knows the replica",
        )
        url = f"{setup.url}?timeout=1s&prefix=f:"
        sentinels = [("127.0.0.1", ports["sentinel"])]
        options = {"service": sentinel_server.SERVICE, "timeout": "1s", "prefix": "f:"}
        app_sentinel = redis.sentinel.Sentinel(sentinels)
        if via == "url":
            store = latchkey.connect(url)
        else:
            store = latchkey.connect(client=app_sentinel, **options)
        held = store.lock("held", ttl="60s")
        assert held.acquire()
        master = redis.Redis(port=ports["master"])
        master.set("f:wait", "1")  # WAIT covers this connection's writes: and so the lease's
        assert master.execute_command("WAIT", 1, 5000) == 1  # the lease reached the replica
        master.close()

        results: list[bool] = []
        stop = threading.Event()

        def worker() -> None:
            i = 0
            while not stop.is_set():
                results.append(_try(store, f"w:{i}"))
                i += 1
                time.sleep(0.01)

        thread = threading.Thread(target=worker)
        thread.start()
        eventually(lambda: sum(results) >= 5, timeout=10, what="the worker runs")
        setup.kill("master")
        killed = time.monotonic()
        count = len(results)
        try:
            eventually(
                lambda: sentinel_server.master_of(ports["sentinel"]) == ports["replica"],
                timeout=60,
                what="the sentinel promoted the replica",
            )
            eventually(lambda: sum(results[count:]) >= 5, timeout=30, what="grants resume")
        finally:
            stop.set()
            thread.join()
        resumed = time.monotonic() - killed
        print(f"sentinel failover: grants resumed {resumed:.1f}s after the master was killed")
        assert resumed < 30
        # The replicated lease survived the failover: still held, still the holder's.
        assert store.lock("held", ttl="60s", wait=0).acquire() is False
        held.extend()
        assert held.release() is True

        async def async_side() -> None:
            app_async = redis.asyncio.sentinel.Sentinel(sentinels)
            if via == "url":
                astore = latchkey.connect_async(url)
            else:
                astore = latchkey.connect_async(client=app_async, **options)
            async with astore:
                lock = astore.lock("async", ttl="10s", wait=0)
                assert await lock.acquire()
                await lock.release()
            assert await app_async.discover_master(sentinel_server.SERVICE)  # left open
            await app_async.aclose()

        asyncio.run(async_side())
        store.close()
        assert app_sentinel.discover_master(sentinel_server.SERVICE)[1] == ports["replica"]
        app_sentinel.close()
    finally:
        setup.stop()


def _sentinel_knows_a_replica(port: int) -> bool:
    client = redis.Redis(port=port, decode_responses=True)
    try:
        return any(
            r.get("flags") == "slave" and r.get("master-link-status") == "ok"
            for r in client.sentinel_slaves(sentinel_server.SERVICE)
        )
    except redis.RedisError:
        return False
    finally:
        client.close()


@needs_cluster
def test_cluster_failover_the_store_follows_the_promoted_replica(tmp_path: Path) -> None:
    """Three masters with a replica each; the master of a held name's slot is killed
    (SIGKILL); the cluster promotes its replica; a worker taking and releasing locks on names
    of that master's slots sees StoreUnavailable for a while, then carries on against the
    promoted replica by itself. A lease replicated before the kill (WAIT) is still held."""
    try:
        cluster = cluster_server.start_cluster(tmp_path / "cluster", replicas=1)
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    nodes: dict[int, int] = cluster.extra["nodes"]  # type: ignore[assignment]
    try:
        eventually(lambda: _replicas_in_sync(list(nodes)) == 3, timeout=30, what="replicas in sync")
        url = f"{cluster.url}?timeout=1s&prefix=f:"
        store = latchkey.connect(url)
        backend = open_backend(url)
        assert isinstance(backend, RedisClusterBackend)
        client = backend.io.client  # type: ignore[attr-defined]
        victim = client.get_node_from_key(backend.store.base("held"))
        names = [
            n
            for n in (f"w:{i}" for i in range(400))
            if client.get_node_from_key(backend.store.base(n)).name == victim.name
        ]
        held = store.lock("held", ttl="60s")
        assert held.acquire()
        master = redis.Redis(port=victim.port)
        master.set(f"{backend.store.base('held')}:wait", "1")  # same slot: same node
        assert master.execute_command("WAIT", 1, 5000) == 1  # the lease reached the replica
        master.close()
        backend.close()

        results: list[bool] = []
        stop = threading.Event()

        def worker() -> None:
            i = 0
            while not stop.is_set():
                results.append(_try(store, names[i % len(names)]))
                i += 1
                time.sleep(0.01)

        thread = threading.Thread(target=worker)
        thread.start()
        eventually(lambda: sum(results) >= 5, timeout=10, what="the worker runs")
        cluster.kill(victim.port)
        killed = time.monotonic()
        count = len(results)
        try:
            eventually(lambda: sum(results[count:]) >= 5, timeout=60, what="grants resume")
        finally:
            stop.set()
            thread.join()
        resumed = time.monotonic() - killed
        print(f"cluster failover: grants resumed {resumed:.1f}s after the master was killed")
        assert store.lock("held", ttl="60s", wait=0).acquire() is False
        held.extend()
        assert held.release() is True
        store.close()
    finally:
        cluster.stop()


def _replicas_in_sync(ports: list[int]) -> int:
    """How many replicas of the cluster on ``ports`` have their link to the master up."""
    count = 0
    for port in ports:
        node = redis.Redis(port=port, decode_responses=True)
        try:
            info = node.info("replication")
            count += info.get("role") == "slave" and info.get("master_link_status") == "up"
        except redis.RedisError:
            pass
        finally:
            node.close()
    return count


@pytest.mark.parametrize("kind", ["cluster", "sentinel"])
def test_a_holder_cut_off_from_its_servers_learns_why_its_lease_was_lost(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared partition test (tests/contract/test_faults.py) cuts the network through
    proxies these setups announce; here the servers themselves stall instead (SIGSTOP: the
    cluster's masters; the master, its replica and the sentinel), with no proxy on the way
    and the sentinel's own failover timer frozen with them: a renewing holder keeps retrying
    while its lease lasts, then reports it lost — through on_lost, one warning and check() —
    with the renewal's failure as the reason; after the thaw the lease has ended on the
    server and someone else gets it."""
    if (kind == "cluster" and not CLUSTER) or (kind == "sentinel" and not SENTINEL):
        pytest.skip(f"redis+{kind} row not selected")
    try:
        if kind == "cluster":
            server: RunningServer = cluster_server.start_cluster(tmp_path / "cluster")
        else:
            server = sentinel_server.start_setup(tmp_path / "sentinel")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    try:
        store = latchkey.connect(f"{server.url}?timeout=300ms")
        calls: list[object] = []
        lock = store.lock("cut", ttl="2s", renew=True, on_lost=calls.append)
        assert lock.acquire()
        with caplog.at_level(logging.WARNING, logger="latchkey"), server.frozen():
            eventually(lambda: calls, timeout=15, what="on_lost called by the renewer")
        assert len(calls) == 1 and lock.lost
        lost = [r.message for r in caplog.records if "lost (token" in r.message]
        assert len(lost) == 1 and "could not renew before the lease ended" in lost[0], lost
        with pytest.raises(LockLost, match="could not renew before the lease ended"):
            lock.check()
        other = latchkey.connect(server.url)
        eventually(lambda: _try(other, "cut"), timeout=30, what="the lease ended on the server too")
        other.close()
        store.close()
    finally:
        server.stop()
