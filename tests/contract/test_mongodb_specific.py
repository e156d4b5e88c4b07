"""What only the MongoDB store has to show: URL handling, seed 004's two bugs, the document.

The first part needs no server: option validation, that constructing a backend connects to
nothing, and that a refused connection is StoreUnavailable within the timeout (real behaviour:
a closed port on 127.0.0.1). The second part runs on a real ``mongod`` only (see
tests/servers/mongodb.py); without one it is skipped, never faked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable
from latchkey._types import Busy, Grant
from latchkey.stores import open_async_backend, open_backend
from latchkey.stores.mongodb import AsyncMongoDBBackend, MongoDBBackend, lock_let
from tests.conftest import ServerPool
from tests.faults.proxy import Proxies
from tests.servers import RunningServer, ServerUnavailable, free_port, with_query

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and "mongodb" not in _selected:
    pytest.skip("the mongodb row is not selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'
A, B = "a" * 32, "b" * 32


def _open(url: str) -> MongoDBBackend:
    backend = open_backend(url)
    assert isinstance(backend, MongoDBBackend)
    return backend


# -- no server needed --------------------------------------------------------------------------


def test_url_options_reach_pymongo() -> None:
    b = _open(
        "mongodb://app:s3cret@db1:27017,db2/orders?collection=my_locks&timeout=2s"
        "&replicaSet=rs0&authSource=admin&readPreference=primary"
    )
    try:
        assert b.io.locks.full_name == "orders.my_locks"
        assert b.io.records.full_name == "orders.my_locks_records"
        options = b.io.client.options
        assert options.replica_set_name == "rs0"
        assert options.write_concern.document == {"w": "majority"}  # the default we set
        assert options.server_selection_timeout == 2.0
        assert options.pool_options.connect_timeout == 2.0
        assert options.pool_options.socket_timeout == 2.0
        assert "s3cret" not in repr(b)
    finally:
        b.close()


def test_any_pymongo_option_passes_and_wins_over_timeout() -> None:
    b = _open(
        "mongodb://127.0.0.1:1/app?timeout=4s&serverSelectionTimeoutMS=700&maxIdleTimeMS=9000"
    )
    try:
        options = b.io.client.options
        assert options.server_selection_timeout == 0.7  # the URL's own
        assert options.pool_options.connect_timeout == 4.0  # from ?timeout=
        assert options.pool_options.max_idle_time_seconds == 9.0
    finally:
        b.close()


def test_defaults_and_an_explicit_write_concern() -> None:
    b = _open("mongodb://127.0.0.1:1?w=1")
    try:
        assert b.io.locks.full_name == "latchkey.latchkey_locks"
        assert b.io.client.options.write_concern.document == {"w": 1}
        assert b.timeout == 5.0
    finally:
        b.close()


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://",
        "mongodb://h/bad.db",
        "mongodb://h?collection=1bad",
        "mongodb://h?collection=has-dash",
        "mongodb://h?unknown=1",
        "mongodb://h?tls=maybe",
        "mongodb://h?serverSelectionTimeoutMS=soon",
        "mongodb://h?tz_aware=false",  # the store depends on it
        "mongodb+srv://h:27017/x",  # SRV URLs carry no port
        "mongodb://user:s3cret@h?timeout=soon",
    ],
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        open_backend(url).close()
    assert "s3cret" not in str(caught.value)


def test_srv_url_is_accepted_without_a_dns_lookup() -> None:
    started = time.monotonic()
    b = _open("mongodb+srv://cluster0.example.invalid/app?timeout=1s")
    b.close()
    assert time.monotonic() - started < 1


def test_constructing_connects_to_nothing() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    b = _open(f"mongodb://127.0.0.1:{port}?timeout=3s")
    b.close()
    assert time.monotonic() - started < 0.5


def test_user_strings_are_literals_in_pipelines() -> None:
    """Owner info is the caller's text: it must never be read as a field path or operator."""
    let = lock_let("$owner", '$info {"$where": 1}', 1.5, 3)
    assert let == {
        "owner": {"$literal": "$owner"},
        "info": {"$literal": '$info {"$where": 1}'},
        "ttl": 1500,
        "limit": 3,
    }


