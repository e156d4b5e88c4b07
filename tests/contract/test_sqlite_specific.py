"""SQLite's own behaviour under contention: what the conformance suite cannot see.

A waiting attempt at a name that an attempt through the same store object found busy a moment
ago reads the name's live leases first, without SQLite's one write lock, and answers busy from
that read; only a name that looks free is attempted in a write transaction. So while another
connection keeps the write lock (a holder's release, another process's attempt), a contended
attempt is answered at once instead of waiting for the lock.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import latchkey


def test_an_attempt_at_a_name_found_busy_reads_before_it_takes_the_write_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "locks.db"
    holder = latchkey.connect(f"sqlite:///{path}")
    waiter = latchkey.connect(f"sqlite:///{path}?timeout=2")
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        with holder.lock("job", ttl="30s"):
            assert waiter.lock("job", ttl="30s", wait=0).acquire() is False  # found busy
            writer.execute("BEGIN IMMEDIATE")  # the write lock, kept
            try:
                started = time.monotonic()
                again = waiter.lock("job", ttl="30s", wait=0)
                assert again.acquire() is False  # answered from a read: no write lock needed
                assert time.monotonic() - started < 1.0  # not after the 2 s busy timeout
                assert again.holder is not None and again.holder.token is not None
                # A name never found busy still needs the write lock: it waits for it, and
                # a store that cannot get it within its timeout is unavailable, never "busy".
                other = waiter.lock("other", ttl="30s", wait=0)
                try:
                    other.acquire()
                    raise AssertionError("took a lease without the write lock")
                except latchkey.StoreUnavailable:
                    pass
            finally:
                writer.execute("ROLLBACK")
        assert waiter.lock("job", ttl="30s", wait=0).acquire() is True  # free: read, then taken
    finally:
        writer.close()
        holder.close()
        waiter.close()
