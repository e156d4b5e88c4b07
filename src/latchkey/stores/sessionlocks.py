"""Session locks, written once: the rules of ``postgresql+advisory://`` and ``mysql+getlock://``.

Both stores lock with the server's own session locks (``pg_advisory_lock``, ``GET_LOCK``): a
lock lives exactly as long as the session (connection) that took it — no TTL, no fencing
tokens — and when that session ends (crash, network loss, restart, a kill) every lock in it
is reported lost (``extend`` answers None, ``release`` False), never silently re-taken.

Sessions (kept by the driver, :mod:`latchkey.stores.io.sessions`): a *main* session takes free
locks without waiting and runs every quick statement; a blocked acquire takes a *spare*
session that holds nothing and waits inside the server (``Wait`` statements), and the lock
the server grants there then lives on that spare until it is released, when the spare goes
back to the pool. A session that holds a lock never waits, so an unlock never queues behind a
wait and the server never sees a deadlock; a spare that dies takes only its own lock along.

Both servers' locks are re-entrant per session, and every thread (or task) of a backend shares
the main session, so this module keeps the map ``key -> Hold(owner, owner_info, session)``:
one owner can neither take nor release another owner's lock, and every statement about a lock
runs on the session that holds it. The driver runs one primitive at a time per backend (a
primitive suspended in a wait in the server excepted), so the map needs no lock of its own;
it tells the store when a session ended (:meth:`SessionLocks.session_ended`) and after a fork.

:class:`SessionLocks` holds each primitive's control flow; a store subclasses it with its
statements (:class:`Statement` constants) and the few parsing hooks that differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey.errors import Unsupported
from latchkey.stores.base import SESSION_LOCKS
from latchkey.stores.io import Steps
from latchkey.stores.primitives import BusyMemory, Store

#: How a statement's answer reads (the driver turns the server's reply into it):
#: YES: 1 (it took, held or released the lock), 0 (it did not) or None (the lock call itself
#: failed: GET_LOCK's NULL); ROWS: the rows; WAIT: as YES, for a wait in the server on a spare;
#: DONE: True when it ran, False when the server refused it with the error code ``extra``.
YES, ROWS, WAIT, DONE = range(4)


class Statement(NamedTuple):
    """One statement: its text, how its answer reads, how a key (or keys) becomes its
    parameters, and a driver's extra (a prepared statement's name, a row form, an error
    code)."""

    text: str
    answer: int
    args: Callable[[Any], Any]
    extra: Any = None


# -- requests (what a primitive yields) and their answers --------------------------------------


class Run(NamedTuple):
    """Run ``statement`` with ``params`` on ``session`` (None: the main session, opened if
    needed). Answer: (the statement's answer, the session it ran on). On a session that has
    ended the driver raises :class:`SessionEnded`."""

    statement: Statement
    params: Any
    session: Any = None


class Spare(NamedTuple):
    """A spare session holding nothing, for one wait of up to ``seconds``; None when every
    turn to wait in the server is taken (the asyncio driver caps them) for that long."""

    seconds: float


class Free(NamedTuple):
    """``session`` holds nothing any more: a spare goes back to the pool (or is closed)."""

    session: Any


class End(NamedTuple):
    """Close ``session``: every lock in it ends."""

    session: Any


class Alive(NamedTuple):
    """Whether ``session`` is open (no round trip; one the server hung up on is closed)."""

    session: Any


class Reach(NamedTuple):
    """Make sure the server answers (the main session open): a driver error if not."""


class SessionEnded(Exception):
    """The session a lock was held on ended: the driver closed it, and its locks with it."""


class Refused(Exception):
    """The server's lock call failed (GET_LOCK returned NULL): the store is unavailable."""


class Hold(NamedTuple):
    """A lock this backend holds, for ``owner``, on ``session`` (a driver's session:
    ``id`` is its server-side id, ``spare`` whether it is not the main one)."""

    owner: str
    owner_info: str
    session: Any


GRANTED = Grant(token=None, expires_at=None)  # every grant: no token, no expiry


def local_holder(owner_info: str) -> Holder:
    """The holder of a lock this backend holds, from its owner's JSON."""
    return Holder(token=None, owner=Owner.from_json(owner_info), acquired_at=None,
                  expires_at=None)  # fmt: skip


class SessionLocks(Store):
    """The session-lock primitives. A store sets its statements (each a :class:`Statement`
    whose ``args`` takes the key):

    - ``TRY_LOCK`` (YES, main): takes a free key without waiting;
    - ``HOLDER`` (ROWS, the session that just tried): who holds the key, parsed by :meth:`busy`;
    - ``UNLOCK`` (YES), ``HOLDS`` (YES: this very session still holds the key), on the
      session holding it;
    - ``INSPECT`` (ROWS, main): the key's holder, parsed by :meth:`holder`;
    - ``NOW`` (ROWS, main, no parameters): one row with the server's clock;

    and the hooks: :meth:`key`, :meth:`wait_length` and :meth:`wait` (a wait in the server),
    :meth:`busy`, :meth:`holder`, :meth:`end_holder` (force-release another session's lock),
    :meth:`claim_run`/:meth:`claimed`, :meth:`release_many_run`/:meth:`released`, :meth:`utc`.
    """

    capabilities = SESSION_LOCKS
    TRY_LOCK: ClassVar[Statement]
    HOLDER: ClassVar[Statement]
    UNLOCK: ClassVar[Statement]
    HOLDS: ClassVar[Statement]
    INSPECT: ClassVar[Statement]
    NOW: ClassVar[Statement]
    #: Why ``list`` is not offered.
    NO_LIST: ClassVar[str] = "the server shows keys, not names"
    #: At most this many waits in the server at once per asyncio backend (one spare session
    #: each: one loop may run a thousand waiting coroutines, the server accepts a few hundred
    #: connections); the other waiters wait in the loop for a turn.
    MAX_WAITS: ClassVar[int] = 16

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.prefix: str = self.config["prefix"]
        self.held: dict[Hashable, Hold] = {}
        #: The keys a try found busy lately: ``contended``.
        self.busy_keys = BusyMemory()

    # -- the store's hooks -----------------------------------------------------------------------

    def key(self, name: str) -> Hashable:
        raise NotImplementedError

    def wait_length(self, timeout: float | None) -> float:
        """How long one wait in the server may last, given the seconds left (None: no limit)."""
        raise NotImplementedError

    def wait(self, key: Any, seconds: float, spare: Any) -> Run:
        """The wait of up to ``seconds`` on ``spare`` (a WAIT statement)."""
        raise NotImplementedError

    def busy(self, key: Any, rows: list[Any]) -> Busy:
        """HOLDER's answer as a Busy (naming our own owner if one of our sessions holds it)."""
        raise NotImplementedError

    def holder(self, key: Any, row: Any) -> Holder:
        """The holder an INSPECT row names."""
        raise NotImplementedError

    def end_holder(self, key: Any) -> Steps[bool]:
        """End the session of another client holding ``key``: whether one was ended."""
        raise NotImplementedError

    def claim_run(self, keys: list[Any]) -> Run:  # the claim of keys none of ours holds
        raise NotImplementedError

    def claimed(self, keys: list[Any], answer: Any, main: Any) -> Steps[list[Any]]:
        raise NotImplementedError  # the keys the claim took

    def release_many_run(self, keys: list[Any], session: Any) -> Run:
        raise NotImplementedError

    def released(self, answer: Any) -> int:  # RELEASE_MANY's answer: how many it released
        raise NotImplementedError

    def utc(self, value: Any) -> datetime:
        raise NotImplementedError

    # -- the map, told by the driver -------------------------------------------------------------

    def session_ended(self, session: Any) -> None:
        """``session`` was closed (it failed, the server ended it, or we did): its locks are
        gone."""
        for key in [k for k, hold in self.held.items() if hold.session is session]:
            del self.held[key]

    def forget_all(self) -> None:
        """Every session closed, or a forked child's: no lock is ours."""
        self.held = {}

    def local(self, key: Any, server_id: Any) -> Holder | None:
        """Our own holder of ``key`` if our session ``server_id`` is the one holding it."""
        hold = self.held.get(key)
        if hold is not None and hold.session.id == server_id:
            return local_holder(hold.owner_info)
        return None

    def _drop(self, key: Any, hold: Hold) -> Steps[None]:
        """Forget ``hold`` if it is still the one recorded; a spare holding nothing goes back."""
        if self.held.get(key) is hold:
            del self.held[key]
        if hold.session.spare:
            yield Free(hold.session)

    # -- leases ----------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        hold = self.held.get(key)
        if hold is not None and (yield Alive(hold.session)):
            # Ours already (asking the server would re-enter the session's own lock): this
            # owner's hold back as it is; any other owner finds it busy.
            return GRANTED if hold.owner == owner else Busy(1, local_holder(hold.owner_info))
        statement = self.TRY_LOCK
        taken, main = yield Run(statement, statement.args(key))
        if taken:
            self.held[key] = Hold(owner, owner_info, main)
            return GRANTED
        if taken is None:
            raise Refused("the lock call returned NULL")
        self.busy_keys.mark(key)
        return self.busy(key, (yield Run(self.HOLDER, self.HOLDER.args(key), main))[0])

    def contended(self, name: str) -> bool:
        """Whether an attempt at ``name`` found it busy within the last second (``BusyMemory``): a
        waiting acquire then waits on a spare at once, in one round trip where the attempt,
        its HOLDER and the wait took three (8 processes looping on one name: most attempts
        find it busy). Re-learnt by an attempt once that time is up."""
        return self.busy_keys.recent(self.key(name))

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Steps[Grant | Busy]:
        """Wait in the server on a spare session that holds nothing; the lock then lives on
        that spare. Busy when the wait ends without it."""
        if limit != 1:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        key = self.key(name)
        seconds = self.wait_length(timeout)
        asked = time.monotonic()
        spare = yield Spare(seconds)
        if spare is None:  # no turn to wait in the server came: one try instead
            return (yield from self.acquire(name, owner, owner_info, ttl, limit))
        left = seconds - (time.monotonic() - asked)  # what the turn left of it
        # A failed or interrupted wait: the driver closes the spare, whatever it took ends.
        got, _ = yield self.wait(key, max(left, 0.0), spare)
        if got:
            old = self.held.get(key)
            self.held[key] = Hold(owner, owner_info, spare)
            if old is not None and old.session is not spare and old.session.spare:
                # The server granted it here, so the spare that held it no longer does (it
                # died, and only its end freed the key): back to the pool, or closed.
                yield Free(old.session)
            return GRANTED
        try:
            if got is None:
                raise Refused("the wait returned NULL")
            return self.busy(key, (yield Run(self.HOLDER, self.HOLDER.args(key), spare))[0])
        except Refused:
            yield End(spare)  # killed mid-wait, or out of memory: not reused
            raise
        finally:
            if not spare.closed:
                yield Free(spare)

    def release(self, name: str, owner: str) -> Steps[bool]:
        key = self.key(name)
        hold = self.held.get(key)
        if hold is None or hold.owner != owner:
            return False
        statement = self.UNLOCK
        try:
            released, session = yield Run(statement, statement.args(key), hold.session)
        except SessionEnded:
            return False  # the session ended, and the lock with it
        # (While UNLOCK was answered, the server may have granted the key to a wait of ours on
        # another session, which then recorded itself: _drop keeps that.)
        if self.held.get(key) is hold:
            del self.held[key]
        if session.spare:
            yield Free(session)
        return bool(released == 1)

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        """No TTL to move: checks that the holding session is alive and still holds the lock.
        If the session ended, StoreUnavailable when the server cannot be reached either (an
        outage: the next extend tells), else None (lost: a kill, a restart)."""
        key = self.key(name)
        hold = self.held.get(key)
        if hold is None or hold.owner != owner:
            return None
        try:
            holds, _ = yield Run(self.HOLDS, self.HOLDS.args(key), hold.session)
        except SessionEnded:
            yield Reach()
            return None
        if holds != 1:  # the session lives on but no longer holds it (force-released)
            yield from self._drop(key, hold)
            return None
        return GRANTED

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        key = self.key(name)
        rows, _ = yield Run(self.INSPECT, self.INSPECT.args(key))
        if not rows or rows[0][0] is None:
            return None
        return LockInfo(name, (self.holder(key, rows[0]),))

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        raise Unsupported(f"the {self.scheme} store cannot list locks: {self.NO_LIST}")

    def force_release(self, name: str) -> Steps[bool]:
        """Unlock it if this backend holds it; otherwise end the session that does (which ends
        every lock of that session: its holders see LockLost)."""
        key = self.key(name)
        hold = self.held.get(key)
        if hold is not None:
            try:
                released, _ = yield Run(self.UNLOCK, self.UNLOCK.args(key), hold.session)
            except SessionEnded:
                yield Reach()  # gone with its session; who has it now?
            else:
                yield from self._drop(key, hold)
                return bool(released == 1)
        return (yield from self.end_holder(key))

    def purge_expired(self, limit: int | None) -> Steps[int]:
        return 0  # nothing expires: locks end with their session
        yield

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        candidates: dict[Any, str] = {}
        for name in names:
            key = self.key(name)
            if key not in self.held and key not in candidates:
                candidates[key] = name
        if not candidates:
            return {}
        keys = list(candidates)
        answer, main = yield self.claim_run(keys)
        taken = yield from self.claimed(keys, answer, main)
        hold = Hold(owner, owner_info, main)
        for key in taken:
            self.held[key] = hold
        names_taken = {candidates[key] for key in taken}
        return {name: GRANTED for name in names if name in names_taken}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        """One statement per session holding some of ``names``."""
        by_session: dict[Any, list[tuple[Any, Hold]]] = {}
        for key in dict.fromkeys(self.key(n) for n in names):
            hold = self.held.get(key)
            if hold is not None and hold.owner == owner:
                by_session.setdefault(hold.session, []).append((key, hold))
        released = 0
        for session, holds in by_session.items():
            try:
                answer, _ = yield self.release_many_run([key for key, _ in holds], session)
            except SessionEnded:
                continue  # its locks ended with it
            for key, hold in holds:
                if self.held.get(key) is hold:
                    del self.held[key]
            if session.spare:
                yield Free(session)
            released += self.released(answer)
        return released

    def now(self) -> Steps[datetime]:
        rows, _ = yield Run(self.NOW, None)
        return self.utc(rows[0][0])

    def init(self) -> Steps[None]:
        yield Reach()
