"""What only the ZooKeeper store has to show: tokens from zxids, leases that end with their
session, a holder's deadline bounded by the session timeout, no revival of a lease that ran out,
waiters in line.

The shared semantics are tested by the rest of tests/contract on every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient

import latchkey
from latchkey import ConfigError, LockLost
from latchkey._owner import new_owner_token
from latchkey._types import Busy, Grant
from latchkey.stores import open_backend
from tests.conftest import ServerPool
from tests.helpers import HOSTILE_NAMES, eventually
from tests.servers import ServerUnavailable

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and "zookeeper" not in _selected:
    pytest.skip("the zookeeper row is not selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'


@pytest.fixture
def zk_url(server_pool: ServerPool) -> str:
    """The shared server's URL with a prefix node of this test's own."""
    try:
        base = server_pool.base_url("zookeeper")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"zookeeper: server required in CI but unavailable: {exc}")
        pytest.skip(f"zookeeper: not run: {exc}")
    return f"{base}/chroot-{uuid.uuid4().hex[:8]}?prefix=t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(zk_url: str) -> Iterator[latchkey.Store]:
    s = latchkey.connect(zk_url)
    yield s
    s.close()


def test_tokens_are_creation_zxids_and_keep_rising(store: latchkey.Store) -> None:
    tokens = []
    for _ in range(3):
        lock = store.lock("n", ttl="10s", wait=0)
        assert lock.acquire()
        tokens.append(lock.token)
        lock.release()
    store.purge_expired()  # the name's node goes too: tokens are zxids, nothing to keep
    lock = store.lock("n", ttl="10s", wait=0)
    assert lock.acquire()
    tokens.append(lock.token)
    lock.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == 4


def test_a_lease_ends_with_its_session(zk_url: str) -> None:
    """A holder whose session ends (its store closed, its process gone) frees the name at
    once, whatever TTL is left."""
    holder, other = latchkey.connect(zk_url), latchkey.connect(zk_url)
    assert holder.lock("n", ttl="60s", wait=0).acquire()
    assert other.lock("n", ttl="60s", wait=0).acquire() is False
    holder.close()
    lock = other.lock("n", ttl="60s", wait=0)
    assert lock.acquire()
    lock.release()
    other.close()


def test_the_holders_deadline_is_bounded_by_the_session_timeout(zk_url: str) -> None:
    store = latchkey.connect(zk_url + "&session_timeout=2s")
    lock = store.lock("n", ttl="60s")
    assert lock.acquire()
    left = lock.remaining()
    assert left is not None and left <= 2.0
    lock.extend("60s")
    left = lock.remaining()
    assert left is not None and left <= 2.0
    lock.release()
    renewed = store.lock("r", ttl="30s", renew=True)
    assert renewed.acquire()
    time.sleep(3.5)  # beyond the session timeout: the renewer keeps up (a third of 2 s)
    assert not renewed.lost
    renewed.release()
    store.close()


def test_a_lease_that_ran_out_is_not_revived_by_its_extend(zk_url: str) -> None:
    backend = open_backend(zk_url)
    try:
        first, second = new_owner_token(), new_owner_token()
        assert isinstance(backend.acquire("n", first, INFO, 0.3, 1), Grant)
        time.sleep(0.5)
        taken = backend.acquire("n", second, INFO, 30.0, 1)
        assert isinstance(taken, Grant)
        assert backend.extend("n", first, 30.0) is None  # ran out: gone, not revived
        assert isinstance(backend.acquire("n", new_owner_token(), INFO, 30.0, 1), Busy)
        assert backend.release("n", first) is False
        info = backend.inspect("n")
        assert info is not None and [h.token for h in info.holders] == [taken.token]
        assert backend.release("n", second) is True
    finally:
        backend.close()


def test_waiters_are_served_in_line(store: latchkey.Store) -> None:
    """Waiters queue behind the holder in the order they came and are woken in turn."""
    import threading

    holder = store.lock("q", ttl="30s")
    assert holder.acquire()
    order: list[int] = []

    def wait(i: int) -> None:
        with store.lock("q", ttl="30s", wait="30s"):
            order.append(i)

    threads = []
    for i in range(4):
        t = threading.Thread(target=wait, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.3)  # each is in line before the next comes
    started = time.monotonic()
    holder.release()
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2, 3]
    assert time.monotonic() - started < 3  # woken by watches, not by a slow poll


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_any_name_is_a_node(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="10s", wait=0)
    assert lock.acquire()
    assert [i.name for i in store.list()] == [name]
    lock.release()


@pytest.mark.parametrize(
    "url",
    [
        "zookeeper://",
        "zookeeper://h:2181/zookeeper",
        "zookeeper://h:2181/a/../b",
        "zookeeper://h:2181/?prefix=a%2Fb",
        "zookeeper://h:2181?session_timeout=soon",
    ],
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        latchkey.connect(url)


def test_an_expired_owner_cannot_release_a_later_holder(store: latchkey.Store) -> None:
    lock = store.lock("x", ttl="300ms", wait=0)
    assert lock.acquire()
    time.sleep(0.5)
    other = store.lock("x", ttl="10s", wait=0)
    assert other.acquire()
    with pytest.raises(LockLost):
        lock.extend()
    assert lock.release() is False
    assert store.inspect("x") is not None
    other.release()


def _srvr(url: str, field: str) -> int:
    """A counter of the server's ``srvr`` answer: ``Zxid`` (the last transaction id: one per
    write, a multi is one) or ``Received`` (requests from every client, this ``srvr`` too)."""
    from urllib.parse import urlsplit

    from tests.servers.zookeeper import srvr

    port = urlsplit(url).port
    assert port is not None
    found = [line for line in srvr(port).splitlines() if line.startswith(f"{field}:")]
    assert found, f"srvr: no {field} line"
    return int(found[0].split(":", 1)[1].strip(), 16 if field == "Zxid" else 10)


def _zxid(url: str) -> int:
    return _srvr(url, "Zxid")


@pytest.mark.parametrize("limit", [1, 3])
def test_a_hand_off_costs_the_release_and_no_write_of_the_waiter(zk_url: str, limit: int) -> None:
    """A waiter woken by a release decides by reading the line: from the release to the
    waiter's grant the server commits exactly one transaction, the release's delete. The
    waiter's lease is its node's, written when it joined the line."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        holders = [new_owner_token() for _ in range(limit)]
        tokens = []
        for owner in holders:
            held = backend.acquire("h", owner, INFO, 30.0, limit)
            assert isinstance(held, Grant) and held.token is not None
            tokens.append(held.token)
        waiting = new_owner_token()
        assert isinstance(backend.acquire("h", waiting, INFO, 30.0, limit), Busy)
        waiter = backend.wait_in_line("h", waiting, INFO, 30.0, limit)
        assert waiter is not None
        assert isinstance(backend.acquire("h", waiting, INFO, 30.0, limit), Busy)
        before = _zxid(zk_url)
        assert backend.release("h", holders[-1]) is True
        assert waiter.wait(10)
        grant = backend.acquire("h", waiting, INFO, 30.0, limit)
        assert isinstance(grant, Grant)
        assert _zxid(zk_url) - before == 1  # the release's delete only
        assert grant.remaining is not None and 20.0 < grant.remaining <= 30.0
        waiter.finish(grant)
        waiter.close()  # granted: the node stays, it is the lease
        assert grant.token is not None and grant.token > max(tokens)
        info = backend.inspect("h")
        assert info is not None and len(info.holders) == limit
        assert grant.token in [h.token for h in info.holders]
        assert backend.release("h", waiting) is True
        for owner in holders[:-1]:
            assert backend.release("h", owner) is True
    finally:
        backend.close()


