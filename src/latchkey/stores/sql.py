"""The SQL lease table, written once for SQLite, PostgreSQL and MySQL/MariaDB.

One row per lease slot keyed by (name, slot) — the owner token, the owner's JSON, the fencing
token, the store-clock times — and a records table beside it. Names are stored as their UTF-8
bytes, so any character, NUL included, round-trips; they are always parameters.

:class:`LeaseTable` holds every primitive's control flow; a dialect (``stores/sqlite.py``,
``stores/postgresql.py``, ``stores/mysql.py``) subclasses it with its statements as named
constants (class attributes, ``{t}`` standing for the validated table name) and the few
conversions that differ (how a time is read back, how a prefix becomes a pattern). Where a
dialect does a primitive in a different number of statements (acquire: one upsert on MySQL,
a short transaction on SQLite) it overrides that primitive alone.

Requests are :class:`Query` tuples; an SQL driver answers each with ``(rows, rowcount)``: the
last result set's rows and the last statement's row count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, TypeVar

from latchkey._owner import Owner
from latchkey._types import Holder, LockInfo
from latchkey._url import Option, identifier
from latchkey.stores.base import BackendBase, group_by_name
from latchkey.stores.io import Steps
from latchkey.stores.primitives import Store

T = TypeVar("T")

#: ``PURGE``'s limit when the caller gave none: every expired row.
ALL = 2**62
Result = tuple[list[Any], int]


class Query(NamedTuple):
    """One SQL request: the statement text (table name already in), its parameters, and
    whether ``params`` is a sequence of rows for ``executemany``."""

    sql: str
    params: Any = ()
    many: bool = False


class LeaseTable(Store):
    """The SQL lease table's primitives. Statement constants (``{t}``: the table) and their
    inputs, in this order:

    - ``RELEASE`` (name, owner): ends our live lease, never another's → :meth:`was_live`;
    - ``INSPECT`` (name) and ``LIST`` (:meth:`prefix_params`): live holders as rows of
      (name, owner_info, token, acquired_at, expires_at), oldest first (LIST: by name);
    - ``FORCE_RELEASE`` (name) → :meth:`was_live`; ``PURGE`` (limit) → rowcount: at most
      limit expired rows, through the expiry index;
    - ``RECORD_GET`` (name) → (value, version); ``RECORD_INSERT`` (name, value) creates only
      if absent (rowcount 0 otherwise); ``RECORD_UPDATE`` (value, name, version) and
      ``RECORD_DELETE`` (name, version) only if the version is still the one read;
    - ``NOW`` () → one row with the store's clock (read by :meth:`time`).

    ``acquire``, ``extend`` and ``claim`` are the dialect's own (their statements differ in
    shape, not just in spelling).
    """

    options: ClassVar[dict[str, Option]] = {
        "table": Option(identifier, "latchkey_locks", "lease table name")
    }
    RELEASE: ClassVar[str]
    INSPECT: ClassVar[str]
    LIST: ClassVar[str]
    FORCE_RELEASE: ClassVar[str]
    PURGE: ClassVar[str]
    RECORD_GET: ClassVar[str]
    RECORD_INSERT: ClassVar[str]
    RECORD_UPDATE: ClassVar[str]
    RECORD_DELETE: ClassVar[str]
    NOW: ClassVar[str]
    #: Starts a transaction that takes its write locks up front where the dialect can.
    BEGIN: ClassVar[str] = "BEGIN"

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        self.table: str = self.config["table"]
        # Every statement constant, with the table's name in (validated: an identifier), as
        # an instance attribute of the same name: rendered once, not at every call.
        for cls in reversed(type(self).__mro__):
            for key, value in vars(cls).items():
                if key.isupper() and isinstance(value, str) and "{t}" in value:
                    setattr(self, key, value.replace("{t}", self.table))

    # -- the dialect's conversions -------------------------------------------------------------

    def time(self, value: Any) -> datetime:
        """A time as the driver returns it → aware UTC datetime."""
        raise NotImplementedError

    def was_live(self, result: Result) -> bool:
        """Whether a RELEASE / FORCE_RELEASE ended a live lease (default: its row count)."""
        return result[1] > 0

    def prefix_params(self, prefix: bytes) -> Sequence[Any]:
        """LIST's parameters for names starting with ``prefix``."""
        raise NotImplementedError

    def holder(self, row: Sequence[Any]) -> Holder:
        """(name, owner_info, token, acquired_at, expires_at) → Holder."""
        return Holder(int(row[2]), Owner.from_json(row[1]), self.time(row[3]), self.time(row[4]))

    # -- primitives ------------------------------------------------------------------------------

    def released(self, names: tuple[str, ...], everyone: bool = False) -> Steps[None]:
        """After a release that ended leases of ``names`` has committed: wake their waiters
        (the first in line; ``everyone`` after a force-release), where the dialect does not do
        it in the statement itself (SQLite rings doorbells)."""
        return
        yield  # a generator

    def release(self, name: str, owner: str) -> Steps[bool]:
        result = yield Query(self.RELEASE, (name.encode(), owner))
        if result[0] or result[1] > 0:
            yield from self.released((name,))
        return self.was_live(result)

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        rows, _ = yield Query(self.INSPECT, (name.encode(),))
        return LockInfo(name, tuple(self.holder(row) for row in rows)) if rows else None

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        rows, _ = yield Query(self.LIST, self.prefix_params(prefix.encode()))
        return list(group_by_name(rows, self.holder))

    def force_release(self, name: str) -> Steps[bool]:
        result = yield Query(self.FORCE_RELEASE, (name.encode(),))
        if result[0] or result[1] > 0:
            yield from self.released((name,), everyone=True)
        return self.was_live(result)

    def purge_expired(self, limit: int | None) -> Steps[int]:
        _, count = yield Query(self.PURGE, (ALL if limit is None else limit,))
        return int(count)

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        rows, _ = yield Query(self.RECORD_GET, (name.encode(),))
        return (rows[0][0], int(rows[0][1])) if rows else (None, 0)

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        if version == 0:
            _, count = yield Query(self.RECORD_INSERT, (name.encode(), value))
        else:
            query = Query(self.RECORD_UPDATE, (value, name.encode(), version))
            _, count = yield query
        return version + 1 if count == 1 else None

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        _, count = yield Query(self.RECORD_DELETE, (name.encode(), version))
        return bool(count == 1)

    def now(self) -> Steps[datetime]:
        rows, _ = yield Query(self.NOW)
        return self.time(rows[0][0])

    # -- helpers for the dialects ------------------------------------------------------------------

    def transaction(self, body: Steps[T]) -> Steps[T]:
        """Run ``body`` (a generator of queries) inside one transaction: committed when it
        returns, rolled back when it raises (the rollback's own failure is not raised over
        the first error: the driver drops a connection that failed)."""
        yield Query(self.BEGIN)
        try:
            result = yield from body
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                yield Query("ROLLBACK")
            raise
        yield Query("COMMIT")
        return result


def chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """``items`` in slices of at most ``size`` (statements have a parameter limit)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
