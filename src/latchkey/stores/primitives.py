"""A built-in store, written once: its primitives as generators of driver requests.

A store module subclasses :class:`Store`: its statements or scripts as named constants, its
reply parsing, and each primitive of the store protocol (:class:`latchkey.stores.base.Backend`)
as a *generator* that yields the requests it needs — run this statement, evaluate this
script, open a waiter — receives the answers, and returns the primitive's answer in
latchkey's plain types. A store does no I/O, so one module serves both APIs: its sync driver
answers each request with a blocking call, its asyncio driver with an await (the shared I/O
layer, :mod:`latchkey.stores.io`). Drivers are named as ``"module:Class"`` and imported on
first use, so the sync API never imports an asyncio driver.

:class:`StoreBackend` and :class:`AsyncStoreBackend` turn a Store into the
:class:`~latchkey.stores.base.Backend` and :class:`~latchkey.stores.base.AsyncBackend` the core
drives: the same few lines for every store, written here once. A store module ends with::

    class SQLiteBackend(StoreBackend):
        store_class = SQLite

    class AsyncSQLiteBackend(AsyncStoreBackend):
        store_class = SQLite A primitive that needs no I/O may simply ``return`` (a
generator function that yields nothing is still run by the driver). Errors raised by a
request are thrown into the generator at its ``yield``: a store catches only what it gives
meaning to (a duplicate key, a lost deadlock), the driver maps the rest to StoreUnavailable.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import AsyncIterator, Hashable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from latchkey._types import Busy, Grant, LockInfo, RowSpec
from latchkey._url import DriverOptions, Option, StoreURL
from latchkey.errors import Unsupported
from latchkey.stores.base import (
    AsyncBackend,
    Backend,
    BackendBase,
    Capabilities,
    LeasedRows,
    Names,
    RowStates,
    RowTuples,
)
from latchkey.stores.io import Steps
from latchkey.stores.io.lines import AsyncLines, Lines

if TYPE_CHECKING:
    from latchkey.stores.io import Driver
    from latchkey.stores.io.aio import AsyncDriver
    from latchkey.stores.rows_sql import RowClaims


class BusyMemory:
    """The names an attempt through one store object found busy in the last ``seconds`` (a
    hint, no I/O; at most ``size`` kept, the stale dropped first): a store may answer a waiting
    attempt at such a name more cheaply (``BackendBase.contended``; SQLite's read first)."""

    def __init__(self, seconds: float = 1.0, size: int = 1024) -> None:
        self.seconds, self.size = seconds, size
        self.until: dict[Hashable, float] = {}

    def mark(self, key: Hashable) -> None:
        now = time.monotonic()
        until = self.until
        if len(until) >= self.size:  # (a copy of the items: safe beside another thread)
            for old, ends in list(until.items()):
                if ends <= now:
                    until.pop(old, None)
            if len(until) >= self.size:  # all fresh: forget the oldest
                until.pop(next(iter(list(until))), None)
        until[key] = now + self.seconds

    def recent(self, key: Hashable) -> bool:
        until = self.until.get(key)
        return until is not None and until > time.monotonic()


class Store:
    """A store's primitives, I/O-free. See the module docstring and ``base.Backend`` for what
    each primitive promises; here each one is a generator (``Steps``) with the same
    arguments and answer."""

    scheme: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    options: ClassVar[Mapping[str, Option]] = {}
    #: The driver's own connection-string options, passed through (see ``DriverOptions``).
    driver_options: ClassVar[DriverOptions | None] = None
    #: See ``BackendBase.local_busy`` and ``BackendBase.poll_share``.
    local_busy: ClassVar[bool] = True
    poll_share: ClassVar[float | None] = None
    #: ``"module:Class"`` of the sync driver (a :class:`~latchkey.stores.io.Driver`).
    sync_driver: ClassVar[str] = ""
    #: ``"module:Class"`` of the asyncio driver (an :class:`~latchkey.stores.io.aio.AsyncDriver`).
    async_driver: ClassVar[str] = ""
    #: The drivers over the application's own client (``connect(client=…)``), where they are
    #: other classes ("": the drivers above borrow from it themselves).
    borrowed_sync_driver: ClassVar[str] = ""
    borrowed_async_driver: ClassVar[str] = ""

    def __init__(self, backend: BackendBase) -> None:
        self.url: StoreURL = backend.url
        self.config: dict[str, Any] = backend.config
        self.timeout: float = backend.timeout

    # -- required ----------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        raise NotImplementedError

    def release(self, name: str, owner: str) -> Steps[bool]:
        raise NotImplementedError

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        raise NotImplementedError

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        raise NotImplementedError

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        raise NotImplementedError

    def force_release(self, name: str) -> Steps[bool]:
        raise NotImplementedError

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """Delete at most ``limit`` expired leases (every one if None); how many."""
        raise NotImplementedError

    def now(self) -> Steps[datetime]:
        raise NotImplementedError

    # -- by capability -----------------------------------------------------------------------

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Steps[Grant | Busy]:
        raise Unsupported(f"the {self.scheme} store cannot wait in the server")

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        raise Unsupported(f"the {self.scheme} store does not support batch claims")

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        live = 0
        for name in names:
            live += yield from self.release(name, owner)
        return live

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        raise Unsupported(f"the {self.scheme} store does not support versioned records")

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        """The waiter of one blocked acquire (a driver's Waiter or AsyncWaiter), or None: the
        store has no push and the core polls."""
        return None
        yield  # a generator

    def init(self) -> Steps[None]:
        """Create tables, indexes or scripts now (they are also created on first use)."""
        return None
        yield  # a generator

    def contended(self, name: str) -> bool:
        """See ``BackendBase.contended`` (no I/O)."""
        return False


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class _NoIO:
    """What the sync and asyncio backends of a :class:`Store` answer alike, without I/O."""

    store: Store
    capabilities: Capabilities
    scheme: str

    def contended(self, name: str) -> bool:
        return self.store.contended(name)

    def rows_wake_sql(self, wake: str) -> str | None:
        return self._rows().rows_wake_sql(wake)

    def _rows(self) -> RowClaims:
        if not self.capabilities.rows:
            raise Unsupported(f"the {self.scheme} store does not support row claiming")
        return self.store  # type: ignore[return-value]


class StoreBackend(_NoIO, Backend):
    """The sync Backend of a :class:`Store`: each primitive run by the store's sync driver."""

    store_class: ClassVar[type[Store]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store = cls.__dict__.get("store_class")
        if store is not None:  # the store's scheme, capabilities and options, read by the core
            cls.scheme, cls.capabilities, cls.options, cls.driver_options = (
                store.scheme,
                store.capabilities,
                store.options,
                store.driver_options,
            )
            cls.local_busy, cls.poll_share = store.local_busy, store.poll_share

    def __init__(self, url: StoreURL, client: Any = None) -> None:
        super().__init__(url, client)
        self.store = self.store_class(self)
        store = self.store_class
        driver = (client is not None and store.borrowed_sync_driver) or store.sync_driver
        self.io: Driver = _load(driver)(self, self.store)
        self.lines = Lines()  # this process's waiters, where the store has no push

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        return self.io.run(self.store.acquire(name, owner, owner_info, ttl, limit), "acquire")

    def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        steps = self.store.acquire_blocking(name, owner, owner_info, ttl, limit, timeout)
        return self.io.run(steps, "acquire")

    def release(self, name: str, owner: str) -> bool:
        released = self.io.run(self.store.release(name, owner), "release")
        if released and self.lines.names:
            self.lines.ring(name)
        return released

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        return self.io.run(self.store.extend(name, owner, ttl), "extend")

    def inspect(self, name: str) -> LockInfo | None:
        return self.io.run(self.store.inspect(name), "inspect")

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        yield from self.io.run(self.store.list(prefix), "list")

    def force_release(self, name: str) -> bool:
        return self.io.run(self.store.force_release(name), "force release")

    def purge_expired(self, limit: int | None = None) -> int:
        return self.io.run(self.store.purge_expired(limit), "purge")

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        return self.io.run(self.store.claim(names, owner, owner_info, ttl), "claim")

    def release_many(self, names: Sequence[str], owner: str) -> int:
        return self.io.run(self.store.release_many(names, owner), "release")

    def record_get(self, name: str) -> tuple[str | None, int]:
        return self.io.run(self.store.record_get(name), "record read")

    def record_set(self, name: str, value: str, version: int) -> int | None:
        return self.io.run(self.store.record_set(name, value, version), "record write")

    def record_delete(self, name: str, version: int) -> bool:
        return self.io.run(self.store.record_delete(name, version), "record delete")

    def rows_take(self, spec: RowSpec, limit: int) -> Any:
        rows = self._rows()
        pin = self.io.pin()  # type: ignore[attr-defined]
        try:  # ``where`` and ``order_by`` are the application's SQL: its errors are its own
            taken = pin.run(rows.rows_take(spec, limit), "take rows", user=True)
        except BaseException:
            if not pin.broken:  # the application's SQL failed: end the transaction
                with contextlib.suppress(Exception):
                    pin.run(rows.rows_end(False), "rollback")
            pin.release(not pin.broken)
            raise
        from latchkey.stores.rows_sql import Taken

        return Taken(pin, rows, taken)

    def rows_complete(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Any:
        rows = self._rows()
        pin = self.io.pin()  # type: ignore[attr-defined]
        try:
            pin.run(rows.rows_complete_begin(), "begin")
        except BaseException:
            pin.release(not pin.broken)
            raise
        from latchkey.stores.rows_sql import Completing

        return Completing(pin, rows, names, owner, tokens)

    def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> LeasedRows:
        rows = self._rows()
        steps = rows.rows_lease(spec, owner, owner_info, ttl, limit)
        return self._pinned(steps, "lease rows", user=True)  # type: ignore[no-any-return]

    def rows_held(self, spec: RowSpec, owner: str) -> Names:
        return self._pinned(self._rows().rows_held(spec, owner), "read leases")  # type: ignore[no-any-return]

    def rows_execute(self, sql: str, params: Any) -> RowTuples:
        steps = self._rows().rows_execute(sql, params)
        return self._pinned(steps, "execute", user=True)  # type: ignore[no-any-return]

    def rows_status(self, spec: RowSpec, limit: int) -> RowStates:
        steps = self._rows().rows_status(spec, limit)
        return self._pinned(steps, "read rows", user=True)  # type: ignore[no-any-return]

    def rows_notify(self, spec: RowSpec, wake: str) -> None:
        self.io.run(self._rows().rows_notify(spec, wake), "notify")
        self.lines.ring(wake)

    def _pinned(self, steps: Any, action: str, user: bool = False) -> Any:
        """Autocommit steps on a connection of their own (they send Statement requests),
        then back to the pool unless something broke it. ``user``: the statements hold the
        application's SQL, whose errors are raised as the driver's own."""
        pin = self.io.pin()  # type: ignore[attr-defined]
        try:
            return pin.run(steps, action, user)
        finally:
            pin.release(not pin.broken)

    def wait_in_line(self, name: str, owner: str, owner_info: str, ttl: float, limit: int) -> Any:
        steps = self.store.wait_in_line(name, owner, owner_info, ttl, limit)
        waiter = self.io.run(steps, "wait")
        return self.lines.join(name) if waiter is None else waiter  # no push: a line

    def subscribe(self, name: str) -> Any:
        return self.wait_in_line(name, "", "", 0.0, 1)

    def now(self) -> datetime:
        return self.io.run(self.store.now(), "clock read")

    def init(self) -> None:
        self.io.run(self.store.init(), "connect")

    def close(self) -> None:
        self.io.close()


class AsyncStoreBackend(_NoIO, AsyncBackend):
    """The asyncio AsyncBackend of a :class:`Store`: each primitive run by its asyncio
    driver."""

    store_class: ClassVar[type[Store]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store = cls.__dict__.get("store_class")
        if store is not None:  # the store's scheme, capabilities and options, read by the core
            cls.scheme, cls.capabilities, cls.options, cls.driver_options = (
                store.scheme,
                store.capabilities,
                store.options,
                store.driver_options,
            )
            cls.local_busy, cls.poll_share = store.local_busy, store.poll_share

    def __init__(self, url: StoreURL, client: Any = None) -> None:
        super().__init__(url, client)
        self.store = self.store_class(self)
        store = self.store_class
        driver = (client is not None and store.borrowed_async_driver) or store.async_driver
        self.io: AsyncDriver = _load(driver)(self, self.store)
        self.lines = AsyncLines()  # this process's waiters, where the store has no push

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        steps = self.store.acquire(name, owner, owner_info, ttl, limit)
        return await self.io.run(steps, "acquire")

    async def acquire_blocking(
        self,
        name: str,
        owner: str,
        owner_info: str,
        ttl: float,
        limit: int,
        timeout: float | None,
    ) -> Grant | Busy:
        steps = self.store.acquire_blocking(name, owner, owner_info, ttl, limit, timeout)
        return await self.io.run(steps, "acquire")

    async def release(self, name: str, owner: str) -> bool:
        released = await self.io.run(self.store.release(name, owner), "release")
        if released and self.lines.names:
            self.lines.ring(name)
        return released

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        return await self.io.run(self.store.extend(name, owner, ttl), "extend")

    async def inspect(self, name: str) -> LockInfo | None:
        return await self.io.run(self.store.inspect(name), "inspect")

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        for info in await self.io.run(self.store.list(prefix), "list"):
            yield info

    async def force_release(self, name: str) -> bool:
        return await self.io.run(self.store.force_release(name), "force release")

    async def purge_expired(self, limit: int | None = None) -> int:
        return await self.io.run(self.store.purge_expired(limit), "purge")

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        return await self.io.run(self.store.claim(names, owner, owner_info, ttl), "claim")

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        return await self.io.run(self.store.release_many(names, owner), "release")

    async def record_get(self, name: str) -> tuple[str | None, int]:
        return await self.io.run(self.store.record_get(name), "record read")

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        return await self.io.run(self.store.record_set(name, value, version), "record write")

    async def record_delete(self, name: str, version: int) -> bool:
        return await self.io.run(self.store.record_delete(name, version), "record delete")

    async def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Any:
        steps = self.store.wait_in_line(name, owner, owner_info, ttl, limit)
        waiter = await self.io.run(steps, "wait")
        return self.lines.join(name) if waiter is None else waiter  # no push: a line

    async def subscribe(self, name: str) -> Any:
        return await self.wait_in_line(name, "", "", 0.0, 1)

    async def rows_take(self, spec: RowSpec, limit: int) -> Any:
        rows = self._rows()
        pin = await self.io.pin()  # type: ignore[attr-defined]
        try:
            taken = await pin.run(rows.rows_take(spec, limit), "take rows", user=True)
        except BaseException:
            if not pin.broken:
                with contextlib.suppress(Exception):
                    await pin.run(rows.rows_end(False), "rollback")
            await pin.release(not pin.broken)
            raise
        from latchkey.stores.rows_sql import AsyncTaken

        return AsyncTaken(pin, rows, taken)

    async def rows_complete(self, names: Sequence[str], owner: str, tokens: Sequence[int]) -> Any:
        rows = self._rows()
        pin = await self.io.pin()  # type: ignore[attr-defined]
        try:
            await pin.run(rows.rows_complete_begin(), "begin")
        except BaseException:
            await pin.release(not pin.broken)
            raise
        from latchkey.stores.rows_sql import AsyncCompleting

        return AsyncCompleting(pin, rows, names, owner, tokens)

    async def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> LeasedRows:
        steps = self._rows().rows_lease(spec, owner, owner_info, ttl, limit)
        return await self._pinned(steps, "lease rows", user=True)  # type: ignore[no-any-return]

    async def rows_held(self, spec: RowSpec, owner: str) -> Names:
        steps = self._rows().rows_held(spec, owner)
        return await self._pinned(steps, "read leases")  # type: ignore[no-any-return]

    async def rows_execute(self, sql: str, params: Any) -> RowTuples:
        steps = self._rows().rows_execute(sql, params)
        return await self._pinned(steps, "execute", user=True)  # type: ignore[no-any-return]

    async def rows_notify(self, spec: RowSpec, wake: str) -> None:
        await self.io.run(self._rows().rows_notify(spec, wake), "notify")
        self.lines.ring(wake)

    async def rows_status(self, spec: RowSpec, limit: int) -> RowStates:
        steps = self._rows().rows_status(spec, limit)
        return await self._pinned(steps, "read rows", user=True)  # type: ignore[no-any-return]


    async def _pinned(self, steps: Any, action: str, user: bool = False) -> Any:
        pin = await self.io.pin()  # type: ignore[attr-defined]
        try:
            return await pin.run(steps, action, user)
        finally:
            await pin.release(not pin.broken)

    async def now(self) -> datetime:
        return await self.io.run(self.store.now(), "clock read")

    async def init(self) -> None:
        await self.io.run(self.store.init(), "connect")

    async def aclose(self) -> None:
        await self.io.aclose()
