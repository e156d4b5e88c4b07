"""The asyncio backend of ``mysql+getlock://``: the GET_LOCK session locks of
:mod:`latchkey.stores.mysql_getlock` (same keys, statements, sessions and answers) over
asyncmy, the driver of :mod:`latchkey.stores.mysql_async` (see there for why).

Sessions are the sync backend's: a main session for the quick statements and the locks they
take, and for each blocked acquire an extra session that waits in the server
(``GET_LOCK(key, t)``) and keeps the lock the server grants it. A waiting coroutine holds no
thread: it awaits the reply of its own session. Cancelling it closes that session, so the
server drops the wait (and a lock granted in that instant goes with it).

The statements on shared sessions (the main one, and an extra one that holds a lock) run one
at a time under an asyncio lock, each in a task the caller's cancellation does not interrupt:
a statement cut in half would leave a session that must be closed, and closing it would end
every lock in it, other owners' included. The caller still sees its cancellation at once;
the statement finishes (within the timeout) and its bookkeeping stands, so a lock it took is
recorded and the core's release after a cancellation finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NoReturn, TypeVar

import asyncmy

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL
from latchkey.errors import Unsupported
from latchkey.stores.base import AsyncBackend
from latchkey.stores.mysql import utc
from latchkey.stores.mysql_async import (
    ASYNC_DRIVER_ERRORS,
    IDLE_PING,
    async_connect_args,
    bounded,
)
from latchkey.stores.mysql_getlock import (
    CLAIM,
    CLAIM_CALL,
    HELD,
    INSPECT,
    KILL,
    MAX_IDLE,
    NOW,
    RELEASE_CALL,
    RELEASE_MANY,
    UNKNOWN_THREAD,
    GetLockBackend,
    _other_holder,
    lock_key,
    wait_seconds,
)

T = TypeVar("T")

#: Waits in the server at once per backend (one extra session each).
MAX_SERVER_WAITS = 16

# The sync store's statements answer by their row count (SELECT … INTO a variable, WHERE the
# lock call = 1), which is the cheapest answer for PyMySQL. asyncmy reads a short row cheaply,
# but answers every statement that left a warning — and a SELECT … INTO that matched nothing
# leaves "No data" (1329) — with a SHOW WARNINGS round trip of its own, and logs each warning.
# So here each lock call returns its answer as a row (no warning), and a try returns the
# holder's connection id in the same round trip. In: key[, seconds], key.
TRY_LOCK_ROW = "SELECT GET_LOCK(%s, 0), IS_USED_LOCK(%s)"
# Waits in the server (as WAIT_LOCK). Out: 1 taken, 0 timed out, NULL failed; the holder.
WAIT_LOCK_ROW = "SELECT GET_LOCK(%s, %s), IS_USED_LOCK(%s)"
# Out: 1 released, 0 held by another session, NULL no such lock. In: key.
RELEASE_LOCK_ROW = "SELECT RELEASE_LOCK(%s)"
# Out: 1 if this very session holds the key. In: key.
HOLDS_ROW = "SELECT IS_USED_LOCK(%s) = CONNECTION_ID()"


class _Session:
    """One connection and its one cursor, reused by every call on it."""

    __slots__ = ("conn", "cur", "fractions", "id", "used")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.id: int = conn.thread_id()  # CONNECTION_ID(), from the handshake
        self.fractions = "mariadb" in conn.get_server_info().lower()
        self.used = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class AsyncGetLockBackend(AsyncBackend):
    """Session-tied GET_LOCK locks for asyncio; see :class:`GetLockBackend`."""

    scheme = GetLockBackend.scheme
    capabilities = GetLockBackend.capabilities
    options: ClassVar[Mapping[str, Option]] = GetLockBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        self._connect_args = async_connect_args(self)
        self._mutex = asyncio.Lock()  # one statement at a time on the shared sessions
        self._main: _Session | None = None
        self._idle: list[_Session] = []  # extra sessions holding nothing, for the next wait
        self._waiting: set[_Session] = set()  # extra sessions in a wait
        # At most this many waits in the server at once: each needs a session of its own, and
        # a thousand waiting coroutines must not open a thousand (the server's max_connections).
        # The others poll for a turn, holding nothing.
        self._server_waits = 0
        # key -> (owner token, owner_info, the session holding it): this backend's locks.
        self._held: dict[str, tuple[str, str, _Session]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # statements running under the mutex

    def key(self, name: str) -> str:
        return lock_key(name, self.prefix)

    # -- sessions ------------------------------------------------------------------------------

    async def _connect(self) -> _Session:
        conn = await bounded(asyncmy.connect(**self._connect_args), self.timeout)
        return _Session(conn)

    async def _session(self) -> _Session:
        """The main session, open (under the mutex). One idle for IDLE_PING seconds is pinged
        first: if the server ended it, its locks are gone, and a new one starts with none."""
        main = self._main
        if main is not None:
            if time.monotonic() - main.used < IDLE_PING:
                return main
            try:
                await self._run(main, main.conn.ping(reconnect=False))
                return main
            except ASYNC_DRIVER_ERRORS:
                self._lose(main)
        main = self._main = await self._connect()
        return main

    def _lose(self, session: _Session) -> None:
        """Close a failed session: the server ends its locks, so they are lost to us."""
        self._held = {key: entry for key, entry in self._held.items() if entry[2] is not session}
        if session is self._main:
            self._main = None
        session.close()

    def _failed(self, exc: BaseException, action: str) -> NoReturn:
        """The main session failed: lose it and raise StoreUnavailable."""
        if self._main is not None:
            self._lose(self._main)
        self.unavailable(exc, action)

    async def _reachable(self, action: str) -> None:
        """One of our sessions died: raise StoreUnavailable if the server cannot be reached
        either (an outage); return if it can (the lock is lost: killed session, restart)."""
        try:
            await self._session()
        except ASYNC_DRIVER_ERRORS as exc:
            self._failed(exc, action)

    async def _run(self, session: _Session, aw: Awaitable[T]) -> T:
        """One exchange on ``session`` within the timeout. Cut short by a cancellation, the
        session is out of step with the server: it is lost (driver errors are the caller's
        to handle, as in the sync backend)."""
        try:
            result = await bounded(aw, self.timeout)
        except ASYNC_DRIVER_ERRORS:
            raise
        except BaseException:
            self._lose(session)
            raise
        session.used = time.monotonic()
        return result

    async def _exec(self, session: _Session, sql: str, params: Any = None) -> int:
        """Run one statement; its row count."""
        count: int = await self._run(session, session.cur.execute(sql, params))
        return count

    async def _rows(self, session: _Session, sql: str, params: Any = None) -> list[Any]:
        """Run one single-statement query; its rows."""
        await self._exec(session, sql, params)
        rows: list[Any] = await session.cur.fetchall()  # buffered: no I/O
        return rows

    async def _guarded(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op`` under the mutex, in a task the caller's cancellation does not cut short
        (see the module docstring)."""

        async def locked() -> T:
            async with self._mutex:
                return await op()

        task = asyncio.ensure_future(locked())
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        return await asyncio.shield(task)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # seen: a caller that was cancelled no longer awaits it

    async def _checkout(self, action: str) -> _Session:
        """An extra session holding no lock, for one blocked acquire: an idle one that still
        answers a ping (a killed one is never reused), else a new one."""
        while self._idle:
            session = self._idle.pop()
            try:
                await bounded(session.conn.ping(reconnect=False), self.timeout)
            except BaseException as exc:
                session.close()
                if isinstance(exc, ASYNC_DRIVER_ERRORS):
                    continue
                raise
            self._waiting.add(session)
            return session
        try:
            session = await self._connect()
        except ASYNC_DRIVER_ERRORS as exc:
            self.unavailable(exc, action)
        self._waiting.add(session)
        return session

    def _rest(self, session: _Session) -> None:
        """An extra session that holds nothing any more: kept for the next wait, or closed
        if enough are idle."""
        self._waiting.discard(session)
        if len(self._idle) < MAX_IDLE:
            self._idle.append(session)
        else:
            session.close()

    def _discard(self, session: _Session) -> None:
        """Close an extra session whose wait failed or was cancelled: the server drops the
        wait and frees whatever it had taken."""
        self._waiting.discard(session)
        session.close()

    # -- leases --------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        action = f"acquire {name!r}"

        async def op() -> Grant | Busy:
            try:
                main = await self._session()
                entry = self._held.get(key)
                if entry is not None and entry[0] == owner:  # this owner's own hold, as it is
                    return HELD
                if entry is not None:  # ours already, for another owner (no re-entry)
                    return Busy(1, Holder(None, Owner.from_json(entry[1]), None, None))
                got, holder_id = (await self._rows(main, TRY_LOCK_ROW, (key, key)))[0]
                if got == 1:
                    self._held[key] = (owner, owner_info, main)
                    return HELD
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, action)
            if got is None:
                self._failed(RuntimeError("GET_LOCK returned NULL"), action)
            if holder_id is None:
                return Busy(0)  # released between our attempt and the look-up: retry at once
            return Busy(1, _other_holder(holder_id, None))

        return await self._guarded(op)

    async def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        """``GET_LOCK(key, t)`` on an extra session that holds nothing: the server grants the
        lock to that session when it is free, and the session keeps it until release."""
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        action = f"wait for {name!r}"
        if self._server_waits >= MAX_SERVER_WAITS:
            # Every turn to wait in the server is taken: answer at once, and the core polls
            # (with backoff, holding nothing) until a turn is free or the name is.
            return Busy(1)
        self._server_waits += 1
        try:
            return await self._wait_in_server(key, name, owner, owner_info, action, timeout)
        finally:
            self._server_waits -= 1

    async def _wait_in_server(
        self, key: str, name: str, owner: str, owner_info: str, action: str, timeout: float | None
    ) -> Grant | Busy:
        session = await self._checkout(action)
        seconds = wait_seconds(timeout, session.fractions)
        try:
            # The reply comes when the wait ends: allow it, plus the store's timeout.
            await bounded(
                session.cur.execute(WAIT_LOCK_ROW, (key, seconds, key)), self.timeout + seconds
            )
            got, holder_id = (await session.cur.fetchall())[0]
            if got == 1:
                # Under the mutex, as in the sync backend: a release whose RELEASE_LOCK handed
                # the key to this wait finishes its bookkeeping first.
                async with self._mutex:
                    self._waiting.discard(session)
                    stale = self._held.get(key)
                    if stale is not None and stale[2] is not self._main:
                        # Only its session's end frees a key an extra session held, and it
                        # held no other: lose it, nothing else is lost.
                        self._lose(stale[2])
                    self._held[key] = (owner, owner_info, session)
                return HELD
        except ASYNC_DRIVER_ERRORS as exc:
            self._discard(session)
            self.unavailable(exc, action)
        except BaseException:
            self._discard(session)  # cancelled: the server drops the wait, frees what it got
            raise
        if got is None:  # KILL QUERY, out of memory
            self._discard(session)
            self.unavailable(RuntimeError("GET_LOCK returned NULL"), action)
        self._rest(session)
        entry = self._held.get(key)
        if entry is not None:  # held by another owner of this backend
            return Busy(1, Holder(None, Owner.from_json(entry[1]), None, None))
        if holder_id is None:
            return Busy(0)  # released just as the wait ended
        return Busy(1, _other_holder(holder_id, None))

    async def release(self, name: str, owner: str) -> bool:
        key = self.key(name)

        async def op() -> bool:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return False
            session = entry[2]
            try:
                released = (await self._rows(session, RELEASE_LOCK_ROW, (key,)))[0][0]
            except ASYNC_DRIVER_ERRORS:
                self._lose(session)  # the session is gone, and its locks with it
                return False
            if self._held.get(key) is entry:
                # (While RELEASE_LOCK was answered, the server may have granted the key to a
                # wait of ours on another session, which recorded itself here: keep that.)
                del self._held[key]
            if session is not self._main:
                self._rest(session)
            return bool(released == 1)

        return await self._guarded(op)

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that the session holding the lock still holds it (see
        :meth:`GetLockBackend.extend`)."""
        key = self.key(name)
        action = f"check the lock {name!r}"

        async def op() -> Grant | None:
            entry = self._held.get(key)
            if entry is None or entry[0] != owner:
                return None
            session = entry[2]
            try:
                holds = (await self._rows(session, HOLDS_ROW, (key,)))[0][0]
            except ASYNC_DRIVER_ERRORS:
                self._lose(session)
                await self._reachable(action)
                return None
            if holds != 1:  # the session lives on but no longer holds it
                if self._held.get(key) is entry:
                    del self._held[key]
                if session is not self._main:
                    self._rest(session)
                return None
            return HELD

        return await self._guarded(op)

    async def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)

        async def op() -> LockInfo | None:
            try:
                main = await self._session()
                holder_id, host = (await self._rows(main, INSPECT, (key, key)))[0]
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, f"inspect {name!r}")
            if holder_id is None:
                return None
            entry = self._held.get(key)
            if entry is not None and entry[2].id == int(holder_id):
                holder = Holder(None, Owner.from_json(entry[1]), None, None)
            else:
                holder = _other_holder(holder_id, host)
            return LockInfo(name, (holder,))

        return await self._guarded(op)

    def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        raise Unsupported(
            f"the {self.scheme} store cannot list locks: the server shows keys, not names"
        )

    async def force_release(self, name: str) -> bool:
        """Release it if this backend holds it; otherwise end the connection that does."""
        key = self.key(name)
        action = f"force-release {name!r}"

        async def op() -> bool:
            try:
                main = await self._session()
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, action)
            entry = self._held.get(key)
            if entry is not None:  # ours: released on the session holding it
                session = entry[2]
                try:
                    released = (await self._rows(session, RELEASE_LOCK_ROW, (key,)))[0][0]
                except ASYNC_DRIVER_ERRORS:
                    self._lose(session)  # its locks ended with it
                    await self._reachable(action)
                    return False
                del self._held[key]
                if session is not self._main:
                    self._rest(session)
                return bool(released == 1)
            try:
                holder_id, _ = (await self._rows(main, INSPECT, (key, key)))[0]
                if holder_id is None or int(holder_id) == main.id:
                    return False
                await self._exec(main, KILL, (int(holder_id),))
            except asyncmy.errors.OperationalError as exc:
                if exc.args and exc.args[0] == UNKNOWN_THREAD:
                    return False  # it ended on its own in between
                self._failed(exc, action)
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, action)
            return True

        return await self._guarded(op)

    async def purge_expired(self) -> int:
        return 0  # nothing expires: locks end with their session

    # -- batch claims --------------------------------------------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        action = f"claim {len(names)} names"

        async def op() -> set[str]:
            try:
                main = await self._session()
                candidates: dict[str, str] = {}
                for name in names:
                    key = self.key(name)
                    if key not in self._held and key not in candidates:
                        candidates[key] = name
                if not candidates:
                    return set()
                keys = list(candidates)
                calls = ", ".join([CLAIM_CALL] * len(keys))
                row = (await self._rows(main, CLAIM.format(calls=calls), keys))[0]
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, action)
            if any(got is None for got in row):  # an error inside the batch: give all back
                self._failed(RuntimeError("GET_LOCK returned NULL"), action)
            taken = {candidates[key] for key, got in zip(keys, row, strict=True) if int(got) == 1}
            for name in taken:
                self._held[self.key(name)] = (owner, owner_info, main)
            return taken

        taken = await self._guarded(op)
        return {name: HELD for name in names if name in taken}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        """One RELEASE_LOCK batch per session holding some of ``names``."""

        async def op() -> int:
            by_session: dict[_Session, list[str]] = {}
            for key in dict.fromkeys(self.key(n) for n in names):
                entry = self._held.get(key)
                if entry is not None and entry[0] == owner:
                    by_session.setdefault(entry[2], []).append(key)
            released = 0
            for session, keys in by_session.items():
                calls = ", ".join([RELEASE_CALL] * len(keys))
                try:
                    row = (await self._rows(session, RELEASE_MANY.format(calls=calls), keys))[0]
                except ASYNC_DRIVER_ERRORS:
                    self._lose(session)  # its locks ended with it
                    continue
                for key in keys:
                    del self._held[key]
                if session is not self._main:
                    self._rest(session)
                released += sum(1 for answer in row if answer == 1)
            return released

        return await self._guarded(op)

    # -- health, lifecycle ---------------------------------------------------------------------

    async def now(self) -> datetime:
        async def op() -> datetime:
            try:
                return utc((await self._rows(await self._session(), NOW))[0][0])
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, "read the clock")

        return await self._guarded(op)

    async def init(self) -> None:
        async def op() -> None:
            try:
                await self._session()
            except ASYNC_DRIVER_ERRORS as exc:
                self._failed(exc, "connect")

        await self._guarded(op)

    async def aclose(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress fails with
        StoreUnavailable, a statement in progress is cancelled."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sessions = {entry[2] for entry in self._held.values()} | set(self._idle) | self._waiting
        if self._main is not None:
            sessions.add(self._main)
        self._main, self._idle, self._waiting, self._held = None, [], set(), {}
        for session in sessions:
            session.close()