def _requests_of_a_hand_off(
    zk_url: str, backend: Any, name: str, limit: int, waited: float = 0.0
) -> tuple[int, Grant]:
    """``limit`` holders and a waiter in line behind them (for ``waited`` seconds), then the
    last holder releases: the requests the server received from the release call to the
    waiter's grant, less what a bare ``srvr`` adds (``Received`` counts it, and pings)."""
    holders = [new_owner_token() for _ in range(limit)]
    for owner in holders:
        assert isinstance(backend.acquire(name, owner, INFO, 30.0, limit), Grant)
    waiting = new_owner_token()
    assert isinstance(backend.acquire(name, waiting, INFO, 30.0, limit), Busy)
    waiter = backend.wait_in_line(name, waiting, INFO, 30.0, limit)
    assert waiter is not None
    assert isinstance(backend.acquire(name, waiting, INFO, 30.0, limit), Busy)
    time.sleep(waited)
    idle = -_srvr(zk_url, "Received") + _srvr(zk_url, "Received")
    before = _srvr(zk_url, "Received")
    assert backend.release(name, holders[-1]) is True
    assert waiter.wait(10)
    grant = backend.acquire(name, waiting, INFO, 30.0, limit)
    requests = _srvr(zk_url, "Received") - before - idle
    assert isinstance(grant, Grant)
    waiter.finish(grant)
    waiter.close()
    for owner in [*holders[:-1], waiting]:
        assert backend.release(name, owner) is True
    return requests, grant


