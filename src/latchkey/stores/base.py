"""The store protocol: the few atomic operations the core needs from every store.

A store module subclasses :class:`Backend`, implements each primitive as one atomic operation
in its own idiom (one SQL statement or short transaction, one Lua script, one ``add``/``cas``,
one ``find_one_and_update``), and registers its URL scheme in ``latchkey/stores/__init__.py``.

A backend never loops, sleeps, retries or invents tokens: waiting, backoff, renewal, local
deadlines, owner tokens and error messages live in the core. It does map every driver error to
:class:`~latchkey.errors.StoreUnavailable` (see :meth:`Backend.unavailable`).

Conventions shared by every primitive:

- ``name`` is already validated (non-empty UTF-8, ≤ 255 bytes) and may contain any character,
  NUL included: escaping or hashing is the backend's job. Names are always passed as
  parameters, never spliced into statements.
- ``owner`` is the acquisition's secret owner token (32 hex chars). ``owner_info`` is a JSON
  text describing the holder (see :class:`latchkey._owner.Owner`), stored as given.
- ``ttl`` is the lease length in seconds (float, > 0). Expiry is computed by the store's clock.
- A lease with ``expires_at <= now`` (store clock) is free, whether or not its row still exists.
- Fencing tokens are positive ints, strictly increasing per name across release, expiry, purge
  and (on durable stores) restart. Semaphore slots of one name share the name's sequence.
- Times returned are timezone-aware UTC datetimes from the store's clock.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, NoReturn

from latchkey._types import Busy, Grant, Holder, LockInfo, RowSpec, RowState
from latchkey._url import DriverOptions, Option, StoreURL, read_options
from latchkey.errors import StoreUnavailable, Unsupported

#: ``rows_lease``'s answer: each row leased (a dict) and its lease.
LeasedRows = list[tuple[dict[str, Any], Grant]]
#: The rows an application statement produced.
RowTuples = list[tuple[Any, ...]]
#: ``rows_status``'s answer.
RowStates = list[RowState]
#: ``rows_held``'s answer: lease names.
Names = list[str]


@dataclass(frozen=True)
class Capabilities:
    """What a store guarantees. The conformance suite reads this; docs print it."""

    ttl: bool = True
    """Leases expire by the store's clock. False for session-tied locks (released on disconnect)."""
    fencing: bool = True
    """Acquisitions carry strictly increasing fencing tokens."""
    durable: bool = True
    """Leases and fencing counters survive a store restart."""
    listing: bool = True
    """``list()`` and ``purge_expired()`` see every lease."""
    push: bool = False
    """Blocked waiters are woken by the store on release (otherwise they poll with backoff)."""
    blocking: bool = False
    """A blocked acquire waits inside the server (``pg_advisory_lock``, ``GET_LOCK(key, t)``)
    and is granted there the moment the holder releases: see :meth:`Backend.acquire_blocking`."""
    multiprocess: bool = True
    """Processes (not just threads) can contend through this store."""
    semaphores: bool = True
    claims: bool = True
    records: bool = True
    force_release: bool = True
    """``force_release`` can drop a lease held by another connection or process."""
    session_tied: bool = False
    """Locks live as long as one connection (PostgreSQL advisory locks, MySQL GET_LOCK)."""
    survives_eviction: bool = True
    """False where the store may drop live leases to free memory (memcached, Redis LRU)."""
    rows: bool = False
    """``store.rows(...)``: claims rows of the application's own table in the same database
    (``take`` and ``lease``; the SQL lease-table stores)."""


#: The database servers' own session locks (PostgreSQL advisory locks, MySQL GET_LOCK): held
#: while one connection lives, no TTL or fencing, kept nowhere durable or listable; the server
#: holds a blocked waiter and grants it the lock on release; batch claims and force-release.
SESSION_LOCKS = Capabilities(
    ttl=False,
    fencing=False,
    durable=False,
    listing=False,
    push=True,
    blocking=True,
    semaphores=False,
    records=False,
    session_tied=True,
)


