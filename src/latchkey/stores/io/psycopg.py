"""PostgreSQL through psycopg 3, sync: connections, the libpq fast path, the LISTEN listener.

What the ``postgresql://`` store (:mod:`latchkey.stores.postgresql`) asks for, it asks as
requests; :class:`PsycopgDriver` answers them:

- ``Query(sql, params)`` (:mod:`latchkey.stores.sql`): one statement with ``$n`` placeholders
  through psycopg (``RawCursor``), answered ``(rows, rowcount)``;
- :class:`Prepared`: one hot statement through libpq directly (``psycopg.pq``, a public layer
  of psycopg): prepared once per connection, then one ``PQexecPrepared`` per call, parameters
  already encoded, the binary result as the answer (:meth:`Session.run_prepared`). psycopg's
  ``execute`` builds a cursor, adapts every parameter and looks the query up in its
  prepared-statement cache on each call: ~35 µs of CPU per uncontended acquire + release,
  more than the rest of latchkey;
- :class:`Listen`: a waiter woken by the store's notifications (:class:`Listener`: one
  ``LISTEN`` connection per backend, read by one daemon thread) — a :class:`HandoffWaiter`,
  handed a lease by a release that names its ticket.

Connections come from a :class:`~latchkey.stores.io.Pool` (checked without a round trip before
each reuse: an idle connection has nothing to read unless the server ended it), are never used
across ``fork()``, and a connection left in an unknown state by an error is closed. Every wait
on the network is bounded: opening a connection by the timeout as a whole, whatever the hosts
(:mod:`latchkey.stores.io.pgconnect`); a statement by the server (``statement_timeout``), by TCP
(keepalives, ``tcp_user_timeout``: see :func:`connection_params`) and, for a server that is
frozen or a network that swallows traffic, locally: a statement still running a second past the
timeout has its socket shut down by the watchdog (:mod:`latchkey.stores.io.watchdog`) and fails
as "no answer within …". A statement that finds the tables missing creates them (the store's
``create``) and runs again.

The ``postgresql+advisory://`` store's pinned sessions are in
:mod:`latchkey.stores.io.sessions_psycopg` (they share this module's connection parameters
and result helpers).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import re
import secrets
import select
import selectors
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import psycopg
from psycopg import sql

from latchkey._types import Busy, Grant
from latchkey._url import DriverOptions, Option, StoreURL, choice, known_to
from latchkey.errors import ConfigError, StoreUnavailable
from latchkey.stores.base import EventWaiter, Waiter, woken
from latchkey.stores.io import Driver, Pinned, Pool, Steps, after_fork, drive, psycopg_green
from latchkey.stores.io.pgconnect import connect_pgconn
from latchkey.stores.io.watchdog import WATCHDOG
from latchkey.stores.rows_sql import Statement
from latchkey.stores.sql import Query

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

log = logging.getLogger("latchkey")
T = TypeVar("T")

DRIVER_ERRORS: tuple[type[BaseException], ...] = (psycopg.Error, OSError)
TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
COMMAND_OK = psycopg.pq.ExecStatus.COMMAND_OK
SQLSTATE = psycopg.pq.DiagnosticField.SQLSTATE
IDLE = psycopg.pq.TransactionStatus.IDLE
#: What a statement raises when the store's tables (or schema) are not there yet, or a column
#: added since they were made (the waiters' ``rung_at``): the store's ``create()`` adds it.
MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedColumn,
)
#: How long past the server-side bound (statement_timeout = the store's timeout) a statement
#: may take before latchkey gives up on it locally (the watchdog; asyncio: bounded()).
MARGIN = 1.0
#: Where binary timestamptz values count microseconds from.
PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)


# -- the requests of the psycopg drivers ------------------------------------------------------


class Prepared(NamedTuple):
    """A hot statement through libpq: its prepared-statement name, its text (``$n``
    placeholders), the parameters already encoded (text, or binary where ``formats`` says 1).
    Answered with the binary :class:`psycopg.pq.abc.PGresult`."""

    name: bytes
    sql: bytes
    values: tuple[bytes, ...]
    formats: tuple[int, ...]


class Listen(NamedTuple):
    """A waiter for the notifications of ``key`` (a name's UTF-8 bytes in hex). With a
    ``ticket``, a release naming it hands the waiter ``owner``'s lease on ``name``, and the
    waiter's close runs the store's ``leave_queue``. Answered with the waiter; its
    ``listener_key`` is the key the listener's session holds."""

    key: str
    ticket: int | None
    name: str
    owner: str


# -- pure helpers, shared with the asyncio flavour -------------------------------------------


def positional(query: bytes) -> tuple[bytes, tuple[str, ...]]:
    """A psycopg-style query (``%(name)s`` placeholders) as a server-side one (``$1`` …) and
    the parameter names in ``$`` order; a name used twice is one parameter."""
    names: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    out = re.sub(rb"%\((\w+)\)s", number, query)
    if b"%" in out.replace(b"%%", b""):
        raise ValueError("only %(name)s placeholders and %% are supported")
    return out.replace(b"%%", b"%"), tuple(names)


def result_error(result: psycopg.pq.abc.PGresult) -> psycopg.Error:
    """The psycopg exception for a failed result, chosen by its SQLSTATE as psycopg does."""
    state = (result.error_field(SQLSTATE) or b"").decode("ascii", "replace")
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    try:
        cls: type[psycopg.Error] = psycopg.errors.lookup(state)
    except KeyError:
        cls = psycopg.OperationalError  # no SQLSTATE: libpq's own (the connection failed)
    return cls(message or "the statement failed")


def deallocated(result: psycopg.pq.abc.PGresult) -> bool:
    """Whether a prepared statement failed because it no longer exists (SQLSTATE 26000):
    psycopg sends DEALLOCATE ALL after a DROP or a ROLLBACK it ran on the connection."""
    return result.error_field(SQLSTATE) == b"26000"


def prepared_already(result: psycopg.pq.abc.PGresult) -> bool:
    """Whether a PREPARE failed because the name is prepared already (SQLSTATE 42P05): on a
    connection borrowed from the application's pool, another store of latchkey's prepared
    the same statement under the same name."""
    return result.error_field(SQLSTATE) == b"42P05"


def int8(value: bytes | None) -> int:
    """A binary bigint."""
    assert value is not None
    return int.from_bytes(value, "big", signed=True)


def timestamptz(value: bytes | None) -> datetime:
    """A binary timestamptz: microseconds since 2000-01-01 UTC."""
    return PG_EPOCH + timedelta(microseconds=int8(value))


def utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc)