def test_refused_connection_is_unavailable_within_the_timeout() -> None:
    port = free_port()
    b = _open(f"mongodb://app:s3cret@127.0.0.1:{port}?timeout=500ms")
    calls: list[Any] = [
        lambda: b.acquire("n", A, INFO, 10),
        lambda: b.release("n", A),
        lambda: b.extend("n", A, 10),
        lambda: b.inspect("n"),
        lambda: list(b.list("n")),
        lambda: b.force_release("n"),
        lambda: b.purge_expired(),
        lambda: b.claim(["n", "m"], A, INFO, 10),
        lambda: b.release_many(["n"], A),
        lambda: b.record_get("n"),
        lambda: b.record_set("n", "1", 0),
        lambda: b.now(),
        lambda: b.init(),
    ]
    try:
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                call()
            assert time.monotonic() - started < 2.5
            assert isinstance(caught.value, ConnectionError)
            assert "s3cret" not in str(caught.value)
    finally:
        b.close()


# -- on a real server --------------------------------------------------------------------------


@pytest.fixture
def mongo_url(server_pool: ServerPool) -> str:
    try:
        base = server_pool.base_url("mongodb")
    except ServerUnavailable as exc:
        pytest.skip(f"mongodb: not run: {exc}")
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}collection=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backend(mongo_url: str) -> Iterator[MongoDBBackend]:
    b = _open(mongo_url)
    yield b
    b.io.locks.drop()
    b.io.records.drop()
    b.close()


def test_a_live_holder_is_never_overwritten(backend: MongoDBBackend) -> None:
    """Seed 004's get_lock upserted over the holder's document and so stole the lock."""
    first = backend.acquire("migrations", A, INFO, 30)
    assert isinstance(first, Grant)
    busy = backend.acquire("migrations", B, INFO, 30)
    assert isinstance(busy, Busy) and busy.holders == 1 and busy.holder is not None
    doc = backend.io.locks.find_one({"_id": "migrations"})
    assert doc is not None and [h["owner"] for h in doc["holders"]] == [A]


def test_release_checks_the_owner(backend: MongoDBBackend) -> None:
    """Seed 004's release_lock deleted the document whoever held it."""
    backend.acquire("migrations", A, INFO, 30)
    assert backend.release("migrations", B) is False
    assert backend.extend("migrations", B, 60) is None
    assert backend.inspect("migrations") is not None
    assert backend.release("migrations", A) is True


def test_document_layout_and_ttl_index(backend: MongoDBBackend) -> None:
    grant = backend.acquire("job", A, INFO, 30)
    assert isinstance(grant, Grant)
    doc = backend.io.locks.find_one({"_id": "job"})
    assert doc is not None
    assert set(doc) == {"_id", "fence", "holders", "gc"}
    assert doc["fence"] == grant.token
    (holder,) = doc["holders"]
    assert holder["owner"] == A and holder["info"] == INFO and holder["token"] == grant.token
    assert doc["gc"] >= holder["expires"]
    indexes = backend.io.locks.index_information()
    assert indexes["latchkey_gc"]["expireAfterSeconds"] == 0


def test_tokens_continue_after_the_document_is_purged(backend: MongoDBBackend) -> None:
    first = backend.acquire("job", A, INFO, 0.05)
    assert isinstance(first, Grant) and first.token is not None
    time.sleep(0.2)
    assert backend.purge_expired() == 1
    assert backend.io.locks.find_one({"_id": "job"}) is None
    second = backend.acquire("job", B, INFO, 30)
    assert isinstance(second, Grant) and second.token is not None
    assert second.token > first.token


