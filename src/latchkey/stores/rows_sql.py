"""Row claiming in the application's own table (``store.rows``), written once for SQLite,
PostgreSQL and MySQL/MariaDB.

Two ways to claim rows (DESIGN.md §7):

- *take*: one transaction on one connection held for the whole batch (a
  :class:`~latchkey.stores.io.Pinned` connection); the due rows are selected ``FOR UPDATE
  SKIP LOCKED`` (SQLite: inside ``BEGIN IMMEDIATE``, which serialises writers), the
  application's statements run in that transaction, and the batch ends in COMMIT or ROLLBACK;
- *lease*: the due rows that have no live lease in latchkey's lease table get one, named
  ``<table>:<key>``, through the dialect's batch claim (fenced like any lock). On PostgreSQL
  in one statement (the store's ``ROWS_LEASE``: the candidates read ``FOR UPDATE SKIP
  LOCKED``, so concurrent lessees get disjoint rows, and claimed, in a CTE); on SQLite in one
  ``BEGIN IMMEDIATE`` transaction: read, claim, COMMIT. On MySQL/MariaDB (where a locking
  read ran slower: ``rows_lease`` says why) the candidates are read and claimed in autocommit
  statements, then read again, and those no longer due (another worker finished them between
  our two reads) are released at once. No transaction stays open while the work runs;
- *complete*: a leased row's work and the end of its lease in one transaction on a pinned
  connection: the application's statements, then the rows' leases deleted only if still
  ours and live (owner and fencing token), then COMMIT — or ROLLBACK if a lease was lost.

:class:`RowClaims` holds the control flow once; a dialect (:data:`POSTGRESQL`, :data:`MYSQL`,
:data:`SQLITE`) supplies the spelling: identifier quoting, the placeholder, how a transaction
starts, the locking clause, and how the lease name of a row is written in SQL (the key's text
form, as Python's ``str()`` writes it for integers and text).

The application's statements (and ours that need column names back) are :class:`Statement`
requests, in the driver's own placeholder style; a driver answers ``(columns, rows)``, with
``columns`` None for a statement that returns no rows. ``where`` and ``order_by`` are SQL text
from the application, spliced in as given: they must never come from end users (the docs say
so). ``table``, ``key`` and ``columns`` are identifiers, validated by the core and quoted here.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from latchkey._types import Grant, RowSpec, RowState
from latchkey.errors import StoreUnavailable, Unsupported
from latchkey.stores.io import Steps
from latchkey.stores.sql import Query

if TYPE_CHECKING:
    from latchkey.stores.io import Pinned
    from latchkey.stores.io.aio import AsyncPinned


class Statement(NamedTuple):
    """A statement in the driver's own placeholder style (psycopg and PyMySQL ``%s``, sqlite3
    ``?``); ``params`` None: the text is sent as it is (no placeholder processing, so a ``%``
    in ``where`` needs no escaping). Answered ``(columns or None, rows)``."""

    sql: str
    params: Any = None


@dataclass(frozen=True)
class Dialect:
    """How one SQL dialect spells the row-claiming statements."""

    quote: str
    """Encloses an identifier (the core allows only letters, digits and ``_``: no escaping)."""
    BEGIN: str
    """Starts a take's transaction, a lease's (PostgreSQL, SQLite) and a complete's."""
    LOCKING: str
    """Ends a take's SELECT: lock the rows, skip those another transaction holds."""
    LEASE_NAME: str
    """A row's lease name as the lease table stores it, from ``{prefix}`` (the literal
    ``'<table>:'``) and ``{key}`` (the table-qualified, quoted key column)."""
    LIVE: str
    """True for a live lease row ``latchkey_lease`` (an alias no application table shadows)."""
    PARAM: str
    """The driver's placeholder."""


