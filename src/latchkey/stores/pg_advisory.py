"""The ``postgresql+advisory://`` store: PostgreSQL session-level advisory locks.

A lock is a session-level advisory lock on ``key``, the first 8 bytes of BLAKE2b over
``prefix NUL name`` (UTF-8) read as a signed bigint. It lives exactly as long as the session
(connection) that took it: no TTL, no fencing tokens, gone when that connection dies (crash,
network loss, server restart) — and then every lock that session held is reported lost
(``extend`` returns None, ``release`` False), never silently re-taken.

Sessions (the rules are :mod:`latchkey.stores.sessionlocks`', shared with ``mysql+getlock``).
Locks are tried (``pg_try_advisory_lock``) and every quick statement runs on the *main*
session. A blocked acquire waits inside the server instead: on a *spare* session that holds
no lock (from a small pool, opened on demand) it runs ``pg_advisory_lock`` under
``lock_timeout``; the server grants it the moment the holder unlocks, and the lock then lives
on that spare until it is released, when the spare goes back to the pool. One wait lasts at
most ``WAIT_SHARE`` of the ``timeout`` option (the statement timeout), so the server ends it
well before it would be cancelled as a hung statement; a longer wait is several in a row.
Advisory locks are re-entrant per session, so a map ``key -> Hold`` keeps one owner from
taking or releasing another owner's lock.

The connections are psycopg 3's (:mod:`latchkey.stores.io.sessions_psycopg`, sync and asyncio);
the uncontended acquire and release go to libpq directly (``psycopg.pq``, prepared once per
connection): a third of this path's Python time was psycopg's cursor machinery.

Not offered: semaphores (slots would need keys ``inspect`` cannot enumerate), listing and
purging (``pg_locks`` holds keys, not names), versioned records.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import socket
from datetime import datetime, timezone
from typing import Any

from latchkey._owner import Owner
from latchkey._types import Busy, Holder
from latchkey._url import Option, key_prefix
from latchkey.stores.io import Steps
from latchkey.stores.io.psycopg import CONNECTION_OPTIONS, LIBPQ
from latchkey.stores.primitives import AsyncStoreBackend, StoreBackend
from latchkey.stores.sessionlocks import (
    ROWS,
    WAIT,
    YES,
    Run,
    SessionLocks,
    Statement,
)

#: One server-side wait lasts at most this share of the session's statement_timeout.
WAIT_SHARE = 0.9
#: Waits in the server at once per asyncio backend (see SessionLocks.MAX_WAITS).
MAX_WAITS = 32


def halves(key: int) -> dict[str, int]:
    """The (classid, objid) pair pg_locks shows for a bigint key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return {"hi": unsigned >> 32, "lo": unsigned & 0xFFFF_FFFF}


def key_text(key: int) -> tuple[bytes]:
    """A prepared statement's one parameter, the key, encoded (text)."""
    return (b"%d" % key,)