class Waiter:
    """Wakes a blocked acquire when ``name`` may have been released: made by a push store's
    :meth:`Backend.wait_in_line` *before* the core's second attempt, so a release between a
    failed attempt and :meth:`wait` is never missed. Stores without push return None there
    and the core polls with backoff (the core sleeps; a store never does)."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True if woken by a release notice."""
        raise NotImplementedError

    @property
    def ahead(self) -> int:
        """How many waiters for the same name in this process a release notice wakes before
        this one (0: none, or the store does not know). Local state, no I/O: the core polls
        the store less often the further back a waiter is (see ``_core/waiting.py``)."""
        return 0

    def take_grant(self) -> Grant | None:
        """The lease the store handed straight to this waiter's owner on release, if it did
        (stores that queue waiters, see :meth:`Backend.wait_in_line`). The core asks after
        each wake-up; a grant taken here is the caller's, and :meth:`close` leaves it alone.
        A grant not taken by the time of :meth:`close` is released there."""
        return None

    def finish(self, result: Grant | Busy) -> None:
        """Told the wait's outcome just before :meth:`close` (not called when the wait ends by
        an exception): a waiter that queued its owner must not give back a lease the core
        returns as acquired."""

    def close(self) -> None:
        """Stop listening; called once, also when the wait ends by an exception."""

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BackendBase:
    """What a store's sync and asyncio backends share: the URL, its validated options, the
    capabilities, and the mapping of driver errors to StoreUnavailable."""

    scheme: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    options: ClassVar[Mapping[str, Option]] = {}
    #: Options of the driver's own connection strings, passed through (None: none).
    driver_options: ClassVar[DriverOptions | None] = None
    #: Whether an acquire of a name that a live lease of this process holds through the same
    #: store object may be answered busy without asking the store (``latchkey._core.holds``).
    #: False where an attempt does more than ask (ZooKeeper: a waiter's attempt refreshes its
    #: node in line).
    local_busy: ClassVar[bool] = True
    #: Without push, polls cheap enough to bound by the wait (memcached): a waiter polls at
    #: least every ``poll_share`` times the time it has waited (``_core/waiting.py``). None:
    #: the plain backoff.
    poll_share: ClassVar[float | None] = None

    def rows_wake_sql(self, wake: str) -> str | None:
        """The statement, all literals, that wakes the row waiters subscribed to ``wake`` in
        every process when the transaction running it commits; None (the default): the store
        has none (no I/O; ``Rows.wake_sql``)."""
        return None

    def contended(self, name: str) -> bool:
        """Whether an attempt at ``name`` through this backend found it busy a moment ago
        (no I/O; a hint, never a rule). A store with ``capabilities.blocking`` answers it: a
        waiting acquire of a contended name then skips its attempt and waits in the server at
        once (one round trip where the attempt, its holder look-up and the wait were three).
        False (the default): attempt first."""
        return False

    def __init__(self, url: StoreURL, client: Any = None) -> None:
        self.url = url
        #: The application's own client the store borrows from (``connect(client=…)``), or
        #: None: the store opens and owns its connections. Never closed by latchkey.
        self.client = client
        # A borrowed client carries its own connection settings: no driver options then.
        driver = self.driver_options if client is None else None
        self.config: dict[str, Any] = read_options(url, self.options, driver)
        self.timeout: float = self.config["timeout"]

    def unavailable(self, exc: BaseException, action: str) -> NoReturn:
        """Raise StoreUnavailable for a driver error, naming the store without its password."""
        detail = self.url.scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        kind = type(exc).__name__
        message = f"{self.scheme} store at {self.url.redacted()}: {action} failed: {kind}"
        raise StoreUnavailable(f"{message}: {detail}" if detail else message) from exc

    @contextlib.contextmanager
    def translate(self, action: str, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
        """Map ``errors`` raised inside the block to StoreUnavailable."""
        try:
            yield
        except errors as exc:
            self.unavailable(exc, action)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url.redacted()}>"


