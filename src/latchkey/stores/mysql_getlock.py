"""``mysql+getlock://user:pass@host:3306/database``: MySQL/MariaDB user-level locks (GET_LOCK).

A lock lives exactly as long as the session that took it: no TTL, no fencing tokens, released
by the server when the connection ends (crash, network loss, server restart). When one of our
sessions fails, every lock it held is reported lost (``extend`` returns None so the core raises
LockLost, ``release`` returns False) and never silently re-taken on another connection; the
locks of our other sessions stay.

Sessions (the rules are :mod:`latchkey.stores.sessionlocks`', shared with
``postgresql+advisory``). A lock that is free is taken with ``GET_LOCK(key, 0)`` on the
backend's main session, which also runs the other quick statements (claims, inspect, the
clock). A blocked acquire waits in the server: ``GET_LOCK(key, t)`` on a spare session that
holds no lock, from a small pool. The server grants the lock to that session the moment the
holder releases, and that session keeps it: a hand-off is the server's own wake-up, with no
second statement. The session goes back to the pool when the lock is released. GET_LOCK is
re-entrant per session, so a local map ``key -> Hold`` keeps one owner from taking or
releasing another owner's lock; a second owner in the same process waits in the server, like
any other client.

Lock keys are server-wide (not per database), at most 64 characters on MySQL, compared
case-insensitively, and cut at a NUL byte. So the key is ``prefix + name`` only when the name
is plain (lowercase ASCII letters, digits and ``_ : . - /``) and short enough; any other name
gets a readable stem, ``~`` and 96 bits of SHA-256 of its UTF-8 bytes, e.g.
``latchkey:report_2024_~3f9c…``. ``~`` never appears in a plain key, so a plain key and a
hashed one never meet.

Drivers: PyMySQL (sync) and asyncmy (asyncio), :mod:`latchkey.stores.io.sessions_pymysql` and
:mod:`latchkey.stores.io.sessions_asyncmy`. The YES statements have two forms (``extra``: the
row form). PyMySQL runs the first, which answers in its row count (an OK packet), not in a
result set: PyMySQL parses a result set in Python, which cost more than the server's work on
these calls (~12 µs a call). ``SELECT … INTO`` a session variable returns no rows, and its row
count is 1 if the WHERE held. asyncmy reads a short row cheaply but answers every statement
that left a warning — a ``SELECT … INTO`` that matched nothing leaves "No data" — with a
``SHOW WARNINGS`` round trip and a logged warning, so it runs the row form.

Not offered: semaphores (``inspect`` could not enumerate slot keys without knowing the
limit), listing and purging (the server exposes lock keys, not names), versioned records.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from datetime import datetime, timezone
from typing import Any

from latchkey._owner import Owner
from latchkey._types import Busy, Holder
from latchkey._url import Option, key_prefix
from latchkey.stores.io import Steps
from latchkey.stores.io.mysql_dsn import MYSQL_DRIVER
from latchkey.stores.primitives import AsyncStoreBackend, StoreBackend
from latchkey.stores.sessionlocks import (
    DONE,
    ROWS,
    WAIT,
    YES,
    End,
    Refused,
    Run,
    SessionLocks,
    Statement,
)

#: MySQL's limit on a user-level lock name (MariaDB accepts longer ones).
MAX_KEY = 64
PREFIX_MAX = 24
_PLAIN = re.compile(r"^[a-z0-9_:./-]+$")
_UNREADABLE = re.compile(r"[^a-z0-9_:./-]")
HASH_HEX = 24  # 96 bits of SHA-256
#: The longest one blocked GET_LOCK waits; the core calls again with what is left. For the
#: call, the session's read timeout is this wait plus the store's ``timeout``: a long wait is
#: not taken for a hung server, and a hung server is still noticed.
MAX_WAIT = 30.0
#: Waits in the server at once per asyncio backend (see SessionLocks.MAX_WAITS).
MAX_WAITS = 16
UNKNOWN_THREAD = 1094  # KILL of a connection that no longer exists


def _one(key: str) -> tuple[str]:
    return (key,)


# Tries the lock without waiting, on the main session. In: key. Answer 1: taken; 0: busy, or
# (PyMySQL) GET_LOCK returned NULL (session killed, out of memory): @latchkey_got keeps its
# answer for HOLDER. GET_LOCK is evaluated once (a second evaluation would count a re-entry).
TRY_LOCK = Statement(
    "SELECT 1 INTO @latchkey_row FROM DUAL WHERE (@latchkey_got := GET_LOCK(%s, 0)) = 1",
    YES, _one, "SELECT GET_LOCK(%s, 0)",
)  # fmt: skip
# A blocked acquire, on a spare session that holds no lock. In: key, seconds. Waits in the
# server until the key is free, then takes it for this session (1), or until the seconds pass
# (0). A session holding nothing cannot be part of a deadlock.
WAIT_LOCK = Statement(
    "SELECT 1 INTO @latchkey_row FROM DUAL WHERE (@latchkey_got := GET_LOCK(%s, %s)) = 1",
    WAIT, tuple, "SELECT GET_LOCK(%s, %s)",
)  # fmt: skip
# After a try or wait that took nothing, on the same session: GET_LOCK's answer (0 busy, NULL
# failed; the row form's NULL was answered already) and the holding connection's id (NULL if
# released in between). In: key. A process-list look-up here would cost more than the lock
# itself, so only inspect() names the holder's client host. Short column aliases: a column's
# name is otherwise its expression's text.
HOLDER = Statement("SELECT @latchkey_got AS g, IS_USED_LOCK(%s) AS r", ROWS, _one,
                   "SELECT 0 AS g, IS_USED_LOCK(%s) AS r")  # fmt: skip
# Ends the lock if this session holds it. In: key. Answer 1: released; 0: not ours (held by
# another session, or no such lock).
UNLOCK = Statement("SELECT 1 INTO @latchkey_row FROM DUAL WHERE RELEASE_LOCK(%s) = 1", YES,
                   _one, "SELECT RELEASE_LOCK(%s) = 1")  # fmt: skip
# Whether this very session (not a reconnected one) still holds the key. In: key.
HOLDS = Statement("SELECT 1 INTO @latchkey_row FROM DUAL WHERE IS_USED_LOCK(%s) = CONNECTION_ID()",
                  YES, _one, "SELECT IS_USED_LOCK(%s) = CONNECTION_ID()")  # fmt: skip
# Who holds a key: the connection id (NULL: free; compared with our sessions' ids) and its
# client host. In: key, key.
INSPECT = Statement(
    "SELECT IS_USED_LOCK(%s), "
    "(SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = IS_USED_LOCK(%s))",
    ROWS, lambda key: (key, key),
)  # fmt: skip
# Ends another session (and so every lock it holds): the only way to take its lock. In: id.
# Answer False if that connection no longer exists.
KILL = Statement("KILL CONNECTION %s", DONE, _one, UNKNOWN_THREAD)
# Batch claim: {calls} is one "GET_LOCK(%s, 0)" per key, each evaluated once, in one row.
CLAIM = "SELECT {calls}"
CLAIM_CALL = "GET_LOCK(%s, 0)"
# Batch release: {calls} is one "RELEASE_LOCK(%s)" per key.
RELEASE_MANY = "SELECT {calls}"
RELEASE_CALL = "RELEASE_LOCK(%s)"
NOW = Statement("SELECT UTC_TIMESTAMP(6)", ROWS, lambda _: None)


def getlock_prefix(text: str) -> str:
    """A key prefix short enough to leave room for the name within 64 characters."""
    key_prefix(text)
    if len(text) > PREFIX_MAX:
        raise ValueError(f"at most {PREFIX_MAX} characters (lock keys are ≤ 64 characters)")
    return text


@functools.lru_cache(maxsize=1024)  # a name's key is computed at each acquire and release
def lock_key(name: str, prefix: str = "latchkey:") -> str:
    """The GET_LOCK key of ``name``: ``prefix + name`` if plain and short, else hashed."""
    room = MAX_KEY - len(prefix)
    if _PLAIN.match(name) and len(name) <= room:
        return prefix + name
    digest = hashlib.sha256(name.encode()).hexdigest()[:HASH_HEX]
    stem = _UNREADABLE.sub("_", name.lower())[: room - HASH_HEX - 1]
    return f"{prefix}{stem}~{digest}"


def wait_seconds(timeout: float | None, fractions: bool) -> float:
    """How long one blocked GET_LOCK may wait, given the seconds left (None: no limit).

    At most MAX_WAIT. MariaDB (≥ 10.1.2) honours fractions of a second; MySQL rounds the wait
    to the nearest whole second, so there it is rounded down here: a wait never ends after the
    caller's deadline. With less than a second left, MySQL's GET_LOCK only tries, and the core
    tries again after a short backoff until the deadline.
    """
    seconds = MAX_WAIT if timeout is None else min(max(timeout, 0.0), MAX_WAIT)
    return seconds if fractions else float(math.floor(seconds))


def _other_holder(connection_id: Any, host: Any) -> Holder:
    """Another session's lock: all the server tells is its connection id and client host."""
    client = str(host.decode() if isinstance(host, bytes) else host or "")
    owner = Owner(host=client.rsplit(":", 1)[0], metadata={"connection_id": int(connection_id)})
    return Holder(None, owner, None, None)