def read_notice(payload: str) -> tuple[str, int | None, Grant | None] | None:
    """A notice's payload → (key, ticket, grant); None if malformed. ``key`` alone: every
    waiter of the key tries again; ``key:ticket``: that ticket's waiter was rung (it tries);
    ``key:ticket:token:expires_us``: a release handed that ticket's waiter the lease."""
    key, _, rest = payload.partition(":")
    if not rest:
        return key, None, None
    try:
        parts = [int(part) for part in rest.split(":")]
    except ValueError:
        return None
    if len(parts) == 1:
        return key, parts[0], None
    if len(parts) != 3:
        return None
    ticket, token, expires_us = parts
    expires = datetime.fromtimestamp(expires_us / 1e6, timezone.utc)
    return key, ticket, Grant(token=token, expires_at=expires)


def server_ended(pgconn: psycopg.pq.abc.PGconn) -> bool:
    """Whether the server ended this idle connection (terminated the session, shut down,
    restarted), found without a round trip: an idle connection has nothing to read unless it
    did. Call only when its socket is readable, or to be sure."""
    for _ in range(4):  # a goodbye message, then EOF, arrive as separate reads
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            return True
        if not input_waiting(pgconn.socket):
            return False
        with contextlib.suppress(*DRIVER_ERRORS):
            pgconn.consume_input()
    return bool(pgconn.status != psycopg.pq.ConnStatus.OK)


