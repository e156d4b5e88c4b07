"""Failover tests: clusters of their own, a member killed while leases are held."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import latchkey
from tests.helpers import eventually
from tests.servers import wait_port_closed


def first_grant_after(store: latchkey.Store, name: str) -> float:
    """Try to take the fresh name ``name`` until it is granted (StoreUnavailable while the
    cluster has no leader or primary); the monotonic time of the grant."""

    def granted() -> float | None:
        try:
            if store.lock(name, ttl="30s").acquire(wait=0):
                return time.monotonic()
        except latchkey.StoreUnavailable:
            return None
        raise AssertionError(f"{name} is a fresh name but was busy")

    return eventually(granted, timeout=60, what="a grant after the failover")


def leader_kill_keeps_every_lease(
    url: str, leader_of: Callable[[], Any], what: str, patient: bool = False
) -> None:
    """Hold ten leases, SIGKILL the cluster's leader (``leader_of()``: a server with ``pid``
    and ``port``), and check that every lease is kept with its token, is still its holder's
    and can be extended, and that the next token is above every earlier one.

    ``patient``: the store may still answer StoreUnavailable for a while after the first grant
    (ZooKeeper's session moving to another server), so each check is retried until it
    answers."""
    with latchkey.connect(url) as holder, latchkey.connect(url) as other:
        locks = [holder.lock(f"held:{i}", ttl="60s") for i in range(10)]
        for lock in locks:
            assert lock.acquire(wait=0)
        tokens = {lock.name: lock.token for lock in locks}
        leader = leader_of()
        killed = time.monotonic()
        os.kill(leader.pid, signal.SIGKILL)
        wait_port_closed(leader.port)

        resumed = first_grant_after(other, "after:failover")
        print(f"\n{what}: grants resumed {resumed - killed:.2f} s after the leader was killed")
        for lock in locks:  # every lease kept, still its holder's
            if patient:
                info = eventually(lambda lock=lock: _inspect(other, lock.name), timeout=30,
                                  what="the store answering")  # fmt: skip
            else:
                info = other.inspect(lock.name)
            assert info is not None and info.token == tokens[lock.name]
            assert other.lock(lock.name, ttl="30s").acquire(wait=0) is False
            if patient:
                eventually(lambda lock=lock: _extend(lock), timeout=30, what="an extend")
            else:
                lock.extend()
        fresh = other.lock("after:tokens", ttl="30s")
        assert fresh.acquire(wait=0)
        assert fresh.token is not None and fresh.token > max(tokens.values())
        for lock in locks:
            assert lock.release()


def _inspect(store: latchkey.Store, name: str) -> latchkey.LockInfo | None:
    try:
        return store.inspect(name)
    except latchkey.StoreUnavailable:
        return None


def _extend(lock: latchkey.Lock) -> bool:
    try:
        lock.extend()
    except latchkey.StoreUnavailable:
        return False
    return True
