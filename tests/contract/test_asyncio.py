"""What only the asyncio API can get wrong, on every store that has an asyncio backend:
waiting without freezing the loop or holding threads, cancellation, renewal as a task."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import latchkey
from tests import servers


def _run(store_url: str, body: Callable[[latchkey.AsyncStore], Awaitable[Any]]) -> Any:
    try:
        store = latchkey.connect_async(store_url)
    except latchkey.Unsupported as exc:
        pytest.skip(f"async: not run: {exc}")

    async def main() -> Any:
        async with store:
            return await body(store)

    return asyncio.run(main())


def test_a_waiting_handler_does_not_freeze_the_loop(store_url: str, name: str) -> None:
    """The FastAPI-style handler: while one request waits for a lock another holds, the loop
    keeps serving everything else (with the sync lock inside ``async def`` it would stall)."""

    async def body(store: latchkey.AsyncStore) -> None:
        ticks: list[float] = []
        done = asyncio.Event()

        async def other_requests() -> None:
            while not done.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def handler() -> int | None:
            async with store.lock(name, ttl="30s", wait="20s") as lock:
                return lock.token

        holder = store.lock(name, ttl="30s")
        assert await holder.acquire()
        background = asyncio.create_task(other_requests())
        waiting = asyncio.create_task(handler())
        await asyncio.sleep(0.5)  # the handler is waiting; the loop must keep ticking
        assert not waiting.done()
        ticks_while_waiting = len(ticks)
        await holder.release()
        await asyncio.wait_for(waiting, 20)
        done.set()
        await background
        # About 50 ticks in 0.5 s when the loop is free; a blocked loop gives none until the
        # holder's release, which itself needs the loop (a stall of the whole wait, 20 s).
        assert ticks_while_waiting >= 5
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert max(gaps) < 2.0, f"the loop stalled for {max(gaps):.2f}s"

    _run(store_url, body)


def test_cancelling_a_waiting_acquire_leaves_nothing_held(store_url: str, name: str) -> None:
    async def body(store: latchkey.AsyncStore) -> None:
        holder = store.lock(name, ttl="30s")
        assert await holder.acquire()
        waiter = store.lock(name, ttl="30s", wait="30s")
        task = asyncio.create_task(waiter.acquire())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not waiter.held
        assert await holder.release()
        if store.capabilities.ttl or store.capabilities.listing:
            assert await store.is_free(name)
        # and the name (and the backend) still work for the next taker
        again = store.lock(name, ttl="30s", wait=0)
        assert await again.acquire()
        assert await again.release()

    _run(store_url, body)


def test_many_waiters_in_one_loop_hold_no_threads(store_url: str, name: str) -> None:
    """1,000 coroutines wait on one name; each takes it in turn. The threads in use stay a
    handful whatever the number of waiters. (100 on MongoDB: the test server is an emulated
    ARM64 build that answers ~200 requests a second, and 1,000 waiters polling it queue
    behind each other for minutes; the waiting itself is the same code as on every store.
    Likewise on etcd: each attempt is a raft transaction over HTTP/JSON, a few hundred a
    second from one Python process on our 2-core machines, and 1,000 waiters re-trying once a
    second — the core's cap between attempts of a push store — take longer than the test.)"""
    count = 100 if store_url.startswith(("mongodb", "etcd")) else 1000

    async def body(store: latchkey.AsyncStore) -> None:
        holder = store.lock(name, ttl="60s")
        assert await holder.acquire()
        taken: list[int] = []
        inside = 0

        async def waiter(i: int) -> None:
            nonlocal inside
            async with store.lock(name, ttl="60s", wait="120s"):
                inside += 1
                assert inside == 1
                taken.append(i)
                inside -= 1

        threads_before = threading.active_count()
        tasks = [asyncio.create_task(waiter(i)) for i in range(count)]
        await asyncio.sleep(0.3)  # every waiter has tried once and is waiting now
        assert threading.active_count() - threads_before < 10
        assert not taken
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert sorted(taken) == list(range(count))

    # What is tested is threads, not latency: 1,000 first attempts and subscriptions at once
    # may queue for seconds on a loaded machine, so the store's timeout is generous here.
    _run(servers.with_query(store_url, timeout="30s"), body)


def test_renewal_is_a_task_and_keeps_the_lease(store_url: str, name: str) -> None:
    async def body(store: latchkey.AsyncStore) -> None:
        if not store.capabilities.ttl:
            pytest.skip(f"{store.scheme} store declares no ttl (capabilities)")
        lock = store.lock(name, ttl="2s", renew=True)
        assert await lock.acquire()
        assert not [t for t in threading.enumerate() if t.name.startswith("latchkey-renew")]
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("latchkey-renew")]
        token = lock.token
        await asyncio.sleep(5)  # two and a half lease lengths: only renewal keeps it
        assert not lock.lost and lock.token == token
        info = await store.inspect(name)
        assert info is not None and info.token == token
        assert await lock.release()

    _run(store_url, body)


def test_an_async_on_lost_callback_is_awaited(store_url: str, name: str) -> None:
    async def body(store: latchkey.AsyncStore) -> None:
        if not store.capabilities.force_release:
            pytest.skip(f"{store.scheme} store declares no force_release (capabilities)")
        told = asyncio.Event()
        seen: list[object] = []

        async def alert(lock: object) -> None:
            await asyncio.sleep(0)  # a coroutine: awaited in the loop, not just created
            seen.append(lock)
            told.set()

        lock = store.lock(name, ttl="600ms", renew=True, on_lost=alert)
        assert await lock.acquire()
        assert await store.force_release(name)
        await asyncio.wait_for(told.wait(), 20)
        assert seen == [lock] and lock.lost
        assert await lock.release() is False

    _run(store_url, body)