@pytest.mark.parametrize("limit", [1, 3])
def test_a_hand_off_is_told_by_the_watch_event_alone(zk_url: str, limit: int) -> None:
    """The waiter read the whole line when it joined it, and watches every node ahead that
    may be live: when the release's deletion comes as a watch event, it holds the lease with
    no request of its own — the hand-off costs the server one request, the release's delete
    (kazoo's Lock recipe lists the line again: two). The fewest of three tries (pings)."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        tries = [_requests_of_a_hand_off(zk_url, backend, f"e{i}", limit) for i in range(3)]
        assert min(requests for requests, _ in tries) == 1
        for _, grant in tries:  # its node's lease, bounded by the session
            assert grant.remaining is not None and 20.0 < grant.remaining <= 30.0
    finally:
        backend.close()


def test_a_blocked_acquire_is_handed_the_lock_for_the_releases_request(
    zk_url: str, api: str
) -> None:
    """Through the public API, sync and asyncio: from the holder's release call to the return
    of the acquire blocked behind it, the server receives one request, the release's delete
    (the fewest of three tries: pings count too)."""
    url = zk_url + "&session_timeout=30s"
    holder_store = latchkey.connect(url)
    parent = holder_store.backend.store.parent("b")  # type: ignore[attr-defined]
    counts = []
    try:
        with _kazoo(zk_url) as zk:
            for _ in range(3):
                holder = holder_store.lock("b", ttl="30s", wait=0)
                assert holder.acquire()
                acquired, done = threading.Event(), threading.Event()
                thread = threading.Thread(target=_blocked_acquire, args=(api, url, acquired, done))
                thread.start()
                eventually(lambda: len(zk.get_children(parent)) == 2, what="the waiter in line")
                time.sleep(0.2)  # its node made, its watch set: it waits
                idle = -_srvr(zk_url, "Received") + _srvr(zk_url, "Received")
                before = _srvr(zk_url, "Received")
                holder.release()
                assert acquired.wait(10)
                counts.append(_srvr(zk_url, "Received") - before - idle)
                done.set()
                thread.join(10)
        assert min(counts) == 1
    finally:
        holder_store.close()


def _blocked_acquire(api: str, url: str, acquired: threading.Event, done: threading.Event) -> None:
    """Acquire ``b`` (blocking), tell ``acquired``, hold it until ``done``, release."""
    if api == "sync":
        with latchkey.connect(url) as store:
            lock = store.lock("b", ttl="30s", wait="10s")
            assert lock.acquire()
            acquired.set()
            done.wait(10)
            lock.release()
        return

    async def wait() -> None:
        async with latchkey.connect_async(url) as store:
            lock = store.lock("b", ttl="30s", wait="10s")
            assert await lock.acquire()
            acquired.set()
            await asyncio.to_thread(done.wait, 10)
            await lock.release()

    asyncio.run(wait())


def test_a_waiter_whose_session_may_end_soon_reads_the_line_first(zk_url: str) -> None:
    """Past a third of the session timeout since the waiter last sent a request, a watch
    event alone no longer hands the lease over: the session's end may be near (pings do not
    count: the waiter cannot see them), so it lists the line — a request that shows the
    session alive — and its lease is bounded from that request on."""
    backend = open_backend(zk_url + "&session_timeout=1.5s")
    try:
        tries = [_requests_of_a_hand_off(zk_url, backend, f"s{i}", 1, 0.6) for i in range(3)]
        assert min(requests for requests, _ in tries) == 2  # the delete, the waiter's listing
        for _, grant in tries:
            assert grant.remaining is not None and grant.remaining <= 1.5
    finally:
        backend.close()


def test_a_waiter_joins_the_line_of_a_name_purged_meanwhile(zk_url: str) -> None:
    """Joining the line does not make the name's node each time (a create that fails is a
    logged transaction too): if a purge took it since the first attempt, the join makes it.
    The holder's node it would watch is gone: the waiter reads the line, and holds."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        holder, waiting = new_owner_token(), new_owner_token()
        assert isinstance(backend.acquire("p", holder, INFO, 30.0, 1), Grant)
        assert isinstance(backend.acquire("p", waiting, INFO, 30.0, 1), Busy)
        assert backend.release("p", holder) is True
        backend.purge_expired()  # the name's node, left empty, goes
        with _kazoo(zk_url) as zk:
            assert zk.exists(backend.store.parent("p")) is None  # type: ignore[attr-defined]
        waiter = backend.wait_in_line("p", waiting, INFO, 30.0, 1)
        assert waiter is not None
        assert waiter.wait(0)  # its watch found the holder's node gone
        grant = backend.acquire("p", waiting, INFO, 30.0, 1)
        assert isinstance(grant, Grant)
        waiter.finish(grant)
        waiter.close()
        assert backend.release("p", waiting) is True
    finally:
        backend.close()