#: PostgreSQL: names are bytea (the UTF-8 bytes), ``key::text`` is the key's text form.
POSTGRESQL = Dialect(
    quote='"',
    BEGIN="BEGIN",
    LOCKING="FOR UPDATE SKIP LOCKED",
    LEASE_NAME="convert_to({prefix} || {key}::text, 'UTF8')",
    LIVE="latchkey_lease.expires_at > now()",
    PARAM="%s",
)
#: MySQL 8 / MariaDB ≥ 10.6: names are VARBINARY (the UTF-8 bytes of the connection's utf8mb4).
MYSQL = Dialect(
    quote="`",
    BEGIN="START TRANSACTION",
    LOCKING="FOR UPDATE SKIP LOCKED",
    LEASE_NAME="CAST(CONCAT({prefix}, {key}) AS BINARY)",
    LIVE="latchkey_lease.expires_at > UTC_TIMESTAMP(6)",
    PARAM="%s",
)
#: SQLite: BEGIN IMMEDIATE takes the database's write lock, so no row lock is needed; names
#: are BLOBs of UTF-8, times integer milliseconds.
SQLITE = Dialect(
    quote='"',
    BEGIN="BEGIN IMMEDIATE",
    LOCKING="",
    LEASE_NAME="CAST({prefix} || {key} AS BLOB)",
    LIVE="latchkey_lease.expires_at > CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    PARAM="?",
)

#: The server version string's numbers (MariaDB 10.x may prefix '5.5.5-').
_VERSION = re.compile(r"(?:5\.5\.5-)?(\d+)\.(\d+)\.(\d+)")


def skip_locked_supported(server_version: str) -> bool:
    """Whether a MySQL or MariaDB server (its ``VERSION()`` text) has ``SKIP LOCKED``:
    MySQL ≥ 8.0.1, MariaDB ≥ 10.6."""
    match = _VERSION.match(server_version.strip())
    if match is None:
        return False
    version = tuple(int(part) for part in match.groups())
    if "mariadb" in server_version.lower():
        return version >= (10, 6, 0)
    return version >= (8, 0, 1)


#: Reads and claims a lease makes at most before an empty batch, when other workers keep
#: claiming every row it read (each round, the rows they took are no longer candidates).
LEASE_ROUNDS = 8
#: The widest window of due rows a contended lease picks from.
LEASE_WINDOW = 2000


