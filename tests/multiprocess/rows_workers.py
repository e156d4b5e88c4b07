"""Row-claiming workers run in child processes (tests/multiprocess/conftest.py): each takes
or leases batches of the events table until none is due, recording each row's work in the
done table in the same transaction as the row's update (take, and lease with complete) or
before releasing its lease (lease)."""

from __future__ import annotations

import os
import time

import latchkey
from tests.appdb import AppDB


def take_worker(url: str, events: str, done: str, limit: int, pause: float) -> None:
    """Exactly once: the done row and the event's update commit with the batch."""
    store = latchkey.connect(url)
    p = AppDB.placeholder_of(url)
    queue = store.rows(events, key="id", where="processed_at IS NULL", order_by="id")
    me = str(os.getpid())
    while True:
        with queue.take(limit=limit, wait="1s") as batch:
            if not batch:
                break
            for row in batch:
                batch.execute(f"INSERT INTO {done} (event_id, worker) VALUES ({p}, {p})",
                              (row["id"], me))  # fmt: skip
                time.sleep(pause)  # a window for SIGKILL in the middle of a batch
                batch.execute(f"UPDATE {events} SET processed_at = 1 WHERE id = {p}", (row["id"],))
    store.close()


def lease_worker(url: str, events: str, done: str, limit: int, pause: float) -> None:
    """At least once: the done row (with the lease's token) is written, the event marked,
    then the lease released."""
    store = latchkey.connect(url)
    p = AppDB.placeholder_of(url)
    queue = store.rows(events, key="id", where="processed_at IS NULL", order_by="id")
    me = str(os.getpid())
    while True:
        with queue.lease(limit=limit, ttl="2s", wait="2.5s") as batch:
            if not batch:
                break
            for row in batch:
                batch.execute(
                    f"INSERT INTO {done} (event_id, worker, token) VALUES ({p}, {p}, {p})",
                    (row["id"], me, batch.token(row)),
                )
                time.sleep(pause)
                batch.execute(f"UPDATE {events} SET processed_at = 1 WHERE id = {p}", (row["id"],))
                batch.done(row)
    store.close()


def complete_worker(url: str, events: str, done: str, limit: int, pause: float) -> None:
    """Exactly once under lease: each row's done row and update commit with the end of its
    lease (``complete``), only if the lease is still ours."""
    store = latchkey.connect(url)
    p = AppDB.placeholder_of(url)
    queue = store.rows(events, key="id", where="processed_at IS NULL", order_by="id")
    me = str(os.getpid())
    while True:
        with queue.lease(limit=limit, ttl="2s", wait="2.5s") as batch:
            if not batch:
                break
            for row in batch:
                try:
                    with batch.complete(row) as tx:
                        tx.execute(
                            f"INSERT INTO {done} (event_id, worker, token) VALUES ({p}, {p}, {p})",
                            (row["id"], me, batch.token(row)),
                        )
                        time.sleep(pause)  # a window for SIGKILL inside the transaction
                        tx.execute(f"UPDATE {events} SET processed_at = 1 WHERE id = {p}",
                                   (row["id"],))  # fmt: skip
                except latchkey.LockLost:
                    continue  # the lease ran out: rolled back, the row is another's now
    store.close()
