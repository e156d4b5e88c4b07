"""Renewal holds only a weak reference: a forgotten held lock stops its renewer, in the sync
API (a thread) and in the asyncio API (a task)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from typing import Any

import latchkey
from tests.helpers import eventually


def _renewers(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"latchkey-renew:{prefix}")]


def test_a_forgotten_lock_stops_its_renewer_at_once() -> None:
    store = latchkey.connect("memory://")
    lock = store.lock("forgotten", ttl="60s", renew=True)  # renews every 20 s
    assert lock.acquire()
    assert len(_renewers("forgotten")) == 1
    del lock
    gc.collect()
    # Without the weakref callback the thread would sleep on until its next renewal (20 s).
    eventually(lambda: not _renewers("forgotten"), timeout=5, what="the renewer ended")


def test_a_held_lock_keeps_its_renewer() -> None:
    store = latchkey.connect("memory://")
    lock = store.lock("kept", ttl="60s", renew=True)
    assert lock.acquire()
    gc.collect()
    assert any(t.name == "latchkey-renew:kept" for t in threading.enumerate())
    lock.release()
    assert not any(t.name == "latchkey-renew:kept" for t in threading.enumerate())


def _renew_tasks(name: str) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == f"latchkey-renew:{name}"]


def test_async_renewal_is_a_task_that_a_forgotten_lock_cancels() -> None:
    async def main() -> None:
        store = latchkey.connect_async("memory://")
        lock = store.lock("a-forgotten", ttl="60s", renew=True)
        assert await lock.acquire()
        (task,) = _renew_tasks("a-forgotten")
        assert _renewers("a-forgotten") == []  # a task, not a thread
        del lock
        gc.collect()
        await asyncio.wait_for(asyncio.shield(asyncio.gather(task, return_exceptions=True)), 5)
        assert task.cancelled()

    asyncio.run(main())


def test_a_renewed_async_lock_collected_after_its_loop_closed_raises_nothing() -> None:
    """The lease's collection cancels its renewal through the loop; once the loop is closed
    there is nothing left to cancel, and nothing to report (the weakref callback used to
    raise "Event loop is closed", an unraisable exception)."""
    kept: list[Any] = []

    async def main() -> None:
        store = latchkey.connect_async("memory://")
        lock = store.lock("outlives-its-loop", ttl="60s", renew=True)
        assert await lock.acquire()
        kept.append(lock)

    asyncio.run(main())
    seen: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        kept.clear()
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [str(u.exc_value) for u in seen] == []


def test_async_renewal_keeps_a_short_lease_alive_and_stops_on_release() -> None:
    async def main() -> None:
        async with latchkey.connect_async("memory://") as store:
            lock = store.lock("a-kept", ttl="0.3s", renew=True)
            assert await lock.acquire()
            token = lock.token
            await asyncio.sleep(0.6)  # two lease lengths: only renewal keeps it
            assert not lock.lost and lock.token == token
            info = await store.inspect("a-kept")
            assert info is not None and info.token == token
            assert await lock.release() is True
            assert _renew_tasks("a-kept") == []

    asyncio.run(main())
