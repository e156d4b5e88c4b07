"""Row claiming in the application's own table (seed 002, DESIGN.md §7): the rules of
:class:`latchkey.Rows` and its batches, for both APIs.

- :class:`RowsCore`: which rows (``table``, ``key``, ``columns`` validated as identifiers
  before any I/O; ``where``/``order_by`` kept as the application's SQL text), and that the
  store can claim rows at all;
- :class:`TakeCore`: a ``take`` batch — the store opens a transaction on a connection held for
  the batch and locks the due rows (``FOR UPDATE SKIP LOCKED``); waiting polls with capped
  backoff until a row is due or ``wait`` is over; the batch ends in COMMIT, or ROLLBACK when
  the ``with`` body raised (the rows are due again at once);
- :class:`LeaseCore`: a ``lease`` batch — leases on the due, unleased rows (lease names
  ``<table>:<key>``, one owner for the batch, fenced like any lock), ``done(row, …)``
  releases some, the end of the batch releases every lease not done (on an exception too:
  the rows are due again at once). A crashed worker's leases end by their TTL;
- :class:`CompleteCore`: ``complete(row, …)`` — the work of leased rows and the end of their
  leases in one transaction: the store opens it on a connection held for the block, the
  application's statements run in it, and at the end the leases are deleted only if still
  ours and live (owner and fencing token), then COMMIT; a lost lease rolls everything back
  and raises :class:`~latchkey.LockLost`; an exception in the block rolls back too (the rows
  stay leased until the batch ends).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from latchkey._core.lease import drift_margin, giving_back
from latchkey._core.ops import Steps, call, on, sleep
from latchkey._core.waiting import CAP_POLLING, CAP_WITH_PUSH, Backoff
from latchkey._durations import Duration, parse_duration, parse_ttl
from latchkey._owner import Owner, new_owner_token
from latchkey._types import Grant, RowSpec, RowState
from latchkey.errors import ConfigError, InvalidName, InvalidValue, LockLost, Unsupported

log = logging.getLogger("latchkey")

#: An identifier: letters, digits, ``_``, not starting with a digit, at most 63 characters.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")


def identifier(value: object, what: str, *, dotted: bool = False) -> str:
    """``value`` if it is an identifier (``schema.table`` too when ``dotted``), else
    InvalidName naming it. Identifiers are quoted by the store, never escaped."""
    if isinstance(value, str):
        parts = value.split(".") if dotted else [value]
        if len(parts) <= 2 and all(IDENTIFIER.match(part) for part in parts):
            return value
    shape = "[schema.]name" if dotted else "name"
    raise InvalidName(
        f"rows: {what} {value!r} is not an identifier ({shape}: letters, digits and _, not "
        "starting with a digit, at most 63 characters)"
    )


def sql_text(value: object, what: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise InvalidValue(f"rows: {what} must be SQL text or None, got {value!r}")


def check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidValue(f"rows: limit must be an int of at least 1, got {limit!r}")
    return limit


def check_duration(value: Duration, what: str, *, ttl: bool = False) -> float:
    try:
        seconds = parse_ttl(value, what=what) if ttl else parse_duration(value, what=what)
    except ConfigError as exc:
        raise InvalidValue(f"rows: {exc}") from None
    return seconds


class RowsCore:
    """Which rows of which table a queue claims. Not public: see :class:`latchkey.Rows`."""

    def __init__(
        self,
        store: Any,
        table: str,
        key: str = "id",
        where: str | None = None,
        order_by: str | None = None,
        columns: Sequence[str] | None = None,
    ) -> None:
        if not store.capabilities.rows:
            raise Unsupported(
                f"the {store.scheme} store ({store.url}) cannot claim rows: store.rows needs "
                "the table in a SQL store's database (postgresql://, mysql://, sqlite://)"
            )
        if isinstance(columns, str):
            raise InvalidName(f"rows: columns must be a sequence of names, got {columns!r}")
        self.store = store
        #: What is claimed: the validated identifiers and the application's SQL text.
        self.spec = RowSpec(
            identifier(table, "table", dotted=True),
            identifier(key, "key"),
            sql_text(where, "where"),
            sql_text(order_by, "order_by"),
            None if columns is None else tuple(identifier(c, "column") for c in columns),
        )

    @property
    def wake_sql(self) -> str | None:
        """PostgreSQL: a statement, all literals, that wakes the takers and lessees of this
        table waiting for due rows in every process, when the transaction that runs it
        commits: run it where rows become due (the transaction that inserts them, or an
        ``AFTER INSERT … FOR EACH STATEMENT`` trigger's ``PERFORM``). None on the other
        stores: there :meth:`notify` wakes the waiters it can, and the rest poll."""
        return self.store.backend.rows_wake_sql(wake_name(self.spec))  # type: ignore[no-any-return]

    def _notify(self) -> Steps[None]:
        yield call("rows_notify", self.spec, wake_name(self.spec))

    def _status(self, limit: int) -> Steps[list[RowState]]:
        spec, limit = self.spec, check_limit(limit)
        return (yield call("rows_status", spec, limit))  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec.table} key={self.spec.key}>"


class BatchCore:
    """What both batches share: the rows (dicts, in the query's order), len and truth."""

    rows: list[dict[str, Any]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)


def wake_name(spec: RowSpec) -> str:
    """The name whose release notices wake the takers and lessees of ``spec``'s table waiting
    for due rows (:meth:`latchkey.Rows.notify`): not a row's lease name (``<table>:<key>``)."""
    return f"latchkey.rows:{spec.table}"


def poll(
    first: Steps[Any], again: Any, wait: float, got: Any, wake: str | None = None,
    push: bool = False,
) -> Steps[Any]:  # fmt: skip
    """Ask ``first`` (a step list that returns an answer); while ``got(answer)`` is false and
    ``wait`` seconds have not passed, pause with capped backoff and ask ``again()``.

    ``wake``: a name to subscribe to (``Backend.subscribe``) once the first answer came back
    empty, before the second ask, so a notice sent after that ask is never missed; a notice
    ends the pause at once. On a store with push between processes (``push``) the pauses grow
    to CAP_WITH_PUSH (the poll is then the safety net), else to CAP_POLLING (the waiter is
    only woken from this process)."""
    deadline = time.monotonic() + wait
    answer = yield from first
    if got(answer) or wait <= 0:
        return answer
    backoff = Backoff(cap=CAP_WITH_PUSH if push and wake else CAP_POLLING)
    waiter = None if wake is None else (yield call("subscribe", wake))
    try:
        if waiter is not None:
            answer = yield from again()
        while not got(answer):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            delay = min(backoff.next(), remaining)
            if waiter is None:
                yield sleep(delay)
            elif (yield on(waiter, "wait", delay)):
                backoff.reset()
            answer = yield from again()
    finally:
        if waiter is not None:
            yield on(waiter, "close")
    return answer


class TakeCore(BatchCore):
    """A take batch. Not public: see :class:`latchkey.TakeBatch`."""

    def __init__(self, rows: RowsCore, limit: int, wait: Duration) -> None:
        self.spec = rows.spec
        self._push = rows.store.capabilities.push
        self.limit = check_limit(limit)
        self.wait = check_duration(wait, "wait")
        self.rows = []
        self._handle: Any = None

    def _ask(self) -> Steps[Any]:
        handle = yield call("rows_take", self.spec, self.limit)
        if not handle.rows:  # nothing due: hold no transaction, no connection
            yield on(handle, "finish", True)
            return None
        return handle

    def _begin(self) -> Steps[None]:
        if self._handle is not None:
            raise InvalidValue("rows: this take batch is already open")
        self._handle = yield from poll(
            self._ask(), self._ask, self.wait, bool, wake_name(self.spec), self._push
        )
        self.rows = [] if self._handle is None else self._handle.rows

    def _execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]:
        if self._handle is None:
            raise InvalidValue(
                "rows: execute needs an open take batch with rows (an empty batch holds no "
                "transaction)"
            )
        return (yield on(self._handle, "execute", sql, params))  # type: ignore[no-any-return]

    def _end(self, commit: bool) -> Steps[None]:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if commit:
            yield on(handle, "finish", True)
            return
        try:
            yield on(handle, "finish", False)
        except Exception as exc:  # the body's error is the one to raise; the connection is gone
            log.warning("rows: rollback of a take batch of %s failed: %s", self.spec.table, exc)

    def __repr__(self) -> str:
        state = "open" if self._handle is not None else "closed"
        return f"<{type(self).__name__} {self.spec.table} rows={len(self.rows)} {state}>"


class LeaseCore(BatchCore):
    """A lease batch. Not public: see :class:`latchkey.LeaseBatch`."""

    def __init__(
        self,
        rows: RowsCore,
        limit: int,
        ttl: Duration,
        wait: Duration,
        metadata: Mapping[str, Any] | None,
    ) -> None:
        self.spec = rows.spec
        self._push = rows.store.capabilities.push
        self.limit = check_limit(limit)
        self.ttl = check_duration(ttl, "ttl", ttl=True)
        self.wait = check_duration(wait, "wait")
        self._metadata = dict(metadata or {})
        self._owner = new_owner_token()
        self.rows = []
        self._grants: dict[str, Grant] = {}
        self._held: set[str] = set()
        self._deadline = 0.0

    def name_of(self, row: Mapping[str, Any]) -> str:
        """The lease name of a row: ``<table>:<key>``."""
        return f"{self.spec.table}:{row[self.spec.key]}"

    def _ask(self) -> Steps[Any]:
        info = Owner.current(self._metadata).to_json()
        self._sent = time.monotonic()
        args = (self.spec, self._owner, info, self.ttl, self.limit)
        return (yield call("rows_lease", *args))

    def _begin(self) -> Steps[None]:
        if self._held:
            raise InvalidValue("rows: this lease batch is already open")
        # The store may have leased rows before a failure (its answer lost, or cancelled in
        # flight): whatever this batch's owner holds is given back, owner-checked.
        leased = yield from giving_back(
            poll(self._ask(), self._ask, self.wait, bool, wake_name(self.spec), self._push),
            self._give_back,
            self.ttl,
        )
        self._deadline = self._sent + self.ttl - drift_margin(self.ttl)
        self.rows = [row for row, _ in leased]
        self._grants = {self.name_of(row): grant for row, grant in leased}
        self._held = set(self._grants)

    def _give_back(self) -> Steps[None]:
        """Release every lease of this batch's owner on the table's rows: found by owner, as
        the answer that named them was lost."""
        names = yield call("rows_held", self.spec, self._owner)
        if names:
            yield call("release_many", names, self._owner)

    def token(self, row: Mapping[str, Any]) -> int:
        """The fencing token of a leased row's lease."""
        grant = self._grants.get(self.name_of(row))
        if grant is None or grant.token is None:
            raise InvalidValue(f"rows: {self.name_of(row)!r} is not a row of this batch")
        return grant.token

    def remaining(self) -> float:
        """Seconds left before the batch's leases end, by our own clock (safe side)."""
        return max(0.0, self._deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once the leases' TTL has passed: stop working on the batch."""
        return time.monotonic() >= self._deadline

    def _done(self, rows: Sequence[Mapping[str, Any]]) -> Steps[bool]:
        names = list(dict.fromkeys(self.name_of(row) for row in rows))
        held = [name for name in names if name in self._held]
        self._held.difference_update(held)
        if not held:
            return False
        if len(held) == 1:
            live = yield call("release", held[0], self._owner)
        else:  # one statement for them all
            live = (yield call("release_many", held, self._owner)) == len(held)
        return bool(live) and len(held) == len(names)

    def _held_names(self, rows: Sequence[Mapping[str, Any]]) -> list[str]:
        """The lease names of ``rows``, each a row this batch still holds (InvalidValue
        otherwise, before any I/O)."""
        names = list(dict.fromkeys(self.name_of(row) for row in rows))
        for name in names:
            if name not in self._held:
                raise InvalidValue(
                    f"rows: {name!r} is not held by this batch (not one of its rows, or done "
                    "or completed already)"
                )
        return names

    def _end(self) -> Steps[int]:
        names = sorted(self._held)
        self._held.clear()
        if not names:
            return 0
        return (yield call("release_many", names, self._owner))  # type: ignore[no-any-return]

    def _execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]:
        return (yield call("rows_execute", sql, params))  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.spec.table} rows={len(self.rows)} "
            f"held={len(self._held)}>"
        )