def test_racing_first_acquires_grant_exactly_one(backend: MongoDBBackend) -> None:
    """Concurrent upserts of a new name: one inserts, the rest see it (or a duplicate key,
    which is 'lost a race', never an error)."""
    results: list[Grant | Busy] = []
    barrier = threading.Barrier(8)

    def take(owner: str) -> None:
        barrier.wait()
        results.append(backend.acquire("fresh", owner, INFO, 30))

    threads = [threading.Thread(target=take, args=(f"{i:032x}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, Grant) for r in results) == 1


def test_semaphore_holders_live_in_one_document(backend: MongoDBBackend) -> None:
    assert isinstance(backend.acquire("sem", A, INFO, 30, limit=2), Grant)
    assert isinstance(backend.acquire("sem", B, INFO, 30, limit=2), Grant)
    busy = backend.acquire("sem", "c" * 32, INFO, 30, limit=2)
    assert isinstance(busy, Busy) and busy.holders == 2
    info = backend.inspect("sem")
    assert info is not None and len(info.holders) == 2


def test_server_restart_keeps_leases(
    server_pool: ServerPool, mongo_url: str, backend: MongoDBBackend
) -> None:
    server: RunningServer | None = server_pool.running.get("mongodb")
    if server is None:
        pytest.skip("mongodb: uses an existing server (env var); will not stop it")
    grant = backend.acquire("job", A, INFO, 60)
    assert isinstance(grant, Grant)
    server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            backend.acquire("job", B, INFO, 60)
    finally:
        server.start()
    assert isinstance(backend.acquire("job", B, INFO, 60), Busy)
    assert backend.release("job", A) is True


@pytest.mark.parametrize("fault", ["reset", "latency"])
def test_a_call_of_several_requests_ends_within_one_timeout(
    mongo_url: str, connect: Callable[[str], latchkey.Store], fault: str
) -> None:
    """Calls of several requests — a store's first claim (its index set up first, then a bulk
    write and a read), another store's first acquire (the index, then the acquire) — through
    a proxy: ``reset``, every connection closed by a TCP reset, the client's monitor's too
    (the chaos run's slow acquire was "server selection after a reset"); ``latency``, every
    round trip ~0.65 s, each request within the 1 s timeout but not three of them. Either way
    every call ends — granted or StoreUnavailable — within the timeout and pymongo's
    half-second of server-selection slack. (With one timeout per request instead of per
    call, the claim took three round trips under ``latency``: 1.85-1.91 s.)"""
    timeout = 1.0
    found = re.search(r"127\.0\.0\.1:(\d+)", mongo_url)
    assert found, mongo_url
    proxies = Proxies([("127.0.0.1", int(found.group(1)))])
    try:
        url = mongo_url.replace(found.group(0), f"127.0.0.1:{proxies.proxies[0].port}")
        url = with_query(url, timeout=f"{timeout:g}s")
        name = f"test:{uuid.uuid4().hex[:12]}"
        claimer, acquirer = connect(url), connect(url)
        for store in (claimer, acquirer):  # connected; nothing acquired yet (no index)
            assert store.inspect(name) is None
        if fault == "reset":
            proxies.reset()
        else:
            proxies.set("pass", latency=0.3)  # each way
        calls: list[tuple[str, Callable[[], object]]] = [
            ("first claim", lambda: claimer.claim([f"{name}:a", f"{name}:b"], ttl="30s")),
            ("first acquire", lambda: acquirer.lock(name, ttl="30s", wait=0).acquire()),
        ]
        for what, call in calls:
            started = time.monotonic()
            with contextlib.suppress(StoreUnavailable):  # or granted: either, in time
                call()
            took = time.monotonic() - started
            assert took < timeout + 0.5, f"{what}: {took:.2f}s ({fault})"
    finally:
        proxies.close()


# -- the asyncio backend -----------------------------------------------------------------------


def _open_async(url: str) -> AsyncMongoDBBackend:
    backend = open_async_backend(url)
    assert isinstance(backend, AsyncMongoDBBackend)
    return backend


def test_async_refused_connection_is_unavailable_within_the_timeout() -> None:
    port = free_port()

    async def main() -> None:
        b = _open_async(f"mongodb://app:s3cret@127.0.0.1:{port}?timeout=500ms")
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: b.acquire("n", A, INFO, 10),
            lambda: b.release("n", A),
            lambda: b.extend("n", A, 10),
            lambda: b.inspect("n"),
            lambda: _collect(b.list("n")),
            lambda: b.force_release("n"),
            lambda: b.purge_expired(),
            lambda: b.claim(["n", "m"], A, INFO, 10),
            lambda: b.release_many(["n"], A),
            lambda: b.record_get("n"),
            lambda: b.record_set("n", "1", 0),
            lambda: b.record_delete("n", 1),
            lambda: b.now(),
            lambda: b.init(),
        ]
        try:
            for call in calls:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as caught:
                    await call()
                assert time.monotonic() - started < 2.5
                assert "s3cret" not in str(caught.value)
        finally:
            await b.aclose()

    asyncio.run(main())


async def _collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


def test_async_stopped_server_is_unavailable_within_the_timeout_then_recovers(
    server_pool: ServerPool, mongo_url: str
) -> None:
    server: RunningServer | None = server_pool.running.get("mongodb")
    if server is None:
        pytest.skip("mongodb: uses an existing server (env var); will not stop it")

    async def main() -> None:
        b = _open_async(f"{mongo_url}&timeout=1s")
        try:
            assert isinstance(await b.acquire("job", A, INFO, 60), Grant)
            server.stop()
            try:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await b.acquire("job", B, INFO, 60)
                assert time.monotonic() - started < 1 + 2.5
            finally:
                server.start()
            # The dead connection was discarded: the same backend works again.
            assert isinstance(await b.acquire("job", B, INFO, 60), Busy)
            assert await b.release("job", A) is True
        finally:
            await b.io.locks.drop()
            await b.aclose()

    asyncio.run(main())


def test_async_cancelled_requests_leave_nothing_held_and_the_backend_working(
    mongo_url: str,
) -> None:
    """Cancel acquires at every point of their round trip (before sending, waiting for the
    reply, after it): the core's release after a cancellation leaves no lease held, and the
    connection the driver was using is not reused half-read.

    With idle connections in the pool, that release goes out at once on another connection;
    had the acquire been dropped mid-flight, the server could run it after the release
    (seen: 2 names of 200 left held), so the backend lets it finish first."""

    async def main() -> None:
        store = latchkey.connect_async(mongo_url)
        backend = store.backend
        try:
            await backend.init()
            await asyncio.gather(*(backend.now() for _ in range(8)))  # idle connections
            # The median of single round trips: a mean is pulled up by one slow call of the
            # emulated server (seen: a mean three times the usual, so most delays outlasted
            # the round trip and only 98 of 300 acquires were cut off).
            times = []
            for _ in range(15):
                started = time.monotonic()
                await backend.acquire("warm", A, INFO, 10)
                times.append(time.monotonic() - started)
            round_trip = statistics.median(times)
            cancelled = 0
            for i in range(300):
                lock = store.lock(f"c{i}", ttl=60, wait=0)
                task = asyncio.create_task(lock.acquire())
                await asyncio.sleep(round_trip * (i % 25) / 20)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
                else:  # it finished first: the lock is held, and ours to release
                    assert await lock.release() is True
            assert cancelled >= 100  # the delays did reach into the round trips
            assert [info.name async for info in store.list("c")] == []
            for i in range(300):  # every name free, the backend answering in order
                lock = store.lock(f"c{i}", ttl=60, wait=0)
                assert await lock.acquire() is True
                assert await lock.release() is True
        finally:
            await store.aclose()

    asyncio.run(main())


def test_async_cancelling_a_waiting_acquire_leaves_nothing_held(
    backend: MongoDBBackend, mongo_url: str
) -> None:
    assert isinstance(backend.acquire("job", A, INFO, 60), Grant)

    async def main() -> None:
        store = latchkey.connect_async(mongo_url)
        attempts = 0
        acquire = store.backend.acquire

        async def counting(*args: Any) -> Grant | Busy:
            nonlocal attempts
            attempts += 1
            return await acquire(*args)

        store.backend.acquire = counting  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(store.lock("job", ttl=60, wait=60).acquire())
            while attempts < 3:  # waiting: polled the store more than once
                assert not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            info = await store.inspect("job")
            assert info is not None and len(info.holders) == 1  # still only A's lease
            assert backend.release("job", A) is True
            lock = store.lock("job", ttl=60, wait=0)
            assert await lock.acquire() is True
            assert await lock.release() is True
        finally:
            await store.aclose()

    asyncio.run(main())


def test_async_waiters_hold_no_thread_and_are_all_served(
    backend: MongoDBBackend, mongo_url: str
) -> None:
    assert isinstance(backend.acquire("job", A, INFO, 60), Grant)

    async def main() -> None:
        store = latchkey.connect_async(mongo_url)
        served: list[int] = []

        async def worker(i: int) -> None:
            async with store.lock("job", ttl=60, wait=120):
                served.append(i)

        try:
            # Connected, with a connection per waiter: the driver's own tasks are running and
            # its name lookups (on the loop's executor, when connecting) are done.
            await asyncio.gather(*(store.inspect("job") for _ in range(10)))
            threads = threading.active_count()
            tasks = [asyncio.create_task(worker(i)) for i in range(10)]
            await asyncio.sleep(0.3)
            # A waiter holding a thread would add one each (10); the loop's own executor may
            # start one for a name lookup when the driver opens a connection.
            assert threading.active_count() - threads < 5
            assert served == []
            backend.release("job", A)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert sorted(served) == list(range(10))
        finally:
            await store.aclose()

    asyncio.run(main())