class Backend(BackendBase, abc.ABC):
    """One store, sync. Subclasses set ``scheme``, ``capabilities``, ``options`` and the
    primitives. Its asyncio twin is :class:`AsyncBackend`: same names, same answers."""

    # -- leases ------------------------------------------------------------------------------

    @abc.abstractmethod
    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        """Take a free slot of ``name`` (at most ``limit`` live leases) or report it busy.

        One round trip where the store allows it. Expired leases of ``name`` count as free.
        An ``owner`` that already holds a live lease on ``name`` gets that lease back as it
        is — its token, its expiry, ``Grant.remaining`` set, not renewed — never a second
        slot (the core retries with the same owner after a hand-over; every store answers
        alike, ``tests/contract/test_protocol.py``).
        """

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        """Wait inside the store up to ``timeout`` seconds (None: no limit) for ``name`` and
        take it: the server grants it the moment the holder releases. Only called (by the core,
        after a first :meth:`acquire` found the name busy) when ``capabilities.blocking``.

        May return Busy before ``timeout`` passes (e.g. it caps one wait below its driver's
        read timeout): the core calls it again with what is left. Never returns Busy at once
        while the name is held, except rarely: the core sleeps a backoff delay after an
        answer that did not wait.
        """
        raise Unsupported(f"the {self.scheme} store cannot wait in the server")

    @abc.abstractmethod
    def release(self, name: str, owner: str) -> bool:
        """End ``owner``'s lease on ``name``. True if it was live; False if it had expired or
        was never ours. Never touches another owner's lease."""

    @abc.abstractmethod
    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        """Set ``owner``'s live lease to end ``ttl`` from now (store clock); None if it is not
        live (expired, released, taken over). The token is unchanged."""

    @abc.abstractmethod
    def inspect(self, name: str) -> LockInfo | None:
        """The live holders of ``name`` (oldest first), or None if it is free."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        """Every name starting with ``prefix`` that has live holders, in name order."""

    @abc.abstractmethod
    def force_release(self, name: str) -> bool:
        """Drop every lease on ``name`` whoever holds it; True if a live one was dropped."""

    @abc.abstractmethod
    def purge_expired(self, limit: int | None = None) -> int:
        """Delete expired lease rows (fencing counters stay); return how many. With ``limit``,
        delete at most about that many, found through an expiry index, in one short step: the
        core calls again while a call returns ``limit`` or more, resting in between."""

    # -- batch claims ------------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        """Take every free name of ``names`` (distinct) for ``owner``, skip the busy ones.

        A constant number of round trips, whatever ``len(names)``. Returns the names taken.
        """
        raise Unsupported(f"the {self.scheme} store does not support batch claims")

    def release_many(self, names: Sequence[str], owner: str) -> int:
        """Release ``owner``'s live leases on ``names`` in a constant number of round trips;
        return how many were live."""
        return sum(self.release(name, owner) for name in names)

    # -- versioned records -------------------------------------------------------------------

    def record_get(self, name: str) -> tuple[str | None, int]:
        """The record's JSON text and version; ``(None, 0)`` when absent."""
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    def record_set(self, name: str, value: str, version: int) -> int | None:
        """Write ``value`` if the record's version is still ``version`` (0: absent); return the
        new version (``version + 1``), or None if the version moved."""
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    def record_delete(self, name: str, version: int) -> bool:
        """Delete the record if its version is still ``version``; False if it moved."""
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    # -- rows of the application's table (capabilities.rows) ---------------------------------

    def rows_take(self, spec: RowSpec, limit: int) -> Any:
        """Open a transaction on a connection held for the caller, lock up to ``limit`` due
        rows of ``spec`` (``FOR UPDATE SKIP LOCKED``) and return the handle: ``.rows`` (dicts),
        ``.execute(sql, params)`` in that transaction, ``.finish(commit)`` which ends it and
        gives the connection back. See :mod:`latchkey.stores.rows_sql`."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> LeasedRows:
        """Lease up to ``limit`` due rows with no live lease (names ``<table>:<key>``)."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_held(self, spec: RowSpec, owner: str) -> Names:
        """The lease names of ``spec``'s rows whose lease rows name ``owner``: what a lease
        batch whose answer was lost may hold, for it to give back."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_complete(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Any:
        """Open a transaction on a connection held for the caller, for the work of leased
        rows, and return the handle: ``.execute(sql, params)`` in that transaction,
        ``.finish(commit)``: with ``commit``, end the leases of ``names`` if every one is still
        ``owner``'s and live with its token in ``tokens``, then COMMIT (True), else ROLLBACK
        everything (False); without, ROLLBACK. The connection then goes back."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_execute(self, sql: str, params: Any) -> RowTuples:
        """The application's statement, in its own short transaction (autocommit)."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_status(self, spec: RowSpec, limit: int) -> RowStates:
        """Up to ``limit`` due rows with their lease and lock state (``RowState``)."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    def rows_notify(self, spec: RowSpec, wake: str) -> None:
        """Wake the takers and lessees of ``spec``'s table waiting for due rows: those
        subscribed to ``wake`` (in this process; in every process where the store can)."""
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    # -- waiting, health, lifecycle ----------------------------------------------------------

    def subscribe(self, name: str) -> Waiter | None:
        """A :class:`Waiter` woken by releases of ``name``; None (the default): the store
        has no push, and the core polls."""
        return None

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Waiter | None:
        """The waiter for one blocked acquire of ``owner``, made before its second attempt.

        The default is :meth:`subscribe`. A store that can hand a released lease straight to
        the next waiter (PostgreSQL) queues ``owner`` here and sets the waiter's grant
        (:meth:`Waiter.take_grant`) when a release hands the lease over; the waiter's
        ``close`` leaves the queue, and releases a lease handed over that nobody took.
        """
        return self.subscribe(name)

    @abc.abstractmethod
    def now(self) -> datetime:
        """The store's clock (UTC), read with one round trip."""

    def init(self) -> None:
        """Create tables, indexes or scripts now (they are also created on first use)."""

    def close(self) -> None:
        """Release connections. Leases held through this backend may end (session stores)."""


