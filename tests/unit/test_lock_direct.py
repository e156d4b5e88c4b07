"""The direct path of Lock and AsyncLock (``acquire``/``release`` composing the core's parts
without driving its generator) keeps the rules of the generator path: each test runs both
ways — as a user runs it (direct), and with tracing on, which sends every call through the
core's steps.

The store is ``memory://`` (a real store, in this process); a failure is made by wrapping its
backend's ``acquire``: the store grants, then the answer is lost or the caller interrupted.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

import latchkey
from latchkey import _observe
from tests.helpers import eventually


@pytest.fixture(params=["direct", "steps"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "steps":
        latchkey.enable_tracing(TracerProvider())
        assert _observe.hooks is not None
    else:
        assert _observe.hooks is None
    yield request.param
    latchkey.disable_tracing()


@pytest.fixture
def name() -> str:
    return f"direct-{uuid.uuid4().hex}"  # (memory:// is one store for the whole process)


def _granting_then(store: latchkey.Store, error: Callable[[], BaseException]) -> list[Any]:
    """Make the store grant the next acquire, then raise ``error()`` in place of its answer.
    The grants it made, for the test's checks."""
    backend = store.backend
    real = backend.acquire
    granted: list[Any] = []

    def acquire(*args: Any) -> Any:
        backend.acquire = real  # once
        granted.append(real(*args))
        raise error()

    backend.acquire = acquire
    return granted


def test_an_acquire_interrupted_after_the_grant_gives_it_back_at_once(path: str, name: str) -> None:
    store = latchkey.connect("memory://")
    granted = _granting_then(store, KeyboardInterrupt)
    lock = store.lock(name, ttl="60s", wait=0)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    assert type(granted[0]).__name__ == "Grant"
    assert not lock.held
    assert store.inspect(name) is None  # given back before the error reached the caller
    store.close()


def test_an_acquire_whose_answer_was_lost_gives_it_back_in_the_background(
    path: str, name: str
) -> None:
    store = latchkey.connect("memory://")
    granted = _granting_then(store, lambda: latchkey.StoreUnavailable("the answer was lost"))
    lock = store.lock(name, ttl="60s", wait=0)
    with pytest.raises(latchkey.StoreUnavailable):
        lock.acquire()
    assert type(granted[0]).__name__ == "Grant" and not lock.held
    eventually(lambda: store.inspect(name) is None, timeout=10, what="given back")
    store.close()


def test_busy_then_granted_within_the_wait_and_renewed(path: str, name: str) -> None:
    store = latchkey.connect("memory://")
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    waiter = store.lock(name, ttl="300ms", wait="10s", renew=True)
    # Another thread's lease, recorded by this store object: the direct path steps aside.
    assert not store.lock(name, wait=0).acquire()
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    assert waiter.acquire()
    timer.join()
    assert waiter._renewer is not None  # renewed past its 300 ms lease
    eventually(lambda: _renewed(store, name), timeout=5, what="renewed past its first lease")
    assert not waiter.lost
    assert waiter.release()
    assert waiter._renewer is None and store.inspect(name) is None
    store.close()


def _renewed(store: latchkey.Store, name: str) -> bool:
    return _past_first_lease(store.inspect(name))


def _past_first_lease(info: latchkey.LockInfo | None) -> bool:
    """Whether the lease ``info`` shows ends over 0.5 s after it began: renewed (a 300 ms
    lease)."""
    if info is None:
        return False
    holder = info.holder
    assert holder.acquired_at is not None and holder.expires_at is not None
    return (holder.expires_at - holder.acquired_at).total_seconds() > 0.5


def test_a_second_acquire_of_one_object_is_refused_and_release_twice_is_false(
    path: str, name: str
) -> None:
    store = latchkey.connect("memory://")
    lock = store.lock(name, ttl="60s", wait=0)
    assert lock.acquire()
    with pytest.raises(latchkey.LatchkeyError, match="already held by this object"):
        lock.acquire()
    assert lock.held
    assert lock.release() is True
    assert lock.release() is False
    with lock:
        assert lock.held
        with pytest.raises(latchkey.LockTimeout, match=f"'{name}' is busy"):
            store.lock(name, wait=0).__enter__()
    assert not lock.held
    store.close()


def test_an_uncontended_acquire_starts_its_renewer(path: str, name: str) -> None:
    store = latchkey.connect("memory://")
    lock = store.lock(name, ttl="300ms", wait=0, renew=True)
    assert lock.acquire()
    eventually(lambda: _renewed(store, name), timeout=5, what="renewed past its first lease")
    assert not lock.lost and lock.release()
    store.close()


# -- asyncio ---------------------------------------------------------------------------------


def _granting_then_async(
    store: latchkey.AsyncStore, error: Callable[[], BaseException]
) -> list[Any]:
    backend = store.backend
    real = backend.acquire
    granted: list[Any] = []

    async def acquire(*args: Any) -> Any:
        backend.acquire = real  # once
        granted.append(await real(*args))
        raise error()  # (a CancelledError here: the task cancelled while the call was out)

    backend.acquire = acquire
    return granted


def test_async_an_acquire_cancelled_after_the_grant_gives_it_back_at_once(
    path: str, name: str
) -> None:
    async def main() -> None:
        async with latchkey.connect_async("memory://") as store:
            granted = _granting_then_async(store, asyncio.CancelledError)
            lock = store.lock(name, ttl="60s", wait=0)
            with pytest.raises(asyncio.CancelledError):
                await lock.acquire()
            assert type(granted[0]).__name__ == "Grant" and not lock.held
            assert await store.inspect(name) is None  # given back before the error

    asyncio.run(main())


def test_async_an_acquire_whose_answer_was_lost_gives_it_back_in_the_background(
    path: str, name: str
) -> None:
    async def main() -> None:
        async with latchkey.connect_async("memory://") as store:
            lost = lambda: latchkey.StoreUnavailable("the answer was lost")  # noqa: E731
            granted = _granting_then_async(store, lost)
            lock = store.lock(name, ttl="60s", wait=0)
            with pytest.raises(latchkey.StoreUnavailable):
                await lock.acquire()
            assert type(granted[0]).__name__ == "Grant" and not lock.held
            for _ in range(1000):  # the give-back is a task of this loop
                if await store.inspect(name) is None:
                    break
                await asyncio.sleep(0.01)
            assert await store.inspect(name) is None

    asyncio.run(main())


def test_async_busy_then_granted_within_the_wait_and_renewed(path: str, name: str) -> None:
    async def main() -> None:
        other = latchkey.connect_async("memory://")  # another store object: no local record
        holder = other.lock(name, ttl="60s")
        assert await holder.acquire()
        async with latchkey.connect_async("memory://") as store:
            waiter = store.lock(name, ttl="300ms", wait="10s", renew=True)
            releasing = asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(holder.release())
            )
            assert await waiter.acquire()
            releasing.cancel()
            assert waiter._renewer is not None
            for _ in range(500):
                info = await store.inspect(name)
                assert info is not None
                if _past_first_lease(info):
                    break  # renewed past its 300 ms lease
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("not renewed")
            assert not waiter.lost and await waiter.release()
            assert waiter._renewer is None and await store.inspect(name) is None
            async with waiter:
                with pytest.raises(latchkey.LockTimeout, match=f"'{name}' is busy"):
                    await store.lock(name, wait=0).__aenter__()
        await other.aclose()

    asyncio.run(main())