# Rows of pg_locks for one bigint advisory key (classid: high 32 bits, objid: low 32 bits,
# objsubid 1 marks the one-bigint form) in this database, granted, with the holding session.
_HOLDERS = """
    SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start
    FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.classid = %(hi)s::bigint::oid AND l.objid = %(lo)s::bigint::oid
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

# In: key. Tries the lock without waiting (prepared, ``extra``: its name). Answer: taken.
# (Looking the holder up in the same statement cost ~40% of an uncontended acquire even when
# it was skipped, so the busy path asks HOLDER separately.)
TRY_LOCK = Statement("SELECT pg_try_advisory_lock($1::bigint)", YES, key_text, b"latchkey_try_lock")
# In: hi, lo. The session holding the key, for a busy answer: (pid, application_name,
# client address), or no row. Only the constant _HOLDERS is spliced in.
HOLDER = Statement(
    f"SELECT h.pid, h.application_name, h.client_addr FROM ({_HOLDERS} LIMIT 1) AS h",
    ROWS, halves,
)  # fmt: skip
# Inputs spliced in by str.format as ints (``:d`` refuses anything else): ms > 0, key. Waits
# in the server up to ms milliseconds, then holds the key on this session; LockNotAvailable
# (answer 0) when lock_timeout passes first. Without parameters psycopg sends both statements
# in one simple-protocol message: one round trip. Run only on a spare that holds no lock, so
# it never re-enters one, and no unlock waits behind it.
WAIT_LOCK = "SET lock_timeout = {ms:d}; SELECT pg_advisory_lock({key:d})"
# The same on a connection borrowed from the application's pool (``connect(client=…,
# locks="session")``), whose session settings are the application's: the settings are local
# to the message's implicit transaction (gone at its end, the application's untouched), and
# statement_timeout (ms:d, st:d > ms) is latchkey's too, so a shorter one of the application's
# cannot cancel the wait. The lock taken is a session lock all the same: it outlives the
# transaction.
WAIT_LOCK_LOCAL = (
    "SET LOCAL lock_timeout = {ms:d}; SET LOCAL statement_timeout = {st:d}; "
    "SELECT pg_advisory_lock({key:d})"
)
# In: key. Unlocks it (only this session's own lock can be unlocked); the server grants it to
# a session waiting in WAIT_LOCK at once. Writes nothing: no transaction id, no WAL.
# Answer: whether this session held it.
UNLOCK = Statement("SELECT pg_advisory_unlock($1::bigint)", YES, key_text, b"latchkey_unlock")
# In: hi, lo. Whether *this* session still holds the key (it may have been terminated and
# replaced, or the lock force-released).
HOLDS = Statement(f"SELECT EXISTS ({_HOLDERS} AND l.pid = pg_backend_pid())", YES, halves)
# In: hi, lo. Who holds the key: (pid, application_name, client address, start) rows.
INSPECT = Statement(_HOLDERS, ROWS, halves)
# In: hi, lo. Ends the session holding the key (other than ours): the only way to take an
# advisory lock from another session; that session loses every lock it held. Answer: one row
# per session signalled, true if it was terminated.
TERMINATE = Statement(
    f"SELECT pg_terminate_backend(h.pid) FROM ({_HOLDERS} AND l.pid <> pg_backend_pid()) AS h",
    ROWS, halves,
)  # fmt: skip
# In: keys (bigint[], distinct, none held by this session). Tries each without waiting.
# Answer: the 1-based positions of the keys taken.
CLAIM = Statement(
    "SELECT k.i FROM unnest(%(keys)s::bigint[]) WITH ORDINALITY AS k (key, i) "
    "WHERE pg_try_advisory_lock(k.key)",
    ROWS, lambda keys: {"keys": keys},
)  # fmt: skip
# In: keys (bigint[]). Unlocks each. Answer: how many this session held.
UNLOCK_MANY = Statement(
    "SELECT count(*) FROM unnest(%(keys)s::bigint[]) AS k WHERE pg_advisory_unlock(k)",
    ROWS, lambda keys: {"keys": keys},
)  # fmt: skip
NOW = Statement("SELECT now()", ROWS, lambda _: None)


@functools.lru_cache(maxsize=4096)  # names repeat; hashing is a fifth of the Python time
def advisory_key(name: str, prefix: str = "") -> int:
    """The 64-bit advisory-lock key of ``name``: BLAKE2b-64 of ``prefix NUL name``, signed."""
    digest = hashlib.blake2b(prefix.encode() + b"\x00" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def application_name() -> str:
    """What our sessions call themselves, so that other processes' inspect() can say who
    holds a lock: ``latchkey pid@host``."""
    app = f"latchkey {os.getpid()}@{socket.gethostname()}".encode()[:63]
    return app.decode("utf-8", "ignore")


def _owner_from_session(application_name: str | None, client: str | None) -> Owner:
    """Who holds a lock in another session: our sessions name themselves ``latchkey pid@host``."""
    text = application_name or ""
    if text.startswith("latchkey ") and "@" in text:
        pid, _, host = text[len("latchkey ") :].partition("@")
        if pid.isdigit():
            return Owner(host=host, pid=int(pid))
    return Owner(host=client or "", metadata={"application_name": text} if text else {})


class Advisory(SessionLocks):
    """Session-level advisory locks; see the module docstring for what it can't do."""

    scheme = "postgresql+advisory"
    options = {
        "prefix": Option(key_prefix, "", "hashed with each name: separates applications"),
        **CONNECTION_OPTIONS,
    }
    driver_options = LIBPQ
    sync_driver = "latchkey.stores.io.sessions_psycopg:PsycopgSessions"
    async_driver = "latchkey.stores.io.sessions_psycopg:AsyncPsycopgSessions"
    borrowed_sync_driver = "latchkey.stores.io.sessions_psycopg_borrowed:BorrowedPsycopgSessions"
    borrowed_async_driver = (
        "latchkey.stores.io.sessions_psycopg_borrowed:AsyncBorrowedPsycopgSessions"
    )
    TRY_LOCK, HOLDER, UNLOCK, HOLDS, INSPECT, NOW = TRY_LOCK, HOLDER, UNLOCK, HOLDS, INSPECT, NOW
    NO_LIST = "pg_locks shows hashed keys, not names"
    MAX_WAITS = MAX_WAITS

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.wait_cap_ms = max(1, int(self.timeout * 1000 * WAIT_SHARE))
        self.statement_ms = max(self.wait_cap_ms + 1, int(self.timeout * 1000))
        self.borrowed = backend.client is not None

    def key(self, name: str) -> int:
        return advisory_key(name, self.prefix)

    def wait_length(self, timeout: float | None) -> float:
        ms = self.wait_cap_ms
        if timeout is not None:
            ms = max(1, min(ms, math.ceil(timeout * 1000)))  # 0 would mean "no limit"
        return ms / 1000

    def wait(self, key: Any, seconds: float, spare: Any) -> Run:
        ms = max(1, math.ceil(seconds * 1000))
        if self.borrowed:
            sql = WAIT_LOCK_LOCAL.format(ms=ms, st=max(ms + 1, self.statement_ms), key=key)
        else:
            sql = WAIT_LOCK.format(ms=ms, key=key)
        return Run(Statement(sql, WAIT, lambda _: None), None, spare)

    def busy(self, key: Any, rows: list[Any]) -> Busy:
        if not rows:  # released between our attempt and the look-up
            return Busy(holders=0)
        return Busy(holders=1, holder=self.holder(key, rows[0]))

    def holder(self, key: Any, row: Any) -> Holder:
        pid, app, client = row[:3]
        ours = self.local(key, pid)
        return ours or Holder(None, _owner_from_session(app, client), None, None)

    def end_holder(self, key: Any) -> Steps[bool]:
        rows, _ = yield Run(TERMINATE, TERMINATE.args(key))
        return any(terminated for (terminated,) in rows)

    def claim_run(self, keys: list[Any]) -> Run:
        return Run(CLAIM, CLAIM.args(keys))

    def claimed(self, keys: list[Any], answer: Any, main: Any) -> Steps[list[Any]]:
        return [keys[position - 1] for (position,) in answer]
        yield  # a generator

    def release_many_run(self, keys: list[Any], session: Any) -> Run:
        return Run(UNLOCK_MANY, UNLOCK_MANY.args(keys), session)

    def released(self, answer: Any) -> int:
        return int(answer[0][0]) if answer else 0

    def utc(self, value: datetime) -> datetime:
        return value.astimezone(timezone.utc)


class AdvisoryBackend(StoreBackend):
    store_class = Advisory


class AsyncAdvisoryBackend(AsyncStoreBackend):
    store_class = Advisory