class RowClaims:
    """The row-claiming primitives of a SQL lease-table store, as generators (mixed into
    ``SQLite``, ``PostgreSQL`` and ``MySQL``; ``ROWS`` is the dialect)."""

    ROWS: ClassVar[Dialect]
    scheme: ClassVar[str]
    table: str

    def lease_table(self) -> str:
        """The lease table, as a statement names it."""
        schema = getattr(self, "schema", None)
        q = self.ROWS.quote
        return f"{q}{schema}{q}.{q}{self.table}{q}" if schema else f"{q}{self.table}{q}"

    def rows_select(self, spec: RowSpec, limit: int, lock: str, lease: str | None) -> str:
        """The due rows of ``spec`` in its order, at most ``limit``. ``lease``: None (any
        row), ``""`` (rows with no live lease) or an owner token (rows it holds a live lease
        on). No parameters: the limit is an int, the lease-name prefix (the table, an
        identifier) and the owner (hex) are spliced as literals, so a ``%`` in ``where``
        needs no escaping whatever the driver."""
        d = self.ROWS
        q = d.quote
        table = ".".join(f"{q}{part}{q}" for part in spec.table.split("."))
        if spec.columns is None:
            columns = f"{table}.*"
        else:
            names = (spec.key, *(c for c in spec.columns if c != spec.key))
            columns = ", ".join(f"{table}.{q}{name}{q}" for name in names)
        # No alias: ``where`` and ``order_by`` may name the table (``events.id``).
        sql = f"SELECT {columns} FROM {table}"
        conditions = [f"({spec.where})"] if spec.where else []
        if lease is not None:
            if not (re.fullmatch(r"[0-9a-f]*", lease) and re.fullmatch(r"[\w.]+", spec.table)):
                raise ValueError(f"not spliced into SQL: {lease!r}, {spec.table!r}")
            key = f"{table}.{q}{spec.key}{q}"
            name = d.LEASE_NAME.format(prefix=f"'{spec.table}:'", key=key)
            live = (
                f"SELECT 1 FROM {self.lease_table()} AS latchkey_lease "
                f"WHERE latchkey_lease.name = {name} AND {d.LIVE}"
            )
            if lease:
                conditions.append(f"EXISTS ({live} AND latchkey_lease.owner = '{lease}')")
            else:
                conditions.append(f"NOT EXISTS ({live})")
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        if spec.order_by:
            sql += f" ORDER BY {spec.order_by}"
        sql += f" LIMIT {int(limit)}"
        return f"{sql} {lock}" if lock else sql

    def has_skip_locked(self) -> Steps[bool]:
        """Whether the server has SKIP LOCKED: MySQL/MariaDB are asked their version once."""
        if self.ROWS is not MYSQL:
            return bool(self.ROWS.LOCKING)
        known: bool | None = getattr(self, "_skip_locked", None)
        if known is None:
            rows, _ = yield Query("SELECT VERSION()")
            version = str(rows[0][0])
            known = skip_locked_supported(version)
            self._skip_locked, self._server_version = known, version
        return known

    def check_skip_locked(self) -> Steps[None]:
        """Refuse a take on a MySQL/MariaDB server without SKIP LOCKED, naming its version."""
        if self.ROWS is MYSQL and not (yield from self.has_skip_locked()):
            raise Unsupported(
                f"{self.scheme} store: take needs SELECT … FOR UPDATE SKIP LOCKED, which this "
                f"server ({self._server_version}) lacks (MySQL ≥ 8.0.1, MariaDB ≥ 10.6); "
                "rows.lease works here"
            )

    # -- take: on a pinned connection ------------------------------------------------------

    def rows_take(self, spec: RowSpec, limit: int) -> Steps[list[dict[str, Any]]]:
        """Start the take's transaction and lock the due rows (run on a pinned connection;
        the transaction stays open: :meth:`rows_end` ends it)."""
        yield from self.check_skip_locked()
        try:
            yield self.rows_begin()
        except Exception as exc:
            if not self.write_lock_busy(exc):
                raise
            # SQLite: other takes kept the one write lock for the whole busy timeout — every
            # due row is in their transactions, as SKIP LOCKED would find them: an empty batch
            # (the caller's wait asks again). A deferred BEGIN holds nothing; its COMMIT ends it.
            yield Query("BEGIN")
            return []
        select = self.rows_select(spec, limit, self.ROWS.LOCKING, None)
        columns, rows = yield Statement(select)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def rows_begin(self) -> Any:
        """The request that begins a take's or a complete's transaction."""
        return Query(self.ROWS.BEGIN)

    def write_lock_busy(self, exc: BaseException) -> bool:
        """Whether ``exc``, from a take's BEGIN, says another writer holds the database
        (SQLite only; a server database locks rows, not the database)."""
        return False

    def rows_end(self, commit: bool) -> Steps[None]:
        """COMMIT or ROLLBACK the take's transaction."""
        yield Query("COMMIT" if commit else "ROLLBACK")

    def rows_execute(self, sql: str, params: Any) -> Steps[list[tuple[Any, ...]]]:
        """The application's statement; the rows it produced (none: [])."""
        _, rows = yield Statement(sql, params)
        return [tuple(row) for row in rows]

    # -- lease -------------------------------------------------------------------------------

    def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[list[tuple[dict[str, Any], Grant]]]:
        """Lease up to ``limit`` due rows with no live lease: on SQLite in one write
        transaction (which serialises lessees; PostgreSQL overrides this with one statement
        that locks its candidates); on MySQL/MariaDB by reads and a claim in autocommit.

        Why not the locked path on MySQL/MariaDB, which has SKIP LOCKED too: at 100 lessees
        on MariaDB 10.11 it ran 2.6-4.8x slower than the reads (lease10 167-300 rows/s
        against 803-824, deadlocks between the lessees' lease-table inserts and the locking
        reads' next-key locks retried by the hundred; docs/benchmarks.md), where on
        PostgreSQL it was faster than the reads."""
        if self.ROWS is MYSQL:
            return (yield from self.rows_lease_read(spec, owner, owner_info, ttl, limit))
        return (yield from self.rows_lease_locked(spec, owner, owner_info, ttl, limit))

    def rows_lease_locked(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[list[tuple[dict[str, Any], Grant]]]:
        """BEGIN (SQLite: IMMEDIATE, the database's write lock); the due rows with no live
        lease, with the dialect's locking clause; claim their names (fenced, as any claim);
        COMMIT. Written for any dialect with ``FOR UPDATE SKIP LOCKED`` (a concurrent
        lessee's candidates, locked in its own transaction, are not ours; a row finished by
        another worker is skipped until its commit, and no longer due after it), and used by
        SQLite, whose write transaction serialises lessees.

        Where the read runs on a snapshot older than the claim (READ COMMITTED: a lessee that
        committed after our read's snapshot but before we reached its rows left them
        unlocked and, to us, unleased), claims fail: we read again in the same transaction
        (a fresh snapshot, which sees those leases; the rows we hold come back first and are
        dropped), up to ``LEASE_ROUNDS`` times, until the batch is full or nothing new is
        due."""
        d = self.ROWS
        yield from self.lease_table_ready()
        try:
            yield Query(d.BEGIN)
        except Exception as exc:
            if not self.write_lock_busy(exc):
                raise
            return []  # SQLite: other writers kept the database for the whole busy timeout
        prefix = f"{spec.table}:"
        leased: list[tuple[dict[str, Any], Grant]] = []
        seen: set[str] = set()
        try:
            for _ in range(LEASE_ROUNDS):
                want = limit - len(leased)
                select = self.rows_select(spec, want + len(seen), d.LOCKING, "")
                columns, rows = yield Statement(select)
                fresh: dict[str, dict[str, Any]] = {}
                for row in (dict(zip(columns, r, strict=True)) for r in rows):
                    name = f"{prefix}{row[spec.key]}"
                    if name not in seen and len(fresh) < want:
                        fresh[name] = row
                if not fresh:
                    break
                seen.update(fresh)
                grants = yield from self.claim_open(list(fresh), owner, owner_info, ttl)
                leased += [(row, grants[name]) for name, row in fresh.items() if name in grants]
                if len(grants) == len(fresh):  # no claim lost: all there was, or a full batch
                    break
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to raise
                yield Query("ROLLBACK")
            raise
        yield Query("COMMIT")
        return leased

    def claim_open(
        self, names: list[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        """The dialect's batch claim, inside the transaction the caller opened."""
        return (yield from self.claim(names, owner, owner_info, ttl))  # type: ignore[attr-defined,no-any-return]

    def lease_table_ready(self) -> Steps[None]:
        """Once per store: touch the lease table outside any transaction, so that a store
        that creates it on first use (PostgreSQL) does so before a lease's transaction
        names it."""
        if not getattr(self, "_lease_table_ready", False):
            yield Query(f"SELECT 1 FROM {self.lease_table()} WHERE 1 = 0")
            self._lease_table_ready = True

    def rows_lease_read(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[list[tuple[dict[str, Any], Grant]]]:
        """Without SKIP LOCKED: read the due rows with no live lease, claim their names
        (the dialect's batch claim: one atomic transaction, fenced), read the rows we now
        hold again and give back those no longer due (finished by another worker between
        the two reads). Autocommit statements: each sees what others committed before it."""
        prefix = f"{spec.table}:"
        window = limit
        for _ in range(LEASE_ROUNDS):
            columns, rows = yield Statement(self.rows_select(spec, window, "", ""))
            if not rows:
                return []
            if len(rows) > limit:  # a later round: a random pick, away from the others
                rows = random.sample(rows, limit)
            candidates = [dict(zip(columns, row, strict=True)) for row in rows]
            names = list(dict.fromkeys(f"{prefix}{row[spec.key]}" for row in candidates))
            claim = self.claim(names, owner, owner_info, ttl)  # type: ignore[attr-defined]
            grants: dict[str, Grant] = yield from claim
            if grants:
                break
            # Others claimed every candidate between our read and our claim (they all read
            # the same first rows): read again — their leases now hide those rows — from a
            # window four times wider, taking a random pick of it, so that many workers
            # asking at once spread over the due rows instead of colliding again.
            window = min(window * 4, LEASE_WINDOW)
        else:
            return []
        columns, rows = yield Statement(self.rows_select(spec, len(grants), "", owner))
        due = {f"{prefix}{row[spec.key]}": row for row in
               (dict(zip(columns, r, strict=True)) for r in rows)}  # fmt: skip
        gone = [name for name in grants if name not in due]
        if gone:
            yield from self.release_many(gone, owner)  # type: ignore[attr-defined]
        return [(due[name], grants[name]) for name in names if name in grants and name in due]

    def rows_held(self, spec: RowSpec, owner: str) -> Steps[list[str]]:
        """The lease names of ``spec``'s rows whose lease rows name ``owner`` (live or not):
        what a lease batch whose answer was lost may have taken. A range of the lease
        table's primary key (``'<table>:'`` up to ``'<table>;'``, the next byte: names are
        compared as bytes on every dialect), the owner checked on each; only a failed
        lease asks, so no index on the owner is kept for it. Literals as in
        :meth:`rows_select` (the table an identifier, the owner hex)."""
        if not (re.fullmatch(r"[0-9a-f]+", owner) and re.fullmatch(r"[\w.]+", spec.table)):
            raise ValueError(f"not spliced into SQL: {owner!r}, {spec.table!r}")
        d = self.ROWS
        low = d.LEASE_NAME.format(prefix=f"'{spec.table}:'", key="''")
        high = d.LEASE_NAME.format(prefix=f"'{spec.table};'", key="''")
        _, rows = yield Statement(
            f"SELECT name FROM {self.lease_table()} WHERE name >= {low} AND name < {high} "
            f"AND owner = '{owner}'"
        )
        names = (bytes(row[0]).decode() if not isinstance(row[0], str) else row[0]
                 for row in rows)  # fmt: skip
        return list(dict.fromkeys(names))

    # -- complete: a leased row's work and its release, one transaction -------------------

    def rows_complete_begin(self) -> Steps[None]:
        """Open the transaction of a ``complete`` (on a pinned connection)."""
        yield self.rows_begin()

    def rows_complete_end(
        self, commit: bool, names: Sequence[str], owner: str, tokens: Sequence[int]
    ) -> Steps[bool]:
        """End a ``complete``: with ``commit``, delete the rows' leases if every one is still
        ours and live (owner and token: never another's), then COMMIT; if one was lost,
        ROLLBACK the whole transaction, the work included. True if committed."""
        if not commit:
            yield Query("ROLLBACK")
            return False
        try:
            ours = yield from self.release_fenced(names, owner, tokens)  # type: ignore[attr-defined]
        except BaseException:
            with contextlib.suppress(Exception):
                yield Query("ROLLBACK")
            raise
        if ours != len(names):
            yield Query("ROLLBACK")
            return False
        yield Query("COMMIT")
        yield from self.released(tuple(names))  # type: ignore[attr-defined]
        return True

    # -- waking the waiting takers and lessees -------------------------------------------------

    def rows_wake_sql(self, wake: str) -> str | None:
        """PostgreSQL: the statement that wakes the waiters subscribed to ``wake`` in every
        process, when the transaction that runs it commits (a NOTIFY on the store's channel,
        as a release sends), all literals: for the application's own transaction or trigger.
        None on the other stores (no server push)."""
        channel = getattr(self, "channel", None)
        if self.ROWS is not POSTGRESQL or channel is None:
            return None
        if not re.fullmatch(r"[\w.]+", channel):
            raise ValueError(f"not spliced into SQL: {channel!r}")
        return f"SELECT pg_notify('{channel}', '{wake.encode().hex()}')"

    def rows_notify(self, spec: RowSpec, wake: str) -> Steps[None]:
        """Wake the waiters of ``wake``: PostgreSQL, a NOTIFY (every process); SQLite, the
        doorbells of the waiters on this machine; MySQL has no push (the backend wakes the
        waiters of this process; the others find the rows by polling); MariaDB rings its
        bells (``mysql_bells.Bells.rows_notify``, which stands in front of this one)."""
        if self.rows_wake_sql(wake) is not None:  # the same NOTIFY, its values as parameters
            yield Query("SELECT pg_notify($1, $2)", (self.channel, wake.encode().hex()))  # type: ignore[attr-defined]
        elif self.ROWS is SQLITE:
            from latchkey.stores.io.doorbell import Ring

            yield Ring((wake,), True)

    # -- status (the CLI) ----------------------------------------------------------------------

    def rows_status(self, spec: RowSpec, limit: int) -> Steps[list[RowState]]:
        """Up to ``limit`` due rows with their lease (if live) and whether a take's
        transaction locks them now: found by locking what is free in a transaction rolled
        back at once (PostgreSQL, MySQL). SQLite cannot tell (None)."""
        d = self.ROWS
        key_only = RowSpec(spec.table, spec.key, spec.where, spec.order_by, (spec.key,))
        _, rows = yield Statement(self.rows_select(key_only, limit, "", None))
        keys = [row[0] for row in rows]
        if not keys:
            return []
        names = [f"{spec.table}:{key}".encode() for key in keys]
        marks = ", ".join([d.PARAM] * len(names))
        lease_sql = (
            "SELECT latchkey_lease.name, latchkey_lease.owner_info, latchkey_lease.token, "
            "latchkey_lease.acquired_at, latchkey_lease.expires_at "
            f"FROM {self.lease_table()} AS latchkey_lease "
            f"WHERE latchkey_lease.name IN ({marks}) AND {d.LIVE}"
        )
        _, leases = yield Statement(lease_sql, tuple(names))
        leased = {bytes(row[0]).decode(): row for row in leases}
        free: set[str] | None = None
        if d.LOCKING and (yield from self.has_skip_locked()):
            yield Query(d.BEGIN)
            try:
                select = self.rows_select(key_only, limit, d.LOCKING, None)
                _, lockable = yield Statement(select)
                free = {str(row[0]) for row in lockable}
            finally:
                yield Query("ROLLBACK")
        states = []
        for key in keys:
            lease = leased.get(f"{spec.table}:{key}")
            holder = None if lease is None else self.holder(lease)  # type: ignore[attr-defined]
            locked = None if free is None else str(key) not in free
            states.append(RowState(key, holder, locked))
        return states


def raise_not_committed(backend: Any) -> None:
    """A take's connection failed during the batch (the error was raised then, and caught):
    the transaction cannot commit; the server rolled it back when the connection ended."""
    raise StoreUnavailable(
        f"{backend.scheme} store at {backend.url.redacted()}: commit failed: the batch's "
        "connection failed earlier in the batch; nothing was committed"
    )


class Taken:
    """A take's open transaction on its pinned connection: the rows it locked, the
    application's statements, and its end (COMMIT or ROLLBACK, then the connection goes back
    to the pool, or is closed if its state is unknown)."""

    def __init__(self, pin: Pinned, store: RowClaims, rows: list[dict[str, Any]]) -> None:
        self.pin, self.store, self.rows = pin, store, rows

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        return self.pin.run(self.store.rows_execute(sql, params), "execute", user=True)

    def end(self, commit: bool) -> Steps[Any]:
        return self.store.rows_end(commit)

    def finish(self, commit: bool) -> Any:
        if self.pin.broken:  # the server ends the transaction with the connection
            self.pin.release(False)
            if commit:
                raise_not_committed(self.pin.driver.backend)
            return None
        ok = False
        try:
            result = self.pin.run(self.end(commit), "commit" if commit else "rollback")
            ok = True
        finally:
            self.pin.release(ok)
        return result


class Completing(Taken):
    """A ``complete``'s open transaction: the application's statements, then (``finish``)
    the rows' fenced release and COMMIT, or ROLLBACK; ``finish(True)`` answers whether it
    committed (False: a lease was lost, everything was rolled back)."""

    def __init__(self, pin: Pinned, store: RowClaims, names: Sequence[str], owner: str,
                 tokens: Sequence[int]) -> None:  # fmt: skip
        super().__init__(pin, store, [])
        self.names, self.owner, self.tokens = names, owner, tokens

    def end(self, commit: bool) -> Steps[Any]:
        return self.store.rows_complete_end(commit, self.names, self.owner, self.tokens)


class AsyncTaken:
    """:class:`Taken` for asyncio: the same steps, awaited."""

    def __init__(self, pin: AsyncPinned, store: RowClaims, rows: list[dict[str, Any]]) -> None:
        self.pin, self.store, self.rows = pin, store, rows

    async def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        return await self.pin.run(self.store.rows_execute(sql, params), "execute", user=True)

    def end(self, commit: bool) -> Steps[Any]:
        return self.store.rows_end(commit)

    async def finish(self, commit: bool) -> Any:
        if self.pin.broken:
            await self.pin.release(False)
            if commit:
                raise_not_committed(self.pin.driver.backend)
            return None
        ok = False
        try:
            result = await self.pin.run(self.end(commit), "commit" if commit else "rollback")
            ok = True
        finally:
            await self.pin.release(ok)
        return result


class AsyncCompleting(AsyncTaken):
    """:class:`Completing` for asyncio."""

    def __init__(self, pin: AsyncPinned, store: RowClaims, names: Sequence[str], owner: str,
                 tokens: Sequence[int]) -> None:  # fmt: skip
        super().__init__(pin, store, [])
        self.names, self.owner, self.tokens = names, owner, tokens

    def end(self, commit: bool) -> Steps[Any]:
        return self.store.rows_complete_end(commit, self.names, self.owner, self.tokens)
