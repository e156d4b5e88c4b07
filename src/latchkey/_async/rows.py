"""AsyncRows, AsyncTakeBatch, AsyncLeaseBatch and AsyncCompletion: the asyncio shell over the
row-claiming rules (:mod:`latchkey._core.rows`), the twins of :mod:`latchkey._rows`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey._async._run import arun
from latchkey._core.rows import CompleteCore, LeaseCore, RowsCore, TakeCore
from latchkey._core.store import DEFAULT_TTL
from latchkey._durations import Duration
from latchkey._types import RowState

if TYPE_CHECKING:
    from latchkey._async.store import AsyncStore
    from latchkey.stores.io import Steps

_T = TypeVar("_T", bound="_AsyncTransaction")


class AsyncRows(RowsCore):
    """:class:`latchkey.Rows` for asyncio: ``async with rows.take(…) as batch``,
    ``async with rows.lease(…) as batch``. ``where`` and ``order_by`` must never come from
    end users.

    .. versionadded:: 0.2
    """

    store: AsyncStore

    def __init__(
        self,
        store: AsyncStore,
        table: str,
        key: str = "id",
        where: str | None = None,
        order_by: str | None = None,
        columns: Sequence[str] | None = None,
    ) -> None:
        super().__init__(store, table, key, where, order_by, columns)

    async def status(self, limit: int = 50) -> list[RowState]:
        """See :meth:`latchkey.Rows.status`."""
        return await arun(self._status(limit), self.store.backend)

    async def notify(self) -> None:
        """See :meth:`latchkey.Rows.notify`."""
        await arun(self._notify(), self.store.backend)

    def take(self, limit: int = 1, wait: Duration = 0) -> AsyncTakeBatch:
        """See :meth:`latchkey.Rows.take`."""
        return AsyncTakeBatch(self, limit, wait)

    def lease(
        self,
        limit: int = 1,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncLeaseBatch:
        """See :meth:`latchkey.Rows.lease`."""
        return AsyncLeaseBatch(self, limit, ttl, wait, metadata)


class _AsyncTransaction:
    """:class:`latchkey._rows._Transaction` for asyncio (``await tx.execute(…)``, ``async
    with``); the core class beside it gives ``_begin``, ``_execute`` and ``_end``."""

    store: AsyncStore

    if TYPE_CHECKING:

        def _begin(self) -> Steps[None]: ...
        def _execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]: ...
        def _end(self, commit: bool) -> Steps[None]: ...

    async def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """See :meth:`latchkey.TakeBatch.execute`."""
        return await arun(self._execute(sql, params), self.store.backend)

    async def __aenter__(self: _T) -> _T:
        await arun(self._begin(), self.store.backend)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await arun(self._end(exc_type is None), self.store.backend)


class AsyncTakeBatch(_AsyncTransaction, TakeCore):
    """:class:`latchkey.TakeBatch` for asyncio (``await batch.execute(…)``).

    .. versionadded:: 0.2
    """

    def __init__(self, rows: AsyncRows, limit: int, wait: Duration) -> None:
        super().__init__(rows, limit, wait)
        self.store = rows.store


class AsyncLeaseBatch(LeaseCore):
    """:class:`latchkey.LeaseBatch` for asyncio (``await batch.done(row)``).

    .. versionadded:: 0.2
    """

    def __init__(
        self,
        rows: AsyncRows,
        limit: int,
        ttl: Duration,
        wait: Duration,
        metadata: Mapping[str, Any] | None,
    ) -> None:
        super().__init__(rows, limit, ttl, wait, metadata)
        self.store = rows.store

    async def done(self, row: Mapping[str, Any], *more: Mapping[str, Any]) -> bool:
        """See :meth:`latchkey.LeaseBatch.done`."""
        return await arun(self._done((row, *more)), self.store.backend)

    def complete(self, row: Mapping[str, Any], *more: Mapping[str, Any]) -> AsyncCompletion:
        """See :meth:`latchkey.LeaseBatch.complete`: ``async with batch.complete(row) as tx:
        await tx.execute(…)``."""
        return AsyncCompletion(self, (row, *more))

    async def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """See :meth:`latchkey.LeaseBatch.execute`."""
        return await arun(self._execute(sql, params), self.store.backend)

    async def __aenter__(self) -> AsyncLeaseBatch:
        await arun(self._begin(), self.store.backend)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await arun(self._end(), self.store.backend)


class AsyncCompletion(_AsyncTransaction, CompleteCore):
    """:class:`latchkey.Completion` for asyncio (``await tx.execute(…)``).

    .. versionadded:: 0.2
    """

    def __init__(self, batch: AsyncLeaseBatch, rows: Sequence[Mapping[str, Any]]) -> None:
        super().__init__(batch, rows)
        self.store = batch.store