def input_waiting(fd: int) -> bool:
    """Whether ``fd`` has something to read (or hung up), without blocking."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # Windows: no poll()


def _text(value: str) -> str:
    return value


CONNECTION_OPTIONS: Mapping[str, Option] = {
    "sslmode": Option(
        choice("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
        None,
        "libpq sslmode",
    ),
    "sslrootcert": Option(_text, None, "CA certificate file (libpq sslrootcert)"),
    "sslcert": Option(_text, None, "client certificate file (libpq sslcert)"),
    "sslkey": Option(_text, None, "client key file (libpq sslkey)"),
}

#: libpq parameters that come from the URL's own parts (or that would make the connection
#: something else: a replication connection cannot run our statements). ``host`` and ``port``
#: may be in the query when the URL names no host (libpq's
#: ``postgresql:///db?host=/var/run/postgresql``, a Unix-socket directory).
_FROM_THE_URL = frozenset({"dbname", "user", "replication"})
_LIBPQ: list[frozenset[str]] = []


def _libpq_keywords() -> frozenset[str]:
    """Every connection parameter this libpq knows (``PQconndefaults``), but the URL's parts."""
    if not _LIBPQ:
        known = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
        _LIBPQ.append(frozenset(known - _FROM_THE_URL))
    return _LIBPQ[0]


#: Any other libpq parameter in the URL (``connect_timeout``, ``application_name``,
#: ``target_session_attrs``…) goes to libpq as given; ``options`` is added to ours.
LIBPQ = DriverOptions(
    known_to(_libpq_keywords),
    "any libpq connection parameter but dbname, user and replication (host and port when "
    "the URL names no host) "
    "(https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-PARAMKEYWORDS)",
)


