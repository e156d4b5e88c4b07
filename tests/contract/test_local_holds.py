"""Issue 17: threads (and asyncio tasks) of one process contending on one name through one
store object do not each pay a round trip to learn it is busy (``latchkey._core.holds``).

The store calls are counted by a wrapper around the store's own driver (``backend.io.run``,
which runs every primitive against the real server), not by a mock of the store. Each test
runs in the sync API and in the asyncio one (threads in the first, coroutines of one loop in
the second, through tests/asyncmode.py).
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import latchkey
from tests.helpers import eventually

STORE_ROWS = {"sqlite", "redis", "postgresql", "mysql", "memcached", "mongodb", "etcd"}
WAITERS = 8
#: How long the waiters are watched while the name is held: past the first safety-net polls
#: of every waiter (5 ms, doubling, up to 250 ms or 1 s), which before issue 17 were store
#: calls: at least 6 each in this window.
WINDOW = 1.5


def _count_store_calls(store: Any) -> Counter[str]:
    """Count every primitive the store object's driver runs, by action ("acquire", "wait" —
    joining the store's line —, "release"…)."""
    backend = getattr(store, "_target", store).backend  # through the asyncio facade
    calls: Counter[str] = Counter()
    run = backend.io.run
    if inspect.iscoroutinefunction(run):

        async def counted_async(steps: Any, action: str, *rest: Any) -> Any:
            calls[action] += 1
            return await run(steps, action, *rest)

        backend.io.run = counted_async
    else:

        def counted(steps: Any, action: str, *rest: Any) -> Any:
            calls[action] += 1
            return run(steps, action, *rest)

        backend.io.run = counted
    return calls


def _in_threads(n: int, target: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def test_waiters_on_a_name_held_here_do_not_ask_the_store(
    store_url: str, connect: Callable[[str], latchkey.Store], name: str
) -> None:
    store = connect(store_url)
    calls = _count_store_calls(store)
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    assert calls["acquire"] == 1
    first_token = holder.token or 0
    inside, peak, tokens = [0], [0], []
    guard = threading.Lock()

    def wait_and_hold() -> None:
        lock = store.lock(name, ttl="60s", wait="60s")
        assert lock.acquire()
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            tokens.append(lock.token)
        time.sleep(0.005)
        with guard:
            inside[0] -= 1
        lock.release()

    threads = _in_threads(WAITERS, wait_and_hold)
    try:
        eventually(lambda: calls["wait"] >= WAITERS, what="every waiter in line")
        time.sleep(WINDOW)  # the waiters' polls would come now: none reaches the store
        during = Counter(calls)
    finally:
        assert holder.release()
        for thread in threads:
            thread.join(timeout=60)
    assert during["acquire"] == 1, during  # was 1 + ≥ 6 per waiter before
    # Joining the store's line: a local line or a shared subscription, except PostgreSQL's
    # queue (one insert per waiter: its order is the store's, and stays so).
    assert during["wait"] == WAITERS
    assert len(tokens) == WAITERS and peak[0] == 1
    if store.capabilities.fencing:
        assert sorted(tokens) == tokens and tokens[0] > first_token


def test_a_try_on_a_name_held_here_answers_busy_with_the_holder_at_once(
    store_url: str, connect: Callable[[str], latchkey.Store], name: str
) -> None:
    store = connect(store_url)
    calls = _count_store_calls(store)
    holder = store.lock(name, ttl="60s", metadata={"job": "first"})
    assert holder.acquire()
    other = store.lock(name, ttl="60s", wait=0)
    assert other.acquire() is False
    assert calls["acquire"] == 1  # the try did not ask the store
    seen = other.holder
    assert seen is not None
    assert seen.owner.pid == os.getpid() and seen.owner.metadata == {"job": "first"}
    assert seen.token == holder.token and seen.expires_at == holder.expires_at
    with pytest.raises(latchkey.LockTimeout) as raised:
        with store.lock(name, ttl="60s", wait=0):
            pass
    assert raised.value.holder == seen and str(os.getpid()) in str(raised.value)
    assert calls["acquire"] == 1
    # Another store object knows nothing of this one's leases: it asks, and agrees.
    elsewhere = connect(store_url)
    far = elsewhere.lock(name, ttl="60s", wait=0)
    assert far.acquire() is False
    assert far.holder is not None and far.holder.token == holder.token
    holder.release()
    assert other.acquire() is True  # released: asked again, and granted
    other.release()


def test_a_semaphore_answers_busy_here_only_when_this_process_holds_every_slot(
    store_url: str, connect: Callable[[str], latchkey.Store], name: str
) -> None:
    store = connect(store_url)
    calls = _count_store_calls(store)
    first = store.semaphore(name, 2, ttl="60s", wait=0)
    second = store.semaphore(name, 2, ttl="60s", wait=0)
    assert first.acquire()
    assert second.acquire()  # one slot held here: the store is asked, and grants
    assert calls["acquire"] == 2
    third = store.semaphore(name, 2, ttl="60s", wait=0)
    assert third.acquire() is False
    assert calls["acquire"] == 2  # both slots held here: no round trip
    assert third.holder is not None and third.holder.token in (first.token, second.token)
    first.release()
    assert third.acquire() is True
    second.release()
    third.release()


def test_the_local_record_ends_with_the_holders_own_deadline(
    store_url: str, connect: Callable[[str], latchkey.Store], name: str
) -> None:
    store = connect(store_url)
    holder = store.lock(name, ttl="1s")  # not renewed, never released: it just expires
    assert holder.acquire()
    waiter = store.lock(name, ttl="60s", wait="20s")
    started = time.monotonic()
    assert waiter.acquire() is True
    assert time.monotonic() - started < 10
    assert holder.lost
    waiter.release()


def test_a_force_release_through_the_store_object_ends_its_local_records(
    store_url: str, connect: Callable[[str], latchkey.Store], name: str
) -> None:
    store = connect(store_url)
    if not store.capabilities.force_release:
        pytest.skip("no force-release")
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    assert store.force_release(name)
    other = store.lock(name, ttl="60s", wait=0)
    assert other.acquire() is True  # not answered busy from the holder's record
    other.release()
    assert holder.release() is False
