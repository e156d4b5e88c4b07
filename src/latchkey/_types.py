"""Plain values passed between the core and the stores, and shown to users."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from latchkey._owner import Owner


@dataclass(frozen=True)
class Holder:
    """One live lease on a name (a lock has one; a semaphore up to its limit)."""

    token: int | None
    """Fencing token; ``None`` on stores without fencing (see ``Capabilities.fencing``)."""
    owner: Owner
    acquired_at: datetime | None
    """When the lease was taken, by the store's clock (UTC)."""
    expires_at: datetime | None
    """When the lease ends unless extended, by the store's clock (UTC); ``None``: no TTL."""


@dataclass(frozen=True)
class LockInfo:
    """What a store knows about a name: its live holders, oldest first, and how many
    processes wait for it where the store can tell.

    .. versionchanged:: 0.2 ``waiting_processes``.
    """

    name: str
    holders: tuple[Holder, ...]
    waiting_processes: int | None = None
    """How many processes wait to acquire the name right now; None where the store cannot
    tell. Redis (all three kinds): the connections subscribed to the name's wake channel —
    one per :class:`~latchkey.Store` (or ``AsyncStore``) with at least one waiter, however
    many threads or coroutines of it wait (a process with two stores counts twice). A
    ``wait=0`` attempt never waits, so it never counts."""

    @property
    def holder(self) -> Holder:
        return self.holders[0]

    @property
    def token(self) -> int | None:
        return self.holder.token

    @property
    def owner(self) -> Owner:
        return self.holder.owner

    @property
    def acquired_at(self) -> datetime | None:
        return self.holder.acquired_at

    @property
    def expires_at(self) -> datetime | None:
        return self.holder.expires_at


@dataclass(slots=True)
class Grant:
    """A store's answer to a successful acquire or extend. (Not frozen: a frozen dataclass
    costs three times as much to build, and one is built for every acquire; treat it as
    read-only all the same, since stores share constant instances.)"""

    token: int | None
    expires_at: datetime | None
    remaining: float | None = None
    """Seconds the lease had left by the store's clock when the store answered, for a lease
    that may have started before this request (one handed to us while we waited). The core's
    local deadline is then at most send time + ``remaining``. None: the lease started during
    this request, so send time + TTL is safe."""


@dataclass(frozen=True)
class Busy:
    """A store's answer to an acquire that found no free slot.

    ``holders`` is how many live leases the store counted; a value below the requested limit
    means the attempt lost a race for a slot that was free, and the core retries at once.
    ``holder`` is one of them (the soonest to expire) for messages. ``retry_after`` is how many
    seconds until that lease ends by the store's clock, when known: waiters sleep no longer.
    """

    holders: int
    holder: Holder | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class RowSpec:
    """Which rows ``store.rows(...)`` claims: ``table``, ``key`` and ``columns`` (None: all)
    are validated identifiers; ``where`` and ``order_by`` are the application's SQL text."""

    table: str
    key: str
    where: str | None = None
    order_by: str | None = None
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RowState:
    """One due row as :meth:`latchkey.Rows.status` (and ``latchkey rows``) shows it."""

    key: Any
    """The row's key."""
    lease: Holder | None
    """Its live lease (``lease`` batches: name ``<table>:<key>``), or None."""
    locked: bool | None
    """Whether a ``take`` transaction holds it right now; None where the store cannot tell
    (SQLite: a take holds the whole database's write lock)."""

    @property
    def state(self) -> str:
        """``free``, ``leased``, ``locked`` or ``leased+locked``."""
        parts = [p for p, on in (("leased", self.lease), ("locked", self.locked)) if on]
        return "+".join(parts) or "free"
