"""Semaphores: at most N live holders, each its own lease, owner and fencing token."""

from __future__ import annotations

import threading
import time

import pytest

import latchkey
from latchkey import ConfigError
from tests.helpers import eventually

pytestmark = pytest.mark.requires("semaphores")


def test_at_most_limit_holders(store: latchkey.Store, name: str) -> None:
    slots = [store.semaphore(name, 3, ttl="30s", wait=0) for _ in range(4)]
    assert [s.acquire() for s in slots] == [True, True, True, False]
    info = store.inspect(name)
    assert info is not None and len(info.holders) == 3
    if store.capabilities.fencing:
        tokens = [s.token for s in slots[:3]]
        assert len(set(tokens)) == 3 and all(isinstance(t, int) for t in tokens)
        assert {h.token for h in info.holders} == set(tokens)
    assert slots[1].release() is True
    assert slots[3].acquire() is True
    assert len(store.inspect(name).holders) == 3  # type: ignore[union-attr]
    for s in (slots[0], slots[2], slots[3]):
        assert s.release() is True
    assert store.is_free(name)


def test_limit_one_is_a_mutex(store: latchkey.Store, name: str) -> None:
    with store.lock(name, ttl="30s"):
        assert store.semaphore(name, 1, ttl="30s", wait=0).acquire() is False


def test_semaphore_context_manager(store: latchkey.Store, name: str) -> None:
    with store.semaphore(name, 2, ttl="30s") as a, store.semaphore(name, 2, ttl="30s") as b:
        assert a.held and b.held
        with pytest.raises(latchkey.LockTimeout):
            with store.semaphore(name, 2, ttl="30s", wait=0):
                pytest.fail("a third holder entered a semaphore of 2")
    assert store.is_free(name)


@pytest.mark.requires("ttl")
def test_expired_slot_is_free_again(store: latchkey.Store, name: str) -> None:
    short = store.semaphore(name, 2, ttl="200ms")
    short.acquire()
    long = store.semaphore(name, 2, ttl="30s")
    long.acquire()
    third = store.semaphore(name, 2, ttl="30s", wait="20s")
    assert third.acquire() is True  # only the short lease's expiry frees a slot
    assert short.release() is False
    assert long.release() and third.release()


def test_other_holders_leases_are_untouched_by_release(store: latchkey.Store, name: str) -> None:
    a = store.semaphore(name, 2, ttl="30s")
    b = store.semaphore(name, 2, ttl="30s")
    a.acquire()
    b.acquire()
    assert a.release() is True
    assert a.release() is False
    info = store.inspect(name)
    assert info is not None and len(info.holders) == 1
    if store.capabilities.fencing:
        assert info.token == b.token
    b.release()


def test_threads_never_exceed_the_limit(store: latchkey.Store, name: str) -> None:
    inside = 0
    peak = 0
    guard = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal inside, peak
        try:
            for _ in range(5):
                with store.semaphore(name, 2, ttl="30s", wait="60s"):
                    with guard:
                        inside += 1
                        peak = max(peak, inside)
                    time.sleep(0.005)
                    with guard:
                        inside -= 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert 1 <= peak <= 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_bad_limit(store: latchkey.Store, name: str, bad: object) -> None:
    with pytest.raises(ConfigError, match="limit"):
        store.semaphore(name, bad)  # type: ignore[arg-type]


def test_waiter_gets_a_slot_on_release(store: latchkey.Store, name: str) -> None:
    holders = [store.semaphore(name, 2, ttl="60s") for _ in range(2)]
    for h in holders:
        h.acquire()
    got: list[bool] = []
    t = threading.Thread(
        target=lambda: got.append(store.semaphore(name, 2, ttl="60s", wait="30s").acquire())
    )
    t.start()
    eventually(t.is_alive, what="waiter started")
    holders[0].release()
    t.join(timeout=40)
    assert got == [True]
    holders[1].release()
