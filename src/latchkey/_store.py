"""The public Store: what ``latchkey.connect()`` returns. The sync shell over the store-wide
rules (:mod:`latchkey._core.store`); its asyncio twin is :class:`latchkey.AsyncStore`."""

from __future__ import annotations

import functools
import inspect as _inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from latchkey._claim import Claim
from latchkey._core.holds import holds_for
from latchkey._core.store import DEFAULT_TTL, Health, StoreCore
from latchkey._durations import Duration
from latchkey._lock import Lock, Semaphore
from latchkey._names import validate_name
from latchkey._record import Record
from latchkey._rows import Rows
from latchkey._run import run
from latchkey._types import LockInfo
from latchkey.errors import ConfigError
from latchkey.stores import Backend, open_backend, open_client_backend

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["DEFAULT_TTL", "Health", "Store", "connect", "default_url"]


def default_url() -> str:
    """``LATCHKEY_URL``, else an SQLite file in the user's state directory."""
    if url := os.environ.get("LATCHKEY_URL"):
        return url
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    path = Path(state) / "latchkey" / "locks.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def connect(
    url: str | None = None,
    *,
    client: Any = None,
    url_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Store:
    """Open a store by URL (default: ``LATCHKEY_URL``, else embedded SQLite in the user's
    state directory, ``$XDG_STATE_HOME/latchkey/locks.db``), or over a ``client`` the
    application already holds (a ``redis.Redis``, …: see :doc:`/howto/your-own-client`), which
    latchkey borrows from and never closes (a ``redis.sentinel.Sentinel`` with ``service=``,
    the name of its master). With a PostgreSQL or MySQL pool or engine, ``locks="session"``
    gives the server's session locks (``postgresql+advisory``, ``mysql+getlock``) on the
    pool's connections instead of the lease table (``locks="lease"``, the default).
    Connects lazily.

    Options the URL's query would carry (``timeout``, ``table``, ``prefix``…) may also be
    given as keyword arguments or as a ``url_options`` mapping, validated alike.

    Raises :class:`~latchkey.errors.ConfigError` for a bad URL or option, for both a URL and
    a client, and for a client latchkey cannot use (naming its type and what is accepted).

    .. versionchanged:: 0.2 ``client``, ``url_options`` and keyword options.
    .. versionchanged:: 0.2 ``locks`` with a client.
    """
    merged = _options(url_options, options)
    if client is not None:
        if url is not None:
            raise ConfigError("latchkey.connect(): give a URL or a client, not both")
        return Store(open_client_backend(client, merged))
    return Store(open_backend(url if url is not None else default_url(), merged))


def _options(url_options: Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """``url_options`` and the keyword options together; an option in both: ConfigError."""
    merged = dict(url_options or {})
    for key, value in options.items():
        if key in merged:
            raise ConfigError(f"store option {key!r} is given twice (keyword and url_options)")
        merged[key] = value
    return merged


class Store(StoreCore[Lock, Semaphore, Claim, Record]):
    """Locks, semaphores, claims and records on one store. Create with :func:`connect`.

    .. versionadded:: 0.1
    """

    _lock_class = Lock
    _semaphore_class = Semaphore
    _claim_class = Claim
    _record_class = Record

    backend: Backend

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: This process's live leases through this store object (see _core/holds.py).
        self._holds = holds_for(backend)

    # -- leases ------------------------------------------------------------------------------

    def is_free(self, name: str) -> bool:
        """True if nobody holds a live lease on ``name``."""
        return self.inspect(name) is None

    def inspect(self, name: str) -> LockInfo | None:
        """The live holders of ``name``, or None."""
        return self.backend.inspect(validate_name(name))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        """Every held name starting with ``prefix``, in name order."""
        return self.backend.list(self._list_prefix(prefix))

    def force_release(self, name: str) -> bool:
        """Drop every lease on ``name``, whoever holds it. The operator's lever: latchkey
        never calls it by itself. True if a live lease was dropped."""
        name = validate_name(name)
        if self._holds is not None:  # our own holders' records no longer vouch for it
            self._holds.drop(name)
        return self.backend.force_release(name)

    def purge_expired(self) -> int:
        """Delete expired lease rows (fencing counters stay); return how many."""
        return int(run(self._purge(), self.backend))

    # -- rows of the application's own table -------------------------------------------------

    def rows(
        self,
        table: str,
        key: str = "id",
        where: str | None = None,
        order_by: str | None = None,
        columns: Sequence[str] | None = None,
    ) -> Rows:
        """Claim rows of ``table`` (in this store's database) by batches: ``take`` (one
        transaction, rows locked ``FOR UPDATE SKIP LOCKED``) or ``lease`` (a lease per row, no
        transaction held). ``key`` is the table's key column; ``columns`` the columns to
        return (None: all). ``where`` and ``order_by`` are SQL text that must never come from
        end users. SQL stores only: elsewhere :class:`~latchkey.errors.Unsupported`."""
        return Rows(self, table, key, where, order_by, columns)

    # -- records -----------------------------------------------------------------------------

    def update(self, name: str, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read-modify-write ``name`` with ``fn`` until it applies without a conflict."""
        return self.record(name).update(fn, retries=retries)

    # -- decorators --------------------------------------------------------------------------

    def singleton(
        self,
        name: str,
        *,
        at_most: Duration,
        at_least: Duration = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Run the function only if nobody else is running it (ShedLock-style).

        If the lock is busy the call returns None and logs at INFO who holds it. The lock is
        held at most ``at_most`` (its TTL) and at least ``at_least``, even when the function
        finished sooner, so that nodes whose schedules fire a little apart skip this tick.
        """
        rule = self._singleton_rule(name, at_most, at_least, metadata)

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                return run(self._singleton(rule, fn, args, kwargs), self.backend)

            return call  # type: ignore[return-value]

        return decorate

    def locked(
        self,
        name: str,
        *,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration | None = None,
        renew: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Hold the lock ``name.format(**arguments)`` while the function runs (blocking)."""
        template = self._locked_template(name)

        def decorate(fn: F) -> F:
            signature = _inspect.signature(fn)

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                lock_name = self._locked_name(template, fn, signature, args, kwargs)
                lock = self.lock(lock_name, ttl=ttl, wait=wait, renew=renew, metadata=metadata)
                return run(self._locked(lock, fn, args, kwargs), self.backend)

            return call  # type: ignore[return-value]

        return decorate

    # -- health and lifecycle ----------------------------------------------------------------

    def now(self) -> datetime:
        """The store's clock (UTC)."""
        return self.backend.now()

    def check(self, samples: int = 5) -> Health:
        """Reach the store, read its clock, and acquire/inspect/release a probe lease."""
        return run(self._check(samples), self.backend)

    def init(self) -> None:
        """Create the store's tables/indexes now (they are otherwise created on first use)."""
        self.backend.init()

    def close(self) -> None:
        """Close connections. Session-tied locks (advisory, GET_LOCK) end with them."""
        self.backend.latchkey_closed = True  # type: ignore[attr-defined]  # see _run.Closed
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<latchkey.Store {self.url}>"