class CompleteCore:
    """The work of some leased rows and the end of their leases, in one transaction. Not
    public: see :class:`latchkey.Completion`."""

    def __init__(self, lease: LeaseCore, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            raise InvalidValue("rows: complete needs at least one row")
        self.lease = lease
        self.names = lease._held_names(rows)
        self.tokens = [lease._grants[name].token for name in self.names]
        self._handle: Any = None
        self._used = False

    def _begin(self) -> Steps[None]:
        if self._used:
            raise InvalidValue("rows: a complete block runs once")
        self._used = True
        for name in self.names:  # done in between?
            if name not in self.lease._held:
                raise InvalidValue(f"rows: {name!r} was done or completed already")
        self._handle = yield call("rows_complete", self.names, self.lease._owner, self.tokens)

    def _execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]:
        if self._handle is None:
            raise InvalidValue("rows: execute needs an open complete block")
        return (yield on(self._handle, "execute", sql, params))  # type: ignore[no-any-return]

    def _end(self, commit: bool) -> Steps[None]:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if not commit:  # the block raised: nothing of it commits; the leases stay ours
            try:
                yield on(handle, "finish", False)
            except Exception as exc:  # the body's error is the one to raise
                log.warning("rows: rollback of a complete on %s failed: %s",
                            self.lease.spec.table, exc)  # fmt: skip
            return
        committed = yield on(handle, "finish", True)
        self.lease._held.difference_update(self.names)  # ended, or not ours any more
        if not committed:
            raise LockLost(
                f"rows: the lease of {', '.join(map(repr, self.names))} was lost (its TTL "
                "passed; another worker may hold it now): the work was rolled back"
            )

    def __repr__(self) -> str:
        state = "open" if self._handle is not None else "closed"
        return f"<{type(self).__name__} {', '.join(self.names)} {state}>"