def test_force_release_deletes_a_line_front_to_back(zk_url: str) -> None:
    """A waiter handed the lease by its watch event alone counts on it: its own node is not
    deleted before the nodes ahead of it (it held the lease when its node went)."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        assert isinstance(backend.acquire("f", new_owner_token(), INFO, 30.0, 1), Grant)
        for _ in range(2):
            _in_line(backend, "f", 30.0)
        parent = backend.store.parent("f")  # type: ignore[attr-defined]
        with _kazoo(zk_url) as zk:
            line = sorted(zk.get_children(parent), key=lambda c: c[-10:])
            deleted: list[str] = []
            for child in line:
                zk.exists(f"{parent}/{child}", watch=lambda event: deleted.append(event.path))
            assert backend.force_release("f") is True
            eventually(lambda: len(deleted) == len(line), what="every deletion seen")
        assert deleted == [f"{parent}/{child}" for child in line]
    finally:
        backend.close()


def _in_line(backend: Any, name: str, ttl: float) -> tuple[str, Any]:
    """An owner with a node in line on ``name`` (its first attempt busy), and its waiter."""
    owner = new_owner_token()
    assert isinstance(backend.acquire(name, owner, INFO, ttl, 1), Busy)
    waiter = backend.wait_in_line(name, owner, INFO, ttl, 1)
    assert waiter is not None
    assert isinstance(backend.acquire(name, owner, INFO, ttl, 1), Busy)
    return owner, waiter


@pytest.mark.parametrize("holder_ttl", [30.0, 1.0])
def test_a_woken_waiter_reads_and_writes_only_when_the_holder_may_have_run_out(
    zk_url: str, holder_ttl: float
) -> None:
    """The waiter just ahead gives up (its node deleted, the watch fires): the woken waiter
    reads the line and finds the holder. Live for sure (30 s): busy, and no write. Run out
    (1 s, waited for by the server's clock) after the woken waiter's node was written: in
    doubt by a read, so the waiter rewrites its node and decides at that write: granted."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        holder = backend.acquire("w", new_owner_token(), INFO, holder_ttl, 1)
        assert isinstance(holder, Grant) and holder.expires_at is not None
        _, ahead = _in_line(backend, "w", 30.0)
        owner, waiter = _in_line(backend, "w", 30.0)
        if holder_ttl < 30:
            eventually(lambda: backend.now() > holder.expires_at, what="the holder ran out")
        before = _zxid(zk_url)
        ahead.finish(Busy(0))  # gives up (its wait ran out): its node goes
        ahead.close()
        assert waiter.wait(10)
        answer = backend.acquire("w", owner, INFO, 30.0, 1)
        if holder_ttl == 30:
            assert isinstance(answer, Busy) and answer.holder is not None
            assert answer.holder.token == holder.token
            assert _zxid(zk_url) - before == 1  # the waiter ahead's delete only
        else:
            assert isinstance(answer, Grant) and answer.token is not None
            assert answer.token > holder.token  # type: ignore[operator]
            # the delete of the node ahead, the waiter's refresh, the holder's stale node
            assert _zxid(zk_url) - before == 3
            info = backend.inspect("w")
            assert info is not None and [h.token for h in info.holders] == [answer.token]
        waiter.finish(answer)
        waiter.close()
    finally:
        backend.close()


def test_a_release_sure_to_be_live_is_one_delete(zk_url: str) -> None:
    """Released by the object that wrote its node, well within its TTL: one request (a
    versioned delete, as kazoo's lock), answered True. ``Received`` also counts pings: the
    fewest of three tries, less what a bare ``srvr`` adds."""
    backend = open_backend(zk_url + "&session_timeout=30s")
    try:
        counts = []
        for _ in range(3):
            owner = new_owner_token()
            assert isinstance(backend.acquire("r", owner, INFO, 30.0, 1), Grant)
            idle = -_srvr(zk_url, "Received") + _srvr(zk_url, "Received")
            zxid = _zxid(zk_url)
            before = _srvr(zk_url, "Received")
            assert backend.release("r", owner) is True
            counts.append(_srvr(zk_url, "Received") - before - idle)
            assert _zxid(zk_url) - zxid == 1
        assert min(counts) == 1
        assert backend.inspect("r") is None
    finally:
        backend.close()


def test_a_release_reads_the_node_another_object_rewrote(zk_url: str) -> None:
    """Another store object extended the lease (same owner): the versioned delete fails, the
    release reads the node and deletes it with the clock — still live, True. One that ran out
    is released False."""
    url = zk_url + "&session_timeout=30s"
    first, second = open_backend(url), open_backend(url)
    try:
        owner = new_owner_token()
        assert isinstance(first.acquire("r", owner, INFO, 30.0, 1), Grant)
        assert isinstance(second.extend("r", owner, 30.0), Grant)
        assert first.release("r", owner) is True
        assert first.inspect("r") is None
        short = first.acquire("s", owner, INFO, 0.3, 1)
        assert isinstance(short, Grant) and short.expires_at is not None
        eventually(lambda: first.now() > short.expires_at, what="the lease ran out")
        assert first.release("s", owner) is False
    finally:
        first.close()
        second.close()


def test_waiting_processes_counts_a_process_once_whatever_its_stores(
    zk_url: str, api: str
) -> None:
    """Each node in line carries its owner record (host, pid, process start): waiters of one
    process count once, however many stores (sessions), threads or coroutines they come
    from — unlike Redis, which counts one per store. Its holders are not counted; a second
    process is (tests/multiprocess/test_waiting_processes.py)."""
    name = f"procs:{uuid.uuid4().hex[:8]}"
    stores = [latchkey.connect(zk_url) for _ in range(2)]
    holder = stores[0].semaphore(name, limit=2, ttl="60s", wait=0)
    other = stores[1].semaphore(name, limit=2, ttl="60s", wait=0)
    assert holder.acquire() and other.acquire()  # two holders from two sessions
    waiters: list[threading.Thread] = []
    try:
        assert stores[0].inspect(name).waiting_processes == 0  # type: ignore[union-attr]
        if api == "sync":

            def wait_on(store: latchkey.Store) -> None:
                with store.semaphore(name, limit=2, ttl="60s", wait="30s"):
                    pass

            for store in stores:  # a waiting thread on each store: two sessions, one process
                waiters.append(threading.Thread(target=wait_on, args=(store,)))
                waiters[-1].start()
        else:

            async def wait_on_async(store: latchkey.AsyncStore) -> None:
                async with store.semaphore(name, limit=2, ttl="60s", wait="30s"):
                    pass

            async def wait_twice() -> None:
                async with latchkey.connect_async(zk_url) as one, \
                        latchkey.connect_async(zk_url) as two:  # fmt: skip
                    await asyncio.gather(*(wait_on_async(s) for s in (one, two, one)))

            waiters.append(threading.Thread(target=lambda: asyncio.run(wait_twice())))
            waiters[-1].start()

        # Every waiter has a node in line (a first try's node comes and goes before it: while
        # it is there it counts too, and as the same process): one process waits. Counted by
        # session it would be 2 or 3 whenever every waiter has a node.
        parent = stores[0].backend.store.parent(name)  # type: ignore[attr-defined]
        expected_nodes = 2 + (2 if api == "sync" else 3)

        def one_process_in_line() -> bool:
            info = stores[0].inspect(name)
            assert info is not None and len(info.holders) == 2
            return len(zk.get_children(parent)) == expected_nodes and info.waiting_processes == 1

        with _kazoo(zk_url) as zk:
            eventually(one_process_in_line, what="every waiter in line, one process")
        (listed,) = [i for i in stores[1].list(prefix="procs:") if i.name == name]
        assert listed.waiting_processes == 1
    finally:
        holder.release()
        other.release()
        for thread in waiters:
            thread.join(timeout=40)
        for store in stores:
            store.close()


@contextlib.contextmanager
def _kazoo(zk_url: str) -> Iterator[KazooClient]:
    """A kazoo client of the test's own on the URL's server (no chroot: latchkey's paths are
    absolute)."""
    client = KazooClient(hosts=zk_url.split("://", 1)[1].split("/", 1)[0])
    client.start(timeout=10)
    try:
        yield client
    finally:
        client.stop()
        client.close()
def test_a_wait_cut_off_by_the_network_fails_within_its_wait_and_timeout(
    zk_url: str, api: str
) -> None:
    """A waiter in line whose network goes black (a proxy stops forwarding, nothing is reset)
    just before the holder's lease runs out (the waiter must then ask the server) gets
    StoreUnavailable within its wait + the timeout + 1 s: leaving the line after the error is
    the core's background give-back, not one more request the caller waits out (it took
    wait + two timeouts: the chaos run's slow-call rule found it). Once the network heals,
    the node the waiter left in line is gone: the name is free, not blocked behind the failed
    waiter for its 60 s TTL."""
    import asyncio
    import threading
    from urllib.parse import urlsplit

    from latchkey import StoreUnavailable
    from tests.faults.proxy import Proxy

    timeout, wait = 2.0, 1.5
    port = urlsplit(zk_url).port
    assert port is not None
    proxy = Proxy("127.0.0.1", port)
    via = zk_url.replace(f":{port}", f":{proxy.port}", 1) + f"&timeout={timeout:g}s"
    holder = latchkey.connect(zk_url)
    lock = holder.lock("n", ttl="0.8s")
    other = latchkey.connect(zk_url)

    def heal(took: float) -> None:
        proxy.reset()
        proxy.heal()
        assert took < wait + timeout + 1.0, f"{took:.2f}s to report the cut-off network"

    def free() -> bool:
        return other.lock("n", ttl="1s", wait=0).acquire()

    try:
        assert lock.acquire()
        if api == "sync":
            waiter = latchkey.connect(via)
            assert waiter.lock("warm", ttl="1s", wait=0).acquire()  # the session is up
            threading.Timer(0.2, proxy.set, ("blackhole",)).start()  # while it waits in line
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                waiter.lock("n", ttl="60s", wait=wait).acquire()
            heal(time.monotonic() - started)
            # The waiter's session lives on (closing it would end its nodes anyway).
            eventually(free, timeout=10, what="the failed waiter's node given back")
            waiter.close()
        else:

            async def cut_off() -> None:
                async with latchkey.connect_async(via) as waiter:
                    assert await waiter.lock("warm", ttl="1s", wait=0).acquire()
                    threading.Timer(0.2, proxy.set, ("blackhole",)).start()
                    started = time.monotonic()
                    with pytest.raises(StoreUnavailable):
                        await waiter.lock("n", ttl="60s", wait=wait).acquire()
                    heal(time.monotonic() - started)
                    deadline = time.monotonic() + 10
                    while not free():  # the give-back is a task of this loop: keep it running
                        assert time.monotonic() < deadline, "the failed waiter's node stayed"
                        await asyncio.sleep(0.05)

            asyncio.run(cut_off())
    finally:
        proxy.close()
        other.close()
        holder.close()


def test_a_primitive_of_several_round_trips_keeps_to_one_timeout(zk_url: str) -> None:
    """``timeout`` bounds a whole call, however many round trips its primitive makes: on a
    slow network (each round trip ~0.4 s through a proxy, the timeout 1 s), purge_expired —
    four round trips — fails with StoreUnavailable within the timeout and a little, not
    answer after four round trips' time (each round trip had a timeout of its own: a release took
    two in the chaos run)."""
    from urllib.parse import urlsplit

    from latchkey import StoreUnavailable
    from tests.faults.proxy import Proxy

    timeout = 1.0
    port = urlsplit(zk_url).port
    assert port is not None
    direct = latchkey.connect(zk_url)
    for name in ("a", "b"):
        assert direct.lock(name, ttl="0.2s").acquire()  # left to run out: purge deletes them
    proxy = Proxy("127.0.0.1", port)
    slow = latchkey.connect(
        zk_url.replace(f":{port}", f":{proxy.port}", 1) + f"&timeout={timeout:g}s"
    )
    try:
        slow.inspect("a")  # the session is up, before the latency
        proxy.set("pass", latency=0.2)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            slow.purge_expired()
        took = time.monotonic() - started
        assert took < timeout + 0.5, f"{took:.2f}s for a call with a {timeout:g}s timeout"
    finally:
        proxy.heal()
        slow.close()
        proxy.close()
        direct.close()