def connection_params(
    url: StoreURL, config: Mapping[str, Any], application_name: str
) -> dict[str, Any]:
    """libpq parameters from the URL: timeouts and keepalives bound every wait on the network.

    ``connect_timeout`` is libpq's per-host bound; libpq leaves it to the application in the
    non-blocking connect latchkey drives (:mod:`~latchkey.stores.io.pgconnect`), which bounds
    the whole attempt by ``timeout`` and a host's share of it by ``connect_timeout`` when the
    URL gives a shorter one."""
    timeout: float = config["timeout"]
    params: dict[str, Any] = {
        "connect_timeout": max(1, math.ceil(timeout)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(timeout / 2)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": max(1, int(timeout * 1000)),
        "application_name": application_name,
        "options": f"-c statement_timeout={max(1, int(timeout * 1000))} -c TimeZone=UTC",
    }
    if url.hosts:
        params["host"] = ",".join(host for host, _ in url.hosts)
        if any(port for _, port in url.hosts):
            params["port"] = ",".join(str(port or 5432) for _, port in url.hosts)
    if url.username:
        params["user"] = url.username
    if url.password:
        params["password"] = url.password
    if url.path.strip("/"):
        params["dbname"] = url.path.strip("/")
    for key in CONNECTION_OPTIONS:
        if config.get(key):
            params[key] = config[key]
    driver = config.get("driver", {})
    given = [key for key in ("host", "port") if key in driver]
    if url.hosts and given:
        raise ConfigError(
            f"{url.scheme} URL: {' and '.join(given)} given twice, in the address and as "
            f"?{given[0]}= (use one: postgresql:///db?host=/var/run/postgresql for a Unix "
            "socket directory)"
        )
    for key, value in driver.items():  # the user's libpq parameters win
        params[key] = f"{params['options']} {value}" if key == "options" else value
    return params


# -- fork safety -------------------------------------------------------------------------------

# Connections left behind by a fork: the child must neither use nor close them (closing would
# end the parent's session), and keeping them referenced avoids "deleted while open" warnings
# when a pool in the child forgets them. Every connection opened here is in _OPEN; the parent
# holds them all in _AT_FORK across fork(), so that the child has them whatever order its
# fork hooks run in, and keeps them for ever in _FORKED_AWAY.
_FORKED_AWAY: list[object] = []
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_AT_FORK: list[object] = []


def _before_fork() -> None:
    with contextlib.suppress(RuntimeError):  # another thread opened one just now
        _AT_FORK[:] = list(_OPEN)


def _after_fork_in_child() -> None:
    _FORKED_AWAY.extend(_AT_FORK)
    _AT_FORK.clear()


os.register_at_fork(
    before=_before_fork, after_in_parent=_AT_FORK.clear, after_in_child=_after_fork_in_child
)


def connect(params: Mapping[str, Any], timeout: float) -> psycopg.Connection[Any]:
    """A new autocommit connection, opened within ``timeout`` seconds whatever the hosts
    (:func:`~latchkey.stores.io.pgconnect.connect_pgconn`), then wrapped by psycopg's
    documented constructor with psycopg's defaults (``prepare_threshold`` 5)."""
    conn = open_connection(params, timeout)
    _OPEN.add(conn)
    return conn


def open_connection(params: Mapping[str, Any], timeout: float) -> psycopg.Connection[Any]:
    """:func:`connect` without the fork bookkeeping (the session-lock driver keeps its own)."""
    conn = psycopg.Connection(connect_pgconn(params, timeout))
    conn.autocommit = True  # on a new, idle connection: no round trip
    return conn


# -- connections -------------------------------------------------------------------------------

_warned: list[bool] = []


def _warn_waits_in_c() -> None:
    """Once per process: psycopg's own waits block every green thread (eventlet)."""
    if not _warned:
        _warned.append(True)
        log.warning(
            "postgresql: green threads (eventlet) but psycopg waits in C: its connects and "
            "queries stop every green thread while they wait, and a frozen server hangs the "
            "process; set PSYCOPG_WAIT_FUNC=wait_select in the environment"
        )


class Session:
    """One autocommit connection guarded by a lock, reconnected lazily after failures/forks."""

    def __init__(self, params: Mapping[str, Any], timeout: float) -> None:
        self.params = params
        self.timeout = timeout  # opening a connection takes at most this long
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None
        self.generation = 0
        """Counts connections opened: a session-tied lock is valid only in its generation."""
        self.prepared: set[bytes] = set()
        """Names of the statements :meth:`run_prepared` prepared on :attr:`conn`."""
        self._poller: Any = None  # a poll() object on conn's socket, made once per connection
        self._pid = os.getpid()
        self.green = psycopg_green.patched()  # gevent/eventlet: statements wait on their hub
        if self.green and psycopg_green.psycopg_waits_in_c():
            _warn_waits_in_c()

    def run_prepared(
        self, name: bytes, query: bytes, params: Sequence[bytes],
        formats: Sequence[int] | None = None, binary: bool = False,
    ) -> psycopg.pq.abc.PGresult:  # fmt: skip
        """Run a hot statement through libpq directly (``psycopg.pq``): prepared once per
        connection under ``name`` (server-side ``$n`` placeholders), then one
        ``PQexecPrepared`` per call, parameters already encoded (text, or binary where
        ``formats`` says 1), results as text or, with ``binary``, binary. Call under
        :attr:`lock` with the connection open.

        libpq's call releases the GIL while it waits; like every statement of ours it is
        bounded by the server's ``statement_timeout`` and by the connection's TCP keepalives
        and ``tcp_user_timeout``, but Ctrl-C takes effect only when it returns, so only short
        statements go this way (never a wait for a lock). Raises psycopg's exception for the
        SQLSTATE, as ``execute`` would.
        """
        assert self.conn is not None
        pgconn = self.conn.pgconn
        for again in (True, False):
            if name not in self.prepared:
                if self.green:  # libpq's blocking calls would stop every greenlet meanwhile
                    prepared = psycopg_green.prepare(pgconn, name, query)
                else:
                    prepared = pgconn.prepare(name, query)
                if prepared.status != COMMAND_OK:
                    raise result_error(prepared)
                self.prepared.add(name)
            if self.green:
                result = psycopg_green.exec_prepared(pgconn, name, params, formats, int(binary))
            else:
                result = pgconn.exec_prepared(name, params, formats, 1 if binary else 0)
            status = result.status
            if status in (TUPLES_OK, COMMAND_OK):
                return result
            if not (again and deallocated(result)):
                break
            # Deallocated behind our back (psycopg sends DEALLOCATE ALL after a DROP or a
            # ROLLBACK it ran on this connection): prepare it again, once.
            self.prepared.discard(name)
        raise result_error(result)

    def open(self) -> psycopg.Connection[Any]:
        """A new autocommit connection (not the shared one), for listeners."""
        return connect(self.params, self.timeout)

    def connection(self) -> psycopg.Connection[Any]:
        """The shared connection, opened if needed; call with :attr:`lock` held."""
        if not self.alive():
            self.conn = self.open()
            self.generation += 1
            self.prepared = set()
            self._poller = None
            if hasattr(select, "poll"):  # (Windows: input_waiting's select() every time)
                self._poller = select.poll()
                self._poller.register(self.conn.pgconn.socket, select.POLLIN)
        assert self.conn is not None
        return self.conn

    def alive(self) -> bool:
        """Whether the shared connection is usable, without a round trip (call under lock).

        An idle connection has nothing to read unless the server ended it (terminated the
        session, shut down, restarted): such a connection is dropped here, so the next
        statement goes to a new session instead of failing on the dead one.
        """
        if self._pid != os.getpid():
            self.forget_after_fork()
        conn = self.conn
        if conn is None or conn.closed:
            return False
        if self._poller is not None and not self._poller.poll(0):
            return True  # nothing to read: the usual case, one syscall
        if server_ended(conn.pgconn):
            self.broken()
            return False
        return True

    def broken(self) -> bool:
        """After an error: drop the connection if it is no longer usable (call under lock)."""
        conn = self.conn
        if conn is not None and (
            conn.closed or conn.broken or conn.pgconn.status != psycopg.pq.ConnStatus.OK
        ):
            self.conn = None
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()
            return True
        return conn is None

    def forget_after_fork(self) -> None:
        self.lock = threading.Lock()
        if self.conn is not None:
            _FORKED_AWAY.append(self.conn)
        self.conn = None
        self.prepared = set()
        self._poller = None
        self._pid = os.getpid()

    def close(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(*DRIVER_ERRORS):
                conn.close()


class Link(Session):
    """One pooled connection of a :class:`PsycopgDriver`: a :class:`Session` whose lock is the
    pool's (a link is used by one caller at a time), answering the store's requests."""

    def __init__(self, driver: PsycopgDriver) -> None:
        super().__init__(driver.params, driver.timeout)
        self.driver = driver
        self.cut = False  # the watchdog shut its socket down: never to be used again
        #: (connection, the cursor of a take's statements on it, its encoding): kept_cursor.
        self.kept: tuple[Any, psycopg.Cursor[Any], str] | None = None

    def answer(self, request: Any) -> Any:
        """One request (see the module docstring), bounded by the watchdog; creates the tables
        if they are missing."""
        WATCHDOG.arm(self, self.driver.guard, self.fileno)
        try:
            return self._answer(request)
        except MISSING:  # first use
            drive(self.driver.store.create(), self._answer)
            return self._answer(request)
        finally:
            if WATCHDOG.disarm(self):
                self.cut = True

    def fileno(self) -> int:
        assert self.conn is not None
        return self.conn.pgconn.socket

    def _answer(self, request: Any) -> Any:
        if type(request) is Prepared:
            return self.run_prepared(request[0], request[1], request[2], request[3], True)
        if type(request) is Query:
            return self.execute(request[0], request[1])
        return self.driver.listen(request)

    def execute(self, query: str, params: Sequence[Any] | None) -> tuple[list[Any], int]:
        """One statement through psycopg, ``$n`` placeholders: (rows, rowcount)."""
        assert self.conn is not None
        cur = psycopg.RawCursor(self.conn)
        cur.execute(query, params, prepare=params is not None)  # None: a script, run as is
        # Whether it returned rows, read off the result's status: cur.description would
        # build a Column object per column on every call.
        result = cur.pgresult
        tuples = result is not None and result.status == TUPLES_OK
        return (cur.fetchall() if tuples else []), cur.rowcount

    def run_statement(self, cur: psycopg.Cursor[Any], sql: str, params: Any) -> None:
        """A take's or a lease's statement in the application's style, on ``cur``."""
        cur.execute(sql, params)

    def usable(self) -> bool:
        """After an error: whether the connection is idle and sound (else it is closed)."""
        conn = self.conn
        return not (
            self.cut
            or conn is None
            or conn.closed
            or conn.broken
            or conn.pgconn.status != psycopg.pq.ConnStatus.OK
            or conn.pgconn.transaction_status != IDLE
        )


# -- waiting -----------------------------------------------------------------------------------


#: Numbers the waiters of this process in the order they join a queue (``seq``).
queue_order = itertools.count()


def queued_ahead(waiters: Any, mine: Any) -> int:
    """How many of ``waiters`` (one name's, in this process) joined the server's queue before
    ``mine``: a release serves the oldest, so these all come first. 0 for a waiter that is
    not queued (a semaphore's: every waiter is woken), or that a release rang."""
    if mine.ticket is None or mine.rung:  # (rung: first in the server's line, whatever the
        return 0  # order its process's waiters were queued in)
    return sum(1 for w in waiters if w.ticket is not None and w.seq < mine.seq)


def wake(waiters: Sequence[Any], ticket: int | None, grant: Grant | None) -> int | None:
    """Wake the waiters a notice is for (:func:`read_notice`): every one of its key, or only
    the one holding ``ticket`` (handing it ``grant`` if any; every process hears every notice,
    so a ticket not here is another's). Returns the ticket of a hand-over to no waiter here:
    the caller's ``unclaimed`` gives that lease back if this process queued it and left."""
    if ticket is None:
        for waiter in waiters:
            waiter.event.set()
        return None
    for waiter in waiters:
        if waiter.ticket == ticket:
            if grant is None:  # rung: its turn to try
                waiter.rung = True
                waiter.event.set()
            else:
                waiter.deliver(grant)
            return None
    return None if grant is None else ticket


class HandoffWaiter(EventWaiter):
    """A queued mutex waiter: woken by its name's notifications, and handed the lease by a
    release that names its ticket (see :class:`Listener`)."""

    def __init__(
        self, listener: Listener, key: str, ticket: int | None,
        on_close: Callable[[HandoffWaiter], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(threading.Event())
        self.listener, self.key, self.ticket = listener, key, ticket
        self.seq = next(queue_order)  # the order waiters of this process joined the queue
        self.listener_key = 0
        self.grant: Grant | None = None
        self.handed_over = False  # the core took the grant a release handed us
        self.left_line = False  # an attempt of its owner took the name and left the queue
        self.rung = False  # a release rang it: it is first in the server's line
        self.acquired = False  # the wait ended with the lease ours (however it came)
        self._on_leave = on_close

    def deliver(self, grant: Grant) -> None:
        self.grant = grant
        self.event.set()

    def wait(self, timeout: float) -> bool:
        pending = self.grant is not None  # handed the lease already: no need to wait
        return woken(self.event, 0.0 if pending else timeout) or pending

    def take_grant(self) -> Grant | None:
        if self.grant is not None:
            self.handed_over = self.acquired = True
        return self.grant

    def finish(self, result: Grant | Busy) -> None:
        self.acquired = isinstance(result, Grant)

    @property
    def ahead(self) -> int:
        return self.listener.ahead(self)

    def unsubscribe(self) -> None:
        self.listener.unsubscribe(self)

    def close(self) -> None:
        self.unsubscribe()
        if self._on_leave is not None:
            self._on_leave(self)


class Listener:
    """One ``LISTEN`` connection per backend, shared by the waiters of every name.

    A daemon thread reads notifications and wakes the waiters of their key (the payload up to
    the first ``:``). A payload ``key:ticket:token:expires_us`` hands a lease to the waiter
    holding that ticket, and wakes only it. The connection also holds a session advisory lock
    on a random 64-bit *listener key* for its whole life: releases hand leases only to queued
    owners whose key is held, so a dead process (its connection closed) is never handed one.
    If the connection is lost, every waiter is woken once (so it retries and sees the store's
    state) and later waits poll; the next subscribe reconnects with a new key.
    """

    def __init__(
        self, connect: Callable[[], psycopg.Connection[Any]], channel: str,
        unclaimed: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self._connect = connect
        self._channel = channel
        self._unclaimed = unclaimed
        self._lock = threading.Lock()
        self._waiters: dict[str, set[HandoffWaiter]] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._stop_fd = -1
        self.listener_key = 0
        self.connections = 0  # how many LISTEN connections were opened (tests count them)
        after_fork(self)

    def subscribe(self, key: str) -> Waiter:
        """A waiter for ``key``; the connection is listening before this returns."""
        return self.queue(key, None)

    def queue(
        self, key: str, ticket: int | None,
        on_close: Callable[[HandoffWaiter], None] | None = None,
    ) -> HandoffWaiter:  # fmt: skip
        """A waiter for ``key`` that a release naming ``ticket`` hands its lease to, with the
        listener key to queue it with; listening before this returns."""
        waiter = HandoffWaiter(self, key, ticket, on_close)
        with self._lock:
            if self._conn is None:
                self._start()
            self._waiters.setdefault(key, set()).add(waiter)
            waiter.listener_key = self.listener_key
            return waiter

    def ahead(self, waiter: HandoffWaiter) -> int:
        """See :func:`queued_ahead`."""
        with self._lock:
            return queued_ahead(self._waiters.get(waiter.key, ()), waiter)

    def unsubscribe(self, waiter: HandoffWaiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.key]

    def _start(self) -> None:
        conn = self._connect()
        listener_key = secrets.randbits(64) - (1 << 63)
        try:
            conn.execute("SELECT pg_advisory_lock(%s)", (listener_key,))
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except BaseException:
            conn.close()
            raise
        stop_r, stop_w = os.pipe()
        self._conn, self._stop_fd, self.listener_key = conn, stop_w, listener_key
        self.connections += 1
        thread = threading.Thread(
            target=self._run, args=(conn, stop_r, stop_w), name="latchkey-pg-listen", daemon=True
        )
        self._thread = thread
        thread.start()

    def _run(self, conn: psycopg.Connection[Any], stop_r: int, stop_w: int) -> None:
        pid = os.getpid()
        selector = selectors.DefaultSelector()
        try:
            selector.register(conn.fileno(), selectors.EVENT_READ)
            selector.register(stop_r, selectors.EVENT_READ)
            while True:
                if any(key.fd == stop_r for key, _ in selector.select()):
                    break
                conn.pgconn.consume_input()
                while (note := conn.pgconn.notifies()) is not None:
                    self._wake(note.extra.decode("ascii", "replace"))
        except (psycopg.Error, OSError, ValueError):
            pass  # connection lost: wake everyone below; later waits poll
        finally:
            selector.close()
            if os.getpid() == pid:
                with self._lock:
                    if self._conn is conn:
                        self._conn = None
                    everyone = [w for waiters in self._waiters.values() for w in waiters]
                for waiter in everyone:
                    waiter.event.set()
                conn.close()
                os.close(stop_r)
                os.close(stop_w)

    def _wake(self, payload: str) -> None:
        notice = read_notice(payload)
        if notice is None:
            return
        key, ticket, grant = notice
        with self._lock:
            waiters = list(self._waiters.get(key, ()))
        woken = wake(waiters, ticket, grant)
        if woken is not None and self._unclaimed is not None:
            self._unclaimed(woken)

    def close(self) -> None:
        """Stop the thread and wait (a second at most) until it has closed its connection, so
        that the server ends the listener's session, and frees its key, soon after."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(OSError):
                    os.write(self._stop_fd, b"x")
        thread = getattr(self, "_thread", None)
        if conn is not None and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def forget_after_fork(self) -> None:
        """In a forked child: the thread is gone and the connection is the parent's."""
        self._lock = threading.Lock()
        self._conn = None
        self._waiters = {}


# -- the driver --------------------------------------------------------------------------------


class PsycopgDriver(Driver):
    """The sync driver of the ``postgresql://`` store: a pool of :class:`Link` and one
    :class:`Listener`. The store provides ``channel`` (the NOTIFY channel), ``create()`` and
    ``leave_queue()`` / ``unclaimed()`` (see :mod:`latchkey.stores.postgresql`)."""

    errors = DRIVER_ERRORS

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        #: The local bound of one statement: past the server's statement_timeout, so that the
        #: server's own error comes first whenever the server is running at all.
        self.guard = self.timeout + MARGIN
        self.params = connection_params(backend.url, backend.config, "latchkey")
        self.pool: Pool[Link] = Pool(self._open, _close, alive=Link.alive)
        if backend.client is not None:  # the application's pool or connection, borrowed
            from latchkey.stores.io.psycopg_borrowed import BorrowedLinks, listener_params

            self.pool = BorrowedLinks(self, backend.client)  # type: ignore[assignment]
            own = {k: v for k, v in self.params.items() if k not in _FROM_THE_URL | {"password"}}
            theirs = listener_params(backend.client)  # the client's own win, but for options:
            if "options" in theirs:  # ours after theirs (statement_timeout, TimeZone)
                theirs["options"] = f"{theirs['options']} {own['options']}"
            self.params = {**own, **theirs}
        self.listener = Listener(
            lambda: connect(self.params, self.timeout), store.channel, self._unclaimed
        )

    def _open(self) -> Link:
        link = Link(self)
        link.connection()
        return link

    def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers on a Link
        raise NotImplementedError

    def run(self, steps: Steps[T], action: str) -> T:
        pool = self.pool
        try:
            link = pool.get(self.timeout)
            try:
                result = drive(steps, link.answer)
            except Exception:
                (pool.put if link.usable() else pool.discard)(link)
                if link.cut:
                    raise TimeoutError(f"no answer within {self.guard:g}s") from None
                raise
            except BaseException:  # interrupted mid-call: the protocol state is unknown
                pool.discard(link)
                raise
            (pool.discard if link.cut else pool.put)(link)
            return result
        except StoreUnavailable:
            raise
        except self.errors as exc:
            self.backend.unavailable(exc, action)

    def listen(self, request: Listen) -> HandoffWaiter:
        key, ticket, name, owner = request
        if ticket is None:
            return self.listener.queue(key, None)
        return self.listener.queue(key, ticket, lambda w: self._leave(name, owner, w))

    def _leave(self, name: str, owner: str, waiter: HandoffWaiter) -> None:
        try:
            self.run(self.store.leave_queue(name, owner, waiter), f"leave the queue for {name!r}")
        except StoreUnavailable as exc:
            log.info("%s", exc)  # the wait's outcome stands; an outage is the caller's to see

    def _unclaimed(self, ticket: int) -> None:
        with contextlib.suppress(StoreUnavailable):
            self.run(self.store.unclaimed(ticket), "release")

    def close(self) -> None:
        self.listener.close()
        self.pool.close()

    def pin(self) -> Pinned:
        """A pooled connection held for a take (see :func:`pin_link`)."""
        return pin_link(self)


def _close(link: Link) -> None:
    link.close()


# -- a connection held for a rows.take ---------------------------------------------------------


def pin_link(driver: PsycopgDriver) -> Pinned:
    """One pooled :class:`Link` held across calls (a take's transaction): it answers
    ``Statement`` requests through a plain psycopg cursor (``%s`` placeholders, the
    application's style), and the rest as the link does. Given back to the pool only if idle
    and sound."""
    pool = driver.pool
    with driver.backend.translate("connect", driver.errors):
        link = pool.get(driver.timeout)

    def answer(request: Any) -> Any:
        if type(request) is not Statement:
            return link.answer(request)
        try:
            return statement(link, request)
        except MISSING:  # the lease table, on first use (never inside a take's transaction)
            assert link.conn is not None
            if link.conn.pgconn.transaction_status != IDLE:
                raise
            drive(driver.store.create(), link._answer)
            return statement(link, request)

    def give_back(link: Link, reuse: bool) -> None:
        (pool.put if reuse and link.usable() else pool.discard)(link)

    return Pinned(driver, link, answer, give_back, user_error)


def statement(link: Link, request: Statement) -> tuple[list[str] | None, list[Any]]:
    """One statement of a take on its held link, bounded by the watchdog like every other."""
    assert link.conn is not None
    WATCHDOG.arm(link, link.driver.guard, link.fileno)
    try:
        cur, encoding = kept_cursor(link)
        link.run_statement(cur, request.sql, request.params)  # params None: sent as is
        columns = result_columns(cur, encoding)
        return (None, []) if columns is None else (columns, cur.fetchall())
    except BaseException:
        if WATCHDOG.disarm(link):
            link.cut = True
            raise TimeoutError(f"no answer within {link.driver.guard:g}s") from None
        raise
    finally:
        if WATCHDOG.disarm(link):
            link.cut = True


def kept_cursor(link: Any) -> tuple[Any, str]:
    """The cursor of a take's statements on ``link`` (a Link or an AsyncLink) and its
    connection's encoding: one per connection, kept (a new cursor per statement cost a take a
    tenth of its CPU)."""
    conn = link.conn
    assert conn is not None
    kept = link.kept
    if kept is None or kept[0] is not conn:
        kept = link.kept = (conn, conn.cursor(), conn.info.encoding)
    return kept[1], kept[2]


def result_columns(cur: Any, encoding: str) -> list[str] | None:
    """The column names of a statement's rows, or None if it returned none, read off libpq's
    result: ``cur.description`` builds a Column object per column, a tenth of a take's CPU."""
    result = cur.pgresult
    if result is None or result.status != TUPLES_OK:
        return None
    return [(result.fname(i) or b"").decode(encoding) for i in range(result.nfields)]


def user_error(exc: BaseException) -> bool:
    """An application statement's own error (bad SQL, a constraint, a deadlock it lost), not
    the server or the network failing."""
    if isinstance(exc, psycopg.errors.DeadlockDetected):
        return True
    return isinstance(exc, psycopg.Error) and not isinstance(
        exc, psycopg.OperationalError | psycopg.InterfaceError
    )
