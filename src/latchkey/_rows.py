"""Rows, TakeBatch, LeaseBatch and Completion: the sync shell over the row-claiming rules
(:mod:`latchkey._core.rows`); the asyncio twin is :mod:`latchkey._async.rows`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey._core.rows import CompleteCore, LeaseCore, RowsCore, TakeCore
from latchkey._core.store import DEFAULT_TTL
from latchkey._durations import Duration
from latchkey._run import run
from latchkey._types import RowState

if TYPE_CHECKING:
    from latchkey._store import Store
    from latchkey.stores.io import Steps

_T = TypeVar("_T", bound="_Transaction")


class Rows(RowsCore):
    """Rows of the application's own table, claimed by batches: made by
    :meth:`latchkey.Store.rows` (SQL stores only: the table lives in the store's database).

    ``table``, ``key`` and ``columns`` are identifiers (``InvalidName`` otherwise, before any
    I/O). ``where`` and ``order_by`` are SQL text written by the application and sent as they
    are: **they must never come from end users**.

    .. versionadded:: 0.2
    """

    store: Store

    def __init__(
        self,
        store: Store,
        table: str,
        key: str = "id",
        where: str | None = None,
        order_by: str | None = None,
        columns: Sequence[str] | None = None,
    ) -> None:
        super().__init__(store, table, key, where, order_by, columns)

    def status(self, limit: int = 50) -> list[RowState]:
        """Up to ``limit`` due rows (in ``order_by``) as an operator asks when a queue
        stalls: each one's live lease (who, until when) and whether a take's transaction
        locks it now (found by trying to lock the due rows in a transaction rolled back at
        once, so a take may skip them for that moment; None on SQLite: cannot tell)."""
        return run(self._status(limit), self.store.backend)

    def notify(self) -> None:
        """Tell the takers and lessees waiting for due rows of this table (``wait`` > 0) to
        look now, after the rows were made due (committed). PostgreSQL: a NOTIFY, every
        process (see :attr:`wake_sql` to send it from the application's own transaction or
        a trigger); SQLite: every process on this machine; MariaDB: every process (a
        ``KILL QUERY`` of each waiting process's bell); MySQL: this process only (the others
        find the rows by their polls).

        .. versionadded:: 0.2
        """
        run(self._notify(), self.store.backend)

    def take(self, limit: int = 1, wait: Duration = 0) -> TakeBatch:
        """Up to ``limit`` due rows locked in one transaction, for a ``with`` block:
        ``batch.execute`` runs statements in it; it commits at the end of the block, or rolls
        back if the block raised (the rows are due again at once). ``wait``: how long to poll
        for at least one due row (0: once)."""
        return TakeBatch(self, limit, wait)

    def lease(
        self,
        limit: int = 1,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> LeaseBatch:
        """Up to ``limit`` due rows with no live lease, each leased for ``ttl`` (lease name
        ``<table>:<key>``), for a ``with`` block; no transaction is held while it runs."""
        return LeaseBatch(self, limit, ttl, wait, metadata)


class _Transaction:
    """The shell of one open transaction (a take's, a complete's): ``execute`` in it, and a
    ``with`` block that begins it and commits at its end, or rolls back if the block raised.
    The core class beside it in the bases gives ``_begin``, ``_execute`` and ``_end``."""

    store: Store

    if TYPE_CHECKING:

        def _begin(self) -> Steps[None]: ...
        def _execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]: ...
        def _end(self, commit: bool) -> Steps[None]: ...

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run a statement in the transaction, in the driver's placeholder style (psycopg and
        PyMySQL ``%s``, sqlite3 ``?``); the rows it produced (none: ``[]``). An error of the
        statement is the driver's own exception."""
        return run(self._execute(sql, params), self.store.backend)

    def __enter__(self: _T) -> _T:
        run(self._begin(), self.store.backend)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run(self._end(exc_type is None), self.store.backend)


class TakeBatch(_Transaction, TakeCore):
    """The rows a take locked (dicts, iterated in the query's order; ``len`` and truth work),
    in one open transaction on one connection, until the ``with`` block ends; ``execute``
    runs statements in it.

    .. versionadded:: 0.2
    """

    def __init__(self, rows: Rows, limit: int, wait: Duration) -> None:
        super().__init__(rows, limit, wait)
        self.store = rows.store


class LeaseBatch(LeaseCore):
    """The rows a lease took (dicts; ``len`` and truth work), each under its own lease until
    :meth:`done` or the end of the ``with`` block, which releases every lease not done (also
    when the block raised: the rows are due again at once).

    .. versionadded:: 0.2
    """

    def __init__(
        self,
        rows: Rows,
        limit: int,
        ttl: Duration,
        wait: Duration,
        metadata: Mapping[str, Any] | None,
    ) -> None:
        super().__init__(rows, limit, ttl, wait, metadata)
        self.store = rows.store

    def done(self, row: Mapping[str, Any], *more: Mapping[str, Any]) -> bool:
        """Release these rows' leases now (several: in one statement); True if every one was
        still ours and live (a row done already counts as not).

        .. versionchanged:: 0.2
           Several rows at once."""
        return run(self._done((row, *more)), self.store.backend)

    def complete(self, row: Mapping[str, Any], *more: Mapping[str, Any]) -> Completion:
        """The work of these leased rows and the end of their leases in one transaction, for
        a ``with`` block: ``tx.execute`` runs statements in it (the driver's placeholder
        style); at the end of the block the rows' leases are ended *only if still ours and
        live* (owner and fencing token) and everything commits together — exactly once for
        work done in the same database. If a lease was lost (its TTL passed), everything is
        rolled back and :class:`~latchkey.LockLost` is raised; if the block raises, everything
        is rolled back and the rows stay leased until :meth:`done` or the batch's end.

        .. versionadded:: 0.2"""
        return Completion(self, (row, *more))

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run a statement in a short transaction of its own (autocommit), in the driver's
        placeholder style; the rows it produced (none: ``[]``)."""
        return run(self._execute(sql, params), self.store.backend)

    def __enter__(self) -> LeaseBatch:
        run(self._begin(), self.store.backend)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run(self._end(), self.store.backend)


class Completion(_Transaction, CompleteCore):
    """A ``complete`` block's transaction on one connection: ``execute`` runs statements in
    it; the block's end commits the work with the end of the rows' leases, or rolls back.
    See :meth:`LeaseBatch.complete`.

    .. versionadded:: 0.2
    """

    def __init__(self, batch: LeaseBatch, rows: Sequence[Mapping[str, Any]]) -> None:
        super().__init__(batch, rows)
        self.store = batch.store