class GetLock(SessionLocks):
    """Session-tied GET_LOCK locks; see the module docstring for what it can't do."""

    scheme = "mysql+getlock"
    options = {
        "prefix": Option(
            getlock_prefix, "latchkey:", "prepended to each lock key (keys are server-wide)"
        ),
    }
    driver_options = MYSQL_DRIVER
    sync_driver = "latchkey.stores.io.sessions_pymysql:PyMySQLSessions"
    async_driver = "latchkey.stores.io.sessions_asyncmy:AsyncmySessions"
    borrowed_sync_driver = "latchkey.stores.io.sessions_mysql_borrowed:BorrowedPyMySQLSessions"
    borrowed_async_driver = (
        "latchkey.stores.io.sessions_mysql_borrowed_async:AsyncBorrowedMySQLSessions"
    )
    TRY_LOCK, HOLDER, UNLOCK, HOLDS, INSPECT, NOW = TRY_LOCK, HOLDER, UNLOCK, HOLDS, INSPECT, NOW
    MAX_WAITS = MAX_WAITS

    def key(self, name: str) -> str:
        return lock_key(name, self.prefix)

    def wait_length(self, timeout: float | None) -> float:
        return wait_seconds(timeout, True)

    def wait(self, key: Any, seconds: float, spare: Any) -> Run:
        fractions = "mariadb" in spare.server.lower()
        return Run(WAIT_LOCK, (key, wait_seconds(seconds, fractions)), spare)

    def busy(self, key: Any, rows: list[Any]) -> Busy:
        got, holder_id = rows[0]
        if got is None:  # KILL QUERY, out of memory
            raise Refused("GET_LOCK returned NULL")
        if holder_id is None:
            return Busy(0)  # released between our attempt and the look-up: retry at once
        return Busy(1, self.local(key, int(holder_id)) or _other_holder(holder_id, None))

    def holder(self, key: Any, row: Any) -> Holder:
        holder_id, host = row
        return self.local(key, int(holder_id)) or _other_holder(holder_id, host)

    def end_holder(self, key: Any) -> Steps[bool]:
        rows, main = yield Run(INSPECT, INSPECT.args(key))
        holder_id = rows[0][0]
        if holder_id is None or int(holder_id) == main.id:
            return False
        done, _ = yield Run(KILL, (int(holder_id),))
        return bool(done)

    def claim_run(self, keys: list[Any]) -> Run:
        calls = ", ".join([CLAIM_CALL] * len(keys))
        return Run(Statement(CLAIM.format(calls=calls), ROWS, tuple), keys)

    def claimed(self, keys: list[Any], answer: Any, main: Any) -> Steps[list[Any]]:
        row = answer[0]
        if any(got is None for got in row):  # an error inside the batch: give all back
            yield End(main)
            raise Refused("GET_LOCK returned NULL")
        return [key for key, got in zip(keys, row, strict=True) if int(got) == 1]

    def release_many_run(self, keys: list[Any], session: Any) -> Run:
        calls = ", ".join([RELEASE_CALL] * len(keys))
        return Run(Statement(RELEASE_MANY.format(calls=calls), ROWS, tuple), keys, session)

    def released(self, answer: Any) -> int:
        return sum(1 for got in answer[0] if got == 1)

    def utc(self, value: datetime) -> datetime:
        return value.replace(tzinfo=timezone.utc)


class GetLockBackend(StoreBackend):
    store_class = GetLock


class AsyncGetLockBackend(AsyncStoreBackend):
    store_class = GetLock