def woken(event: threading.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; whether it was set, clearing it then. It
    is cleared only when it woke us: a set just after a timed-out wait stays for the next
    wait (clearing it lost that wake-up, and a PostgreSQL hand-over with it)."""
    woke = event.wait(max(0.0, timeout))
    if woke:
        event.clear()
    return woke


class EventWaiter(Waiter):
    """A waiter woken by a :class:`threading.Event` (for in-process notification)."""

    def __init__(self, event: threading.Event, on_close: Any = None) -> None:
        self.event = event
        self._on_close = on_close

    def wait(self, timeout: float) -> bool:
        return woken(self.event, timeout)

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


def group_by_name(
    rows: Iterable[Sequence[Any]], holder: Callable[[Sequence[Any]], Holder]
) -> Iterator[LockInfo]:
    """SQL rows ordered by name (``row[0]``: the name's UTF-8 bytes) → one LockInfo per name."""
    for key, group in itertools.groupby(rows, key=lambda row: bytes(row[0])):
        yield LockInfo(key.decode(), tuple(holder(row) for row in group))


# -- the asyncio twin ---------------------------------------------------------------------------


class AsyncWaiter:
    """The asyncio twin of :class:`Waiter`: the same four operations, awaited. A waiting
    coroutine holds no thread."""

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True if woken by a release notice."""
        raise NotImplementedError

    @property
    def ahead(self) -> int:
        """See :attr:`Waiter.ahead` (a plain attribute read: no I/O)."""
        return 0

    async def take_grant(self) -> Grant | None:
        """See :meth:`Waiter.take_grant`."""
        return None

    async def finish(self, result: Grant | Busy) -> None:
        """See :meth:`Waiter.finish`."""

    async def close(self) -> None:
        """See :meth:`Waiter.close`."""

    async def __aenter__(self) -> AsyncWaiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncBackend(BackendBase, abc.ABC):
    """One store, asyncio: every primitive of :class:`Backend` with the same name, arguments,
    answers and errors, as a coroutine (``list`` as an async iterator). The core drives both
    the same way (see ``latchkey._core``); only how bytes move differs. A store registers
    its async class beside its sync one (``latchkey/stores/__init__.py``)."""

    @abc.abstractmethod
    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy: ...

    async def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        raise Unsupported(f"the {self.scheme} store cannot wait in the server")

    @abc.abstractmethod
    async def release(self, name: str, owner: str) -> bool: ...

    @abc.abstractmethod
    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None: ...

    @abc.abstractmethod
    async def inspect(self, name: str) -> LockInfo | None: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[LockInfo]: ...

    @abc.abstractmethod
    async def force_release(self, name: str) -> bool: ...

    @abc.abstractmethod
    async def purge_expired(self, limit: int | None = None) -> int: ...

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        raise Unsupported(f"the {self.scheme} store does not support batch claims")

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        live = 0
        for name in names:
            live += await self.release(name, owner)
        return live

    async def record_get(self, name: str) -> tuple[str | None, int]:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    async def record_delete(self, name: str, version: int) -> bool:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    async def rows_take(self, spec: RowSpec, limit: int) -> Any:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> LeasedRows:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_held(self, spec: RowSpec, owner: str) -> Names:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_complete(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Any:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_execute(self, sql: str, params: Any) -> RowTuples:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_status(self, spec: RowSpec, limit: int) -> RowStates:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def rows_notify(self, spec: RowSpec, wake: str) -> None:
        raise Unsupported(f"the {self.scheme} store does not support row claiming")

    async def subscribe(self, name: str) -> AsyncWaiter | None:
        return None

    async def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> AsyncWaiter | None:
        return await self.subscribe(name)

    @abc.abstractmethod
    async def now(self) -> datetime: ...

    async def init(self) -> None:
        """Create tables, indexes or scripts now (they are also created on first use)."""

    async def aclose(self) -> None:
        """Release connections. Leases held through this backend may end (session stores)."""
