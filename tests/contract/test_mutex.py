"""The mutex semantics of DESIGN.md §2, on every store in the table (tests/servers)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime

import pytest

import latchkey
from latchkey import InvalidName, InvalidValue, LatchkeyError, LockLost, LockTimeout
from tests.helpers import HOSTILE_NAMES, eventually


def test_acquire_release(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="30s", wait=0)
    assert lock.acquire() is True
    assert lock.held and not lock.lost
    info = store.inspect(name)
    assert info is not None and info.name == name and len(info.holders) == 1
    if store.capabilities.listing:
        assert str(info.owner).startswith(f"{os.getpid()}@")
    if store.capabilities.fencing:
        assert isinstance(lock.token, int) and lock.token > 0
        assert info.token == lock.token
    if store.capabilities.ttl:
        assert isinstance(lock.expires_at, datetime)
        assert lock.expires_at > store.now()
    assert not store.is_free(name)
    assert lock.release() is True
    assert not lock.held
    assert store.is_free(name)
    assert lock.release() is False  # not held any more: a no-op


def test_mutual_exclusion_and_busy_holder(store: latchkey.Store, name: str) -> None:
    first = store.lock(name, ttl="30s", metadata={"job": "nightly"})
    first.acquire()
    second = store.lock(name, ttl="30s", wait=0)
    assert second.acquire() is False
    assert not second.held
    if store.capabilities.listing or store.capabilities.ttl:
        assert second.holder is not None
        assert second.holder.owner.metadata == {"job": "nightly"}
    with pytest.raises(LockTimeout) as caught:
        with store.lock(name, ttl="30s", wait=0):
            pytest.fail("entered a held lock")
    assert name in str(caught.value)
    assert isinstance(caught.value, TimeoutError)
    first.release()
    assert second.acquire() is True
    second.release()


def test_two_store_objects_exclude_each_other(
    store_url: str, name: str, connect: Callable[[str], latchkey.Store]
) -> None:
    a, b = connect(store_url), connect(store_url)
    try:
        with a.lock(name, ttl="30s"):
            assert b.lock(name, ttl="30s", wait=0).acquire() is False
        assert b.lock(name, ttl="30s", wait=0).acquire() is True
    finally:
        a.close()
        b.close()


def test_a_name_found_busy_is_waited_for_in_the_server_without_a_new_attempt(
    store_url: str, name: str, connect: Callable[[str], latchkey.Store]
) -> None:
    # Stores that wait in the server (capabilities.blocking: the session locks): an attempt
    # that found the name busy a moment ago sends the next waiting acquire of it straight to
    # its wait, one round trip where the attempt, the holder's look-up and the wait were
    # three. Seen in the round trips each primitive made (the metrics).
    from prometheus_client import CollectorRegistry

    a, b = connect(store_url), connect(store_url)
    if not a.capabilities.blocking:
        pytest.skip(f"{a.scheme}: waits by polling or push, not in the server (blocking)")
    registry = CollectorRegistry()
    latchkey.enable_metrics(registry)
    try:

        def trips(operation: str) -> float:
            labels = {"store": a.scheme, "operation": operation}
            return registry.get_sample_value("latchkey_store_round_trip_seconds_count",
                                             labels) or 0.0  # fmt: skip

        with a.lock(name, ttl="30s"):
            assert b.lock(name, ttl="30s", wait=0).acquire() is False  # an attempt: busy
        attempts, waits = trips("acquire"), trips("acquire_blocking")
        with b.lock(name, ttl="30s", wait="10s") as lock:
            assert lock.held
        assert (trips("acquire"), trips("acquire_blocking")) == (attempts, waits + 1)
        with a.lock(name, ttl="30s", wait=0):  # the other backend never found it busy
            pass
        assert trips("acquire_blocking") == waits + 1
    finally:
        latchkey.disable_metrics()


def test_context_manager_releases_on_exception(store: latchkey.Store, name: str) -> None:
    with pytest.raises(RuntimeError), store.lock(name, ttl="30s"):
        assert not store.is_free(name)
        raise RuntimeError("boom")
    assert store.is_free(name)


def test_lock_object_is_reusable_but_not_reentrant(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="30s", wait=0)
    assert lock.acquire()
    with pytest.raises(LatchkeyError):
        lock.acquire()
    assert lock.release()
    assert lock.acquire()
    assert lock.release()


@pytest.mark.requires("fencing")
def test_tokens_increase_across_release(store: latchkey.Store, name: str) -> None:
    tokens = []
    for _ in range(3):
        with store.lock(name, ttl="30s") as lock:
            tokens.append(lock.token)
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


@pytest.mark.requires("fencing", "force_release")
def test_tokens_increase_across_force_release(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="30s")
    lock.acquire()
    assert store.force_release(name) is True
    with store.lock(name, ttl="30s", wait=0) as newer:
        assert newer.token is not None and lock.token is not None
        assert newer.token > lock.token


@pytest.mark.requires("fencing", "ttl")
def test_tokens_increase_across_expiry_and_purge(store: latchkey.Store, name: str) -> None:
    first = store.lock(name, ttl="200ms")
    first.acquire()
    eventually(lambda: store.is_free(name), what="lease expiry")
    if store.capabilities.listing:
        store.purge_expired()
    second = store.lock(name, ttl="30s", wait=0)
    assert second.acquire()
    assert second.token is not None and first.token is not None
    assert second.token > first.token
    second.release()


@pytest.mark.requires("ttl")
def test_expired_lease_is_free_for_the_next_taker(store: latchkey.Store, name: str) -> None:
    store.lock(name, ttl="200ms").acquire()
    taker = store.lock(name, ttl="30s", wait="20s")
    assert taker.acquire() is True  # freed by expiry, not by release
    taker.release()


@pytest.mark.requires("ttl")
def test_release_after_expiry_returns_false(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="200ms")
    lock.acquire()
    eventually(lambda: store.is_free(name), what="lease expiry")
    assert lock.release() is False


@pytest.mark.requires("ttl")
def test_extend_after_expiry_raises_lock_lost(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="200ms")
    lock.acquire()
    eventually(lambda: store.is_free(name), what="lease expiry")
    with pytest.raises(LockLost):
        lock.extend("10s")
    assert lock.lost


@pytest.mark.requires("ttl")
def test_old_holder_never_touches_the_new_holders_lease(store: latchkey.Store, name: str) -> None:
    old = store.lock(name, ttl="200ms")
    old.acquire()
    new = store.lock(name, ttl="30s", wait="20s")
    assert new.acquire()
    assert old.release() is False
    with pytest.raises(LockLost):
        old.extend("30s")
    info = store.inspect(name)
    assert info is not None and len(info.holders) == 1
    if store.capabilities.fencing:
        assert info.token == new.token
    assert new.release() is True


def test_extend_by_a_non_holder_raises(store: latchkey.Store, name: str) -> None:
    holder = store.lock(name, ttl="30s")
    holder.acquire()
    other = store.lock(name, ttl="30s", wait=0)
    with pytest.raises(LockLost):
        other.extend()
    assert other.release() is False
    assert not store.is_free(name)
    holder.release()


@pytest.mark.requires("ttl")
def test_extend_moves_the_expiry(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="5s")
    lock.acquire()
    before = lock.expires_at
    token = lock.token
    lock.extend("60s")
    assert lock.expires_at is not None and before is not None
    assert lock.expires_at > before
    assert lock.token == token
    lock.release()


@pytest.mark.requires("ttl")
def test_holder_gives_up_by_its_own_clock(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="300ms")
    lock.acquire()
    lock.check()
    eventually(lambda: lock.lost, what="local deadline")
    with pytest.raises(LockLost):
        lock.check()
    # The local deadline passes before the store frees the lease (drift margin).
    lock.release()


@pytest.mark.requires("ttl")
def test_renewal_keeps_the_lease_alive(store: latchkey.Store, name: str) -> None:
    # 2 s leases renewed every 0.67 s: a renewal may run late by a second on a loaded machine
    # (the asyncio API renews from a task in a loop that the test's thread shares the CPU with).
    lock = store.lock(name, ttl="2s", renew=True)
    lock.acquire()
    first_expiry = lock.expires_at
    eventually(lambda: lock.expires_at != first_expiry, what="a renewal")
    time.sleep(2.5)  # longer than the TTL: only renewal can keep the lease
    assert not lock.lost
    lock.check()
    assert store.lock(name, ttl="1s", wait=0).acquire() is False
    assert lock.release() is True


@pytest.mark.requires("force_release")
def test_renewal_failure_marks_the_lock_lost(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="600ms", renew=True)
    lock.acquire()
    assert store.force_release(name) is True
    eventually(lambda: lock.lost, what="renewer noticing the lost lease")
    with pytest.raises(LockLost):
        lock.check()
    assert lock.release() is False


@pytest.mark.requires("force_release")
def test_a_lost_lease_calls_on_lost_once_and_logs_a_warning(
    store: latchkey.Store, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[object] = []
    lock = store.lock(name, ttl="600ms", renew=True, on_lost=calls.append)
    lock.acquire()
    token = lock.token
    with caplog.at_level(logging.WARNING, logger="latchkey"):
        assert store.force_release(name) is True
        eventually(lambda: calls, what="on_lost called by the renewer")
        with pytest.raises(LockLost):
            lock.extend()  # learns the loss again: no second call, no second warning
    assert len(calls) == 1 and calls[0] is not None and lock.lost
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "lost" in r.message]
    assert len(warnings) == 1, [r.message for r in warnings]
    assert name in warnings[0].message and f"token {token}" in warnings[0].message
    assert lock.release() is False
    # A new lease of the same object is watched again.
    assert lock.acquire()
    assert store.force_release(name) is True
    eventually(lambda: len(calls) == 2, what="on_lost for the second lease")
    lock.release()


def test_on_lost_must_be_callable(store: latchkey.Store, name: str) -> None:
    with pytest.raises(InvalidValue, match="on_lost"):
        store.lock(name, on_lost="alert")  # type: ignore[arg-type]


def test_blocking_wait_is_woken_by_release(store: latchkey.Store, name: str) -> None:
    holder = store.lock(name, ttl="60s")
    holder.acquire()
    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(store.lock(name, ttl="60s", wait="30s").acquire())
    )
    waiter.start()
    eventually(lambda: waiter.is_alive(), what="waiter started")
    holder.release()
    waiter.join(timeout=40)
    assert result == [True]  # the lease was 60 s long: only the release can have freed it


#: The stores whose LockInfo says how many processes wait (Redis: the subscribers of the
#: name's wake channel; ZooKeeper: the processes with a node in line); every other store
#: answers None: it cannot tell.
COUNTS_WAITERS = {"redis", "rediss", "redis+sentinel", "redis+cluster", "zookeeper"}


def test_inspect_says_how_many_wait_where_the_store_can_tell(
    store: latchkey.Store, name: str
) -> None:
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    waiter = threading.Thread(target=lambda: store.lock(name, ttl="60s", wait="30s").acquire())
    try:
        waiter.start()
        if store.scheme in COUNTS_WAITERS:
            eventually(lambda: store.inspect(name).waiting_processes == 1,  # type: ignore[union-attr]
                       what="the waiter counted")  # fmt: skip
        else:
            eventually(waiter.is_alive, what="waiter started")
            info = store.inspect(name)
            assert info is not None and info.waiting_processes is None
            if store.capabilities.listing:
                assert [i.waiting_processes for i in store.list(prefix=name)] == [None]
    finally:
        holder.release()
        waiter.join(timeout=40)


def test_wait_gives_up_after_the_wait(store: latchkey.Store, name: str) -> None:
    holder = store.lock(name, ttl="60s")
    holder.acquire()
    started = time.monotonic()
    assert store.lock(name, ttl="60s", wait="300ms").acquire() is False
    assert time.monotonic() - started >= 0.3
    holder.release()


@pytest.mark.requires("force_release")
def test_force_release(store: latchkey.Store, name: str) -> None:
    lock = store.lock(name, ttl="60s")
    lock.acquire()
    assert store.force_release(name) is True
    assert store.is_free(name)
    assert store.force_release(name) is False
    assert lock.release() is False
    with pytest.raises(LockLost):
        lock.extend()


@pytest.mark.requires("listing")
def test_list_by_prefix(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:b", f"{name}:a", f"{name}x"]
    locks = [store.lock(n, ttl="60s") for n in names]
    for lock in locks:
        lock.acquire()
    listed = [info.name for info in store.list(prefix=f"{name}:")]
    assert listed == [f"{name}:a", f"{name}:b"]
    assert {info.name for info in store.list(prefix=name)} == set(names)
    for lock in locks:
        lock.release()
    assert list(store.list(prefix=name)) == []


@pytest.mark.requires("listing", "ttl")
def test_purge_removes_only_expired(store: latchkey.Store, name: str) -> None:
    short = store.lock(f"{name}:short", ttl="200ms")
    short.acquire()
    live = store.lock(f"{name}:live", ttl="60s")
    live.acquire()
    eventually(lambda: store.is_free(f"{name}:short"), what="lease expiry")
    assert store.purge_expired() >= 0
    assert [i.name for i in store.list(prefix=name)] == [f"{name}:live"]
    live.release()


#: Stores that keep an expired lease until it is purged (Redis and memcached drop their own;
#: so does MongoDB's TTL monitor, which runs every 60 s and in one CI rehearsal removed the
#: whole backlog between its expiry and the purge: purged 0 of 1,200).
KEEP_EXPIRED = {"memory", "sqlite", "postgresql", "mysql"}


@pytest.mark.requires("listing", "ttl", "claims")
def test_purge_clears_a_backlog_larger_than_a_batch(store: latchkey.Store, name: str) -> None:
    """More expired leases than one purge batch (``PURGE_BATCH``): one call clears them all,
    batch after batch, and leaves the live lease."""
    backlog = 1_200
    # long enough for the claim to come back before its leases end (the emulated mongod of
    # the tests takes seconds for 1,200 upserts on a loaded machine)
    ttl = "6s" if store.scheme == "mongodb" else "1s"
    claim = store.claim([f"{name}:{i:04}" for i in range(backlog)], ttl=ttl)
    assert len(claim) == backlog
    live = store.lock(f"{name}:live", ttl="60s")
    live.acquire()
    last = store.lock(f"{name}:last", ttl=ttl)  # ends after the claim's leases
    last.acquire()
    eventually(lambda: store.is_free(f"{name}:last"), what="lease expiry")
    purged = store.purge_expired()
    if store.scheme in KEEP_EXPIRED:  # (inspecting "last" may have tidied that one away)
        assert purged >= backlog
    assert [i.name for i in store.list(prefix=name)] == [f"{name}:live"]
    live.release()


@pytest.mark.parametrize("hostile", HOSTILE_NAMES)
def test_any_name_is_just_a_name(store: latchkey.Store, hostile: str) -> None:
    with store.lock(hostile, ttl="30s") as lock:
        info = store.inspect(hostile)
        assert info is not None and info.name == hostile
        assert store.lock(hostile, wait=0).acquire() is False
        if store.capabilities.listing:
            assert hostile in [i.name for i in store.list(prefix=hostile[:5])]
        assert lock.held
    assert store.is_free(hostile)


@pytest.mark.requires("listing")
def test_like_wildcards_in_prefix_are_literal(store: latchkey.Store, name: str) -> None:
    with store.lock(f"{name}:a_c", ttl="30s"), store.lock(f"{name}:abc", ttl="30s"):
        assert [i.name for i in store.list(prefix=f"{name}:a_")] == [f"{name}:a_c"]
        assert [i.name for i in store.list(prefix=f"{name}:%")] == []


@pytest.mark.parametrize("bad", ["", "x" * 256, "é" * 128, "\ud800", None, 42])
def test_invalid_names(store: latchkey.Store, bad: object) -> None:
    with pytest.raises(InvalidName):
        store.lock(bad, ttl="1s")  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        store.inspect(bad)  # type: ignore[arg-type]
