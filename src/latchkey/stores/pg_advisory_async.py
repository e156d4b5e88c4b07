"""The ``postgresql+advisory://`` store for asyncio, on psycopg 3's ``AsyncConnection``.

The same keys, statements and session rules as :mod:`latchkey.stores.pg_advisory` (imported
from there): locks are tried and quick statements run on a *main* session; a blocked acquire
waits in the server (``pg_advisory_lock`` under ``lock_timeout``) on a *spare* session that
holds nothing, and the lock then lives on that spare until it is released; at most
``MAX_WAITS`` such waits at once, the other waiters wait in the loop for a turn. The map
``key -> _Hold`` says which owner holds which key on which session (and connection
generation); every statement about a lock runs on the session that holds it.

One event loop drives a backend, so the bookkeeping needs no lock (no await inside a compound
update); each session has an :class:`asyncio.Lock` for its connection. Cancellation:

- of a wait in the server: psycopg cancels the statement, and the spare is closed, so the
  server drops the wait and any lock granted at that instant: nothing is held;
- of a statement on a session that holds other locks (the main one): the session is kept only
  if psycopg left it idle, and the keys the statement may have locked are unlocked there;
  otherwise it is closed (its locks are then lost, and reported so).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, NoReturn

import psycopg

from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL
from latchkey.errors import Unsupported
from latchkey.stores.base import AsyncBackend
from latchkey.stores.pg_advisory import (
    CLAIM,
    HOLDER,
    HOLDS,
    IDLE_SPARES,
    INSPECT,
    NOW,
    TERMINATE,
    TRY_LOCK_PQ,
    UNLOCK,
    UNLOCK_MANY,
    UNLOCK_PQ,
    WAIT_LOCK,
    WAIT_SHARE,
    AdvisoryBackend,
    _halves,
    _owner_from_session,
    advisory_key,
    held_here,
    key_values,
    local_holder,
    said_yes,
)
from latchkey.stores.postgresql import DRIVER_ERRORS, connection_params, utc
from latchkey.stores.postgresql_async import NET_ERRORS, AsyncSession, guarded

_GRANTED = Grant(token=None, expires_at=None)  # every grant: no token, no expiry
#: At most this many waits in the server at once per backend (each on its own spare session,
#: one connection each): one loop may run a thousand waiting coroutines, the server accepts
#: a few hundred connections. The others wait in the loop for a turn (first come, first
#: served); a turn that does not come within one wait's cap is one more try instead.
MAX_WAITS = 32
_IDLE = psycopg.pq.TransactionStatus.IDLE


class _Hold(NamedTuple):
    """A lock this backend holds, and where: valid while ``session`` is still connection
    number ``generation`` (server process ``pid``)."""

    owner: str
    owner_info: str
    session: AsyncSession
    generation: int
    pid: int


class AsyncAdvisoryBackend(AsyncBackend):
    """Session-level advisory locks for asyncio; see the module docstring."""

    scheme = AdvisoryBackend.scheme
    capabilities = AdvisoryBackend.capabilities
    options: ClassVar[Mapping[str, Option]] = AdvisoryBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix: str = self.config["prefix"]
        app = f"latchkey {os.getpid()}@{socket.gethostname()}".encode()[:63]
        self._params = connection_params(url, self.config, app.decode("utf-8", "ignore"))
        self._session = AsyncSession(self._params, self.timeout)
        self._wait_cap_ms = max(1, int(self.timeout * 1000 * WAIT_SHARE))
        self._held: dict[int, _Hold] = {}
        self._spares: dict[AsyncSession, int | None] = {}  # every spare -> the key it holds
        self._idle: list[AsyncSession] = []  # spares holding nothing, not waiting
        self._waiting: set[AsyncSession] = set()  # spares in acquire_blocking
        self._turns = asyncio.Semaphore(MAX_WAITS)  # waits in the server (see MAX_WAITS)
        self._swept = 0  # the main session's generation whose stale holds were dropped

    def key(self, name: str) -> int:
        return advisory_key(name, self.prefix)

    # -- bookkeeping (as AdvisoryBackend's) ----------------------------------------------------

    def _record(self, key: int, hold: _Hold) -> AsyncSession | None:
        """Note a lock taken; return a spare whose older hold of ``key`` this proves over."""
        old = self._held.get(key)
        self._held[key] = hold
        if hold.session is not self._session:
            self._spares[hold.session] = key
        if (
            old is not None
            and old.session is not hold.session
            and (self._spares.get(old.session) == key)
        ):
            self._spares[old.session] = None
            return old.session
        return None

    def _unrecord(self, key: int, hold: _Hold) -> None:
        if self._held.get(key) is hold:
            del self._held[key]
            if self._spares.get(hold.session) == key:
                self._spares[hold.session] = None

    def _sweep(self, session: AsyncSession) -> None:
        """Forget the locks ``session`` lost with its connection (closed, or replaced)."""
        stale = [
            (k, h) for k, h in self._held.items()
            if h.session is session
            and (session.conn is None or h.generation != session.generation)
        ]  # fmt: skip
        for key, hold in stale:
            self._unrecord(key, hold)

    def _hold(self, key: int, owner: str) -> _Hold | None:
        hold = self._held.get(key)
        return hold if hold is not None and hold.owner == owner else None

    def _check(self, key: int, hold: _Hold) -> bool:
        """Whether ``hold`` is still recorded and its session still the connection it was
        taken on (call under the session's lock)."""
        if self._held.get(key) is not hold:
            return False
        session = hold.session
        if session.conn is not None and session.generation == hold.generation:
            return True
        self._sweep(session)
        return False

    def _busy(self, key: int, found: Sequence[Any] | None) -> Busy:
        """A busy answer naming the holder HOLDER ``found`` (ours if one of our sessions)."""
        if found is None:  # released between our attempt and the look-up
            return Busy(holders=0)
        pid, app, client = found
        hold = self._held.get(key)
        if hold is not None and hold.pid == pid:
            return Busy(holders=1, holder=local_holder(hold.owner_info))
        return Busy(holders=1, holder=Holder(None, _owner_from_session(app, client), None, None))

    # -- sessions ------------------------------------------------------------------------------

    async def _main(self) -> psycopg.AsyncConnection[Any]:
        """The main session's connection (call under its lock); forgets locks of an old one."""
        session = self._session
        conn = await session.connection()
        if session.generation != self._swept:
            self._swept = session.generation
            self._sweep(session)
        return conn

    async def _lost(self, session: AsyncSession) -> None:
        """Close ``session`` (it failed, timed out or was interrupted): its locks end with it."""
        await session.discard()
        self._sweep(session)

    async def _failed(self, session: AsyncSession, exc: BaseException, action: str) -> NoReturn:
        """After a network error on ``session``: drop it if unusable, then StoreUnavailable."""
        if isinstance(exc, asyncio.TimeoutError) or session.broken():
            await self._lost(session)
        self.unavailable(exc, action)

    async def _interrupted(self, session: AsyncSession, keys: Sequence[int]) -> None:
        """A statement on ``session`` was cancelled (call under its lock). Keep the session
        only if psycopg left it idle, and unlock ``keys`` there (locks the statement may have
        taken that nobody recorded, or is giving back); otherwise close it."""
        conn = session.conn
        try:
            if conn is None or session.broken() or conn.pgconn.transaction_status != _IDLE:
                raise ConnectionError("interrupted mid-statement")
            if keys:
                await session.query(conn, UNLOCK_MANY, {"keys": list(keys)})
        except BaseException:
            await self._lost(session)
        for key in keys:
            hold = self._held.get(key)
            if hold is not None and hold.session is session:
                self._unrecord(key, hold)

    def _unrecorded_on(self, session: AsyncSession, keys: Sequence[int]) -> list[int]:
        """Those of ``keys`` with no hold recorded on ``session``."""
        return [k for k in keys if (h := self._held.get(k)) is None or h.session is not session]

    def _spare(self) -> AsyncSession:
        """A spare session holding no lock, for one wait (it connects on first use)."""
        session = self._idle.pop() if self._idle else AsyncSession(self._params, self.timeout)
        self._spares[session] = None
        self._waiting.add(session)
        return session

    async def _settle(self, session: AsyncSession | None) -> None:
        """A spare that holds nothing any more goes back to the pool, or is closed."""
        if session is None or session is self._session:
            return
        if (session not in self._spares or self._spares[session] is not None
                or session in self._waiting or session in self._idle):  # fmt: skip
            return
        if session.alive() and len(self._idle) < IDLE_SPARES:
            self._idle.append(session)
            return
        del self._spares[session]
        await session.close()

    async def _discard(self, session: AsyncSession) -> None:
        """Close a spare for good; a lock it may hold ends with it."""
        key = self._spares.pop(session, None)
        self._waiting.discard(session)
        if key is not None and (hold := self._held.get(key)) and hold.session is session:
            del self._held[key]
        if session in self._idle:
            self._idle.remove(session)
        await session.close()

    async def _reachable(self, action: str) -> None:
        """A session died: StoreUnavailable if the server cannot be reached either (an
        outage); return if it can (the lock is lost: force-released, or a restart)."""
        async with self._session.lock:
            try:
                await self._main()
            except NET_ERRORS as exc:
                await self._failed(self._session, exc, action)

    async def _on_main(
        self, action: str, query: Any, params: Any, undo: Sequence[int] = ()
    ) -> list[tuple[Any, ...]]:
        """Run one statement on the main session; ``undo``: keys it may lock (unlocked again
        if it is cancelled)."""
        session = self._session
        async with session.lock:
            try:
                return await session.query(await self._main(), query, params)
            except NET_ERRORS as exc:
                await self._failed(session, exc, action)
            except BaseException:
                await self._interrupted(session, self._unrecorded_on(session, undo))
                raise

    # -- leases --------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        session = self._session
        async with session.lock:
            try:
                conn = await self._main()
                local = self._held.get(key)
                if local is not None:  # on the main session, re-entry would succeed
                    return held_here(local.owner, local.owner_info, owner)
                result = await session.run_prepared(
                    conn, b"latchkey_try_lock", TRY_LOCK_PQ, key_values(key)
                )
                if said_yes(result):
                    self._record(key, _Hold(owner, owner_info, session, session.generation,
                                            conn.pgconn.backend_pid))  # fmt: skip
                    return _GRANTED
                found = await session.query(conn, HOLDER, _halves(key))
            except NET_ERRORS as exc:
                await self._failed(session, exc, f"acquire {name!r}")
            except BaseException:
                await self._interrupted(session, self._unrecorded_on(session, [key]))
                raise
        return self._busy(key, found[0] if found else None)

    async def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        """Wait in the server (``pg_advisory_lock`` under ``lock_timeout``) on a spare session;
        the lock then lives on that spare. Busy when one wait ends without the lock."""
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        ms = self._wait_cap_ms
        if timeout is not None:
            ms = max(1, min(ms, math.ceil(timeout * 1000)))  # 0 would mean "no limit"
        loop = asyncio.get_running_loop()
        asked = loop.time()
        try:
            await guarded(self._turns.acquire(), ms / 1000)
        except asyncio.TimeoutError:  # MAX_WAITS others wait in the server all along
            return await self.acquire(name, owner, owner_info, ttl, limit)
        try:
            ms = max(1, ms - int((loop.time() - asked) * 1000))  # what the turn left of it
            return await self._wait_in_server(name, owner, owner_info, ms)
        finally:
            self._turns.release()

    async def _wait_in_server(
        self, name: str, owner: str, owner_info: str, ms: int
    ) -> Grant | Busy:
        """One wait of up to ``ms`` in the server, on a spare session (see acquire_blocking)."""
        key = self.key(name)
        session = self._spare()
        stale, found = None, None
        try:
            async with session.lock:
                conn = await session.connection()
                hold = _Hold(owner, owner_info, session, session.generation,
                             conn.pgconn.backend_pid)  # fmt: skip
                try:
                    await session.query(conn, WAIT_LOCK.format(ms=ms, key=key), prepare=False)
                except psycopg.errors.LockNotAvailable:
                    found = await session.query(conn, HOLDER, _halves(key))
                    self._waiting.discard(session)
                else:
                    self._waiting.discard(session)
                    stale = self._record(key, hold)
                    await self._settle(stale)  # a dead spare the server's grant proved stale
                    return _GRANTED
        except NET_ERRORS as exc:
            await self._discard(session)
            self.unavailable(exc, f"wait for {name!r}")
        except BaseException:
            # Cancelled: psycopg cancelled the wait in the server, which may have granted the
            # lock just before. Closing the session ends it either way; the pool never sees it.
            await self._discard(session)
            raise
        await self._settle(session)
        return self._busy(key, found[0] if found else None)

    async def release(self, name: str, owner: str) -> bool:
        key = self.key(name)
        hold = self._hold(key, owner)
        if hold is None:
            return False
        session = hold.session
        try:
            async with session.lock:
                if not self._check(key, hold):
                    return False
                assert session.conn is not None
                try:
                    result = await session.run_prepared(
                        session.conn, b"latchkey_unlock", UNLOCK_PQ, key_values(key)
                    )
                except NET_ERRORS as exc:
                    if isinstance(exc, asyncio.TimeoutError) or session.broken():
                        await self._lost(session)  # the session ended: the lock with it
                        return False
                    self.unavailable(exc, f"release {name!r}")
                except BaseException:
                    await self._interrupted(session, [key])  # unlocked, or its session closed
                    raise
                self._unrecord(key, hold)
                return said_yes(result)
        finally:
            await self._settle(session)

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """No TTL to move: checks that the holding session is alive and still holds the lock."""
        key = self.key(name)
        hold = self._hold(key, owner)
        if hold is None:
            return None
        session = hold.session
        try:
            async with session.lock:
                live = self._check(key, hold)
                if live:
                    assert session.conn is not None
                    try:
                        rows = await session.query(session.conn, HOLDS, _halves(key))
                    except NET_ERRORS as exc:
                        if not (isinstance(exc, asyncio.TimeoutError) or session.broken()):
                            self.unavailable(exc, f"check the lock {name!r}")
                        await self._lost(session)  # the session died under us
                        live = False
                    except BaseException:
                        await self._interrupted(session, [])
                        raise
                    else:
                        if not (rows and rows[0][0]):  # force-released (session terminated)
                            self._unrecord(key, hold)
                            return None
        finally:
            await self._settle(session)
        if not live:
            await self._reachable(f"check the lock {name!r}")
            return None
        return _GRANTED

    async def inspect(self, name: str) -> LockInfo | None:
        key = self.key(name)
        rows = await self._on_main(f"inspect {name!r}", INSPECT, _halves(key))
        if not rows:
            return None
        busy = self._busy(key, rows[0][:3])
        assert busy.holder is not None
        return LockInfo(name=name, holders=(busy.holder,))

    def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        raise Unsupported(
            f"the {self.scheme} store cannot list locks: pg_locks shows hashed keys, not names"
        )

    async def force_release(self, name: str) -> bool:
        """Unlock it if this backend holds it; otherwise terminate the session that does."""
        key = self.key(name)
        hold = self._held.get(key)
        if hold is not None:
            session = hold.session
            try:
                async with session.lock:
                    if self._check(key, hold):
                        assert session.conn is not None
                        try:
                            rows = await session.query(session.conn, UNLOCK, {"key": key})
                        except NET_ERRORS as exc:
                            if not (isinstance(exc, asyncio.TimeoutError) or session.broken()):
                                self.unavailable(exc, f"force-release {name!r}")
                            await self._lost(session)  # gone with its session; who has it now?
                        except BaseException:
                            await self._interrupted(session, [key])
                            raise
                        else:
                            self._unrecord(key, hold)
                            return bool(rows and rows[0][0])
            finally:
                await self._settle(session)
        rows = await self._on_main(f"force-release {name!r}", TERMINATE, _halves(key))
        return any(terminated for (terminated,) in rows)

    async def purge_expired(self) -> int:
        return 0  # nothing expires: locks end with their session

    # -- batch claims --------------------------------------------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        session = self._session
        async with session.lock:
            try:
                conn = await self._main()
                candidates: dict[int, str] = {}
                for name in names:
                    key = self.key(name)
                    if key not in self._held and key not in candidates:
                        candidates[key] = name
                if not candidates:
                    return {}
                keys = list(candidates)
                rows = await session.query(conn, CLAIM, {"keys": keys})
                hold = _Hold(owner, owner_info, session, session.generation,
                             conn.pgconn.backend_pid)  # fmt: skip
            except NET_ERRORS as exc:
                await self._failed(session, exc, f"claim {len(names)} names")
            except BaseException:
                await self._interrupted(session, self._unrecorded_on(session, list(candidates)))
                raise
            taken = set()
            for (position,) in rows:
                key = keys[position - 1]
                self._record(key, hold)
                taken.add(candidates[key])
        return {name: Grant(None, None) for name in names if name in taken}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        """One statement per session involved: the main one, and each spare holding one."""
        by_session: dict[AsyncSession, list[tuple[int, _Hold]]] = {}
        for key in dict.fromkeys(self.key(n) for n in names):
            hold = self._hold(key, owner)
            if hold is not None:
                by_session.setdefault(hold.session, []).append((key, hold))
        released = 0
        for session, holds in by_session.items():
            try:
                async with session.lock:
                    live = [(key, hold) for key, hold in holds if self._check(key, hold)]
                    if not live:
                        continue
                    keys = [key for key, _ in live]
                    assert session.conn is not None
                    try:
                        rows = await session.query(session.conn, UNLOCK_MANY, {"keys": keys})
                    except NET_ERRORS as exc:
                        if isinstance(exc, asyncio.TimeoutError) or session.broken():
                            await self._lost(session)
                            continue
                        self.unavailable(exc, f"release {len(keys)} names")
                    except BaseException:
                        await self._interrupted(session, keys)
                        raise
                    for key, hold in live:
                        self._unrecord(key, hold)
                    released += int(rows[0][0]) if rows else 0
            finally:
                await self._settle(session)
        return released

    # -- health, lifecycle ---------------------------------------------------------------------

    async def now(self) -> datetime:
        rows = await self._on_main("read the clock", NOW, None)
        return utc(rows[0][0])

    async def aclose(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress is cancelled."""
        spares, waiting = list(self._spares), self._waiting
        self._held, self._spares, self._idle, self._waiting = {}, {}, [], set()
        for session in spares:
            conn = session.conn
            if session in waiting and conn is not None:
                with contextlib.suppress(*DRIVER_ERRORS):  # it ends by lock_timeout anyway
                    await conn.cancel_safe(timeout=self.timeout)
            await session.close()
        async with self._session.lock:
            await self._session.close()
