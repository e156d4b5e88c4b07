"""AsyncStore: what ``latchkey.connect_async()`` returns. The asyncio shell over the
store-wide rules (:mod:`latchkey._core.store`), the twin of :class:`latchkey.Store`."""

from __future__ import annotations

import functools
import inspect as _inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

from latchkey._async._run import arun
from latchkey._async.claim import AsyncClaim
from latchkey._async.lock import AsyncLock, AsyncSemaphore
from latchkey._async.record import AsyncRecord
from latchkey._async.rows import AsyncRows
from latchkey._core.holds import holds_for
from latchkey._core.store import DEFAULT_TTL, Health, StoreCore
from latchkey._durations import Duration
from latchkey._names import validate_name
from latchkey._types import LockInfo
from latchkey.errors import ConfigError
from latchkey.stores import AsyncBackend, open_async_backend, open_client_backend

F = TypeVar("F", bound=Callable[..., Any])


def connect_async(
    url: str | None = None,
    *,
    client: Any = None,
    url_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> AsyncStore:
    """Open a store for asyncio by URL (default: ``LATCHKEY_URL``, else embedded SQLite in the
    user's state directory), or over an asyncio ``client`` the application already holds (a
    ``redis.asyncio.Redis``, …), borrowed and never closed. Connects on first use; close with
    ``await store.aclose()`` or ``async with store:``. Options (and ``locks="session"`` with
    a pool or engine) as for :func:`latchkey.connect`.

    Raises :class:`~latchkey.errors.ConfigError` for a bad URL or option, for both a URL and
    a client, and for a client latchkey cannot use (a sync client among them).

    .. versionadded:: 0.2
    .. versionchanged:: 0.2 ``client``, ``url_options`` and keyword options.
    """
    from latchkey._store import _options, default_url

    merged = _options(url_options, options)
    if client is not None:
        if url is not None:
            raise ConfigError("latchkey.connect_async(): give a URL or a client, not both")
        return AsyncStore(open_client_backend(client, merged, asyncio=True))
    return AsyncStore(open_async_backend(url if url is not None else default_url(), merged))


class AsyncStore(StoreCore[AsyncLock, AsyncSemaphore, AsyncClaim, AsyncRecord]):
    """Locks, semaphores, claims and records on one store, for asyncio. Create with
    :func:`connect_async`. Every method of :class:`latchkey.Store` has a twin here with the
    same parameters, defaults, errors and semantics; those that reach the store are awaited.

    .. versionadded:: 0.2
    """

    _lock_class = AsyncLock
    _semaphore_class = AsyncSemaphore
    _claim_class = AsyncClaim
    _record_class = AsyncRecord

    backend: AsyncBackend

    def __init__(self, backend: AsyncBackend) -> None:
        self.backend = backend
        #: This process's live leases through this store object (see _core/holds.py).
        self._holds = holds_for(backend)

    # -- leases ------------------------------------------------------------------------------

    async def is_free(self, name: str) -> bool:
        """True if nobody holds a live lease on ``name``."""
        return (await self.inspect(name)) is None

    async def inspect(self, name: str) -> LockInfo | None:
        """The live holders of ``name``, or None."""
        return await self.backend.inspect(validate_name(name))

    def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every held name starting with ``prefix``, in name order:
        ``[info async for info in store.list(prefix="d:")]``."""
        return self.backend.list(self._list_prefix(prefix))

    async def force_release(self, name: str) -> bool:
        """Drop every lease on ``name``, whoever holds it. The operator's lever: latchkey
        never calls it by itself. True if a live lease was dropped."""
        name = validate_name(name)
        if self._holds is not None:  # our own holders' records no longer vouch for it
            self._holds.drop(name)
        return await self.backend.force_release(name)

    async def purge_expired(self) -> int:
        """Delete expired lease rows (fencing counters stay); return how many."""
        return int(await arun(self._purge(), self.backend))

    # -- rows of the application's own table -------------------------------------------------

    def rows(
        self,
        table: str,
        key: str = "id",
        where: str | None = None,
        order_by: str | None = None,
        columns: Sequence[str] | None = None,
    ) -> AsyncRows:
        """See :meth:`latchkey.Store.rows`: ``async with store.rows(…).take(…) as batch``."""
        return AsyncRows(self, table, key, where, order_by, columns)

    # -- records -----------------------------------------------------------------------------

    async def update(self, name: str, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read-modify-write ``name`` with ``fn`` (sync or async) until it applies without a
        conflict."""
        return await self.record(name).update(fn, retries=retries)

    # -- decorators --------------------------------------------------------------------------

    def singleton(
        self,
        name: str,
        *,
        at_most: Duration,
        at_least: Duration = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Run the ``async def`` only if nobody else is running it (ShedLock-style): the call
        returns None when the lock is busy; the lock is held at most ``at_most`` and at least
        ``at_least``."""
        rule = self._singleton_rule(name, at_most, at_least, metadata)

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            async def call(*args: Any, **kwargs: Any) -> Any:
                return await arun(self._singleton(rule, fn, args, kwargs), self.backend)

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
        """Hold the lock ``name.format(**arguments)`` while the ``async def`` runs."""
        template = self._locked_template(name)

        def decorate(fn: F) -> F:
            signature = _inspect.signature(fn)

            @functools.wraps(fn)
            async def call(*args: Any, **kwargs: Any) -> Any:
                lock_name = self._locked_name(template, fn, signature, args, kwargs)
                lock = self.lock(lock_name, ttl=ttl, wait=wait, renew=renew, metadata=metadata)
                return await arun(self._locked(lock, fn, args, kwargs), self.backend)

            return call  # type: ignore[return-value]

        return decorate

    # -- health and lifecycle ----------------------------------------------------------------

    async def now(self) -> datetime:
        """The store's clock (UTC)."""
        return await self.backend.now()

    async def check(self, samples: int = 5) -> Health:
        """Reach the store, read its clock, and acquire/inspect/release a probe lease."""
        return await arun(self._check(samples), self.backend)

    async def init(self) -> None:
        """Create the store's tables/indexes now (they are otherwise created on first use)."""
        await self.backend.init()

    async def aclose(self) -> None:
        """Close connections. Session-tied locks (advisory, GET_LOCK) end with them."""
        self.backend.latchkey_closed = True  # type: ignore[attr-defined]  # see _run.Closed
        await self.backend.aclose()

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<latchkey.AsyncStore {self.url}>"
