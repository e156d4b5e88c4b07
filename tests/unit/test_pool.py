"""The shared sync connection pool (latchkey.stores.io.Pool), without a server."""

from __future__ import annotations

import threading
import time

import pytest

from latchkey.stores.io import Pool


def test_the_sync_pool_opens_at_most_its_size_and_queues_the_rest() -> None:
    """The sync drivers' pool (lock-free reuse): never more than ``size`` connections, never
    one connection to two threads; a caller queues for one (up to its timeout, if any);
    close() closes the idle ones and those in use as they come back."""
    opened: list[object] = []
    closed: list[object] = []
    pool = Pool(lambda: opened.append(object()) or opened[-1], closed.append, alive=bool, size=3)
    in_use: set[int] = set()
    guard = threading.Lock()
    shared: list[bool] = []

    def worker() -> None:
        for _ in range(200):
            conn = pool.get()
            with guard:
                shared.append(id(conn) in in_use)
                in_use.add(id(conn))
            time.sleep(0.0001)
            with guard:
                in_use.discard(id(conn))
            pool.put(conn)

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(opened) <= 3 and not any(shared)
    held = [pool.get(), pool.get(), pool.get()]
    with pytest.raises(TimeoutError):
        pool.get(0.1)
    pool.put(held.pop())
    pool.close()
    assert len(closed) == len(opened) - 2  # the idle ones
    for conn in held:
        pool.put(conn)  # opened before close(): closed now
    assert sorted(map(id, closed)) == sorted(map(id, opened))
