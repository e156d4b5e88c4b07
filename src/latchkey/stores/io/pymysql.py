"""MySQL and MariaDB through PyMySQL: the sync driver of ``mysql://`` (and the helpers the
GET_LOCK store shares: :func:`connect`, :func:`server_hung_up`, :func:`socket_of`).

Connections come from the shared :class:`~latchkey.stores.io.Pool` (at most ``POOL_SIZE``,
reused last-in first-out, never across ``fork()``), each with its one cursor. A new connection
runs the store's ``setup()`` statements first (session settings, tables, MariaDB's prepared
statements), so a primitive starts only once it holds a connection. A request is a
:class:`~latchkey.stores.sql.Query`, answered with the last result set's rows and the last
statement's row count. A server error :mod:`~latchkey.stores.io.mysql_session` maps in
``REFUSED`` is raised into the store's primitive as that ``Refused`` subclass (the statement
was rolled back, the connection is kept; the store decides what it means); any other error
closes the connection and becomes StoreUnavailable.

One deadline per call: a call ends within the store's timeout, however many round trips it
takes — opening its connection (TCP, handshake, the store's setup statements) and the
primitive after it, or a multi-statement query whose result sets come back one after
another. Before each statement and each further result set, the socket's timeout is set to
the time the call has left (``settimeout`` on our own socket: PyMySQL has no public way to
change a connection's read and write timeouts after connecting; it sets its socket's timeout
only when those differ from the one it set last, and both are the store's timeout here, so
it never undoes ours), or ``Overdue`` (an OSError) once the deadline has passed; a connection
that timed out is discarded, never reused. The handshake runs inside PyMySQL's
``connect()``, several round trips that cannot be bounded one by one: the watchdog
(:mod:`latchkey.stores.io.watchdog`) shuts its socket down at the deadline. Cost: a call
that ends within ``SLACK`` of starting makes no system call for this (one ``time.monotonic()``
a statement); a longer one, a ``settimeout`` per read and one to set the whole timeout back
at the next call. The turn for a pooled connection is not bounded (it waits behind this
process's other calls, each of them bounded), as the wait for the one connection guarded by a
lock was before: the deadline starts when the call has its connection, or begins to open one.
Over a borrowed client the client's own socket timeouts apply
(:mod:`~latchkey.stores.io.pymysql_borrowed`). A URL with several hosts: a new
connection goes to the first that takes writes (:class:`~latchkey.stores.io.mysql_dsn.Hosts`,
:func:`reach`), and a write refused as read-only drops the pool's other connections. Over the
application's own connection or engine (``connect(client=…)``) the pool is a
:class:`~latchkey.stores.io.pymysql_borrowed.BorrowedPool` (that module says how it borrows).

Idle connections the server ended (a restart, ``wait_timeout``, ``KILL``): PyMySQL has no
public way to reach its socket, so :func:`connect` opens the socket itself and hands it to
PyMySQL's public ``connect(sock)`` (``defer_connect=True``); the socket is then ours to
``poll()``. An idle MySQL connection has nothing to read, so input or a hang-up on it means
the server has closed it. One ``poll(0)``, on an object made per connection, before every
reuse: ~1 µs on this machine, against ~110 µs for a ``ping(reconnect=False)`` round trip
(MariaDB 10.11 on loopback, median of 5 runs of 2,000). Measured whole with
``bench/headtohead.py OLD/src NEW/src --stores mysql`` (uncontended acquire + release against
the tree before this layout), six runs on a machine at load 6-11 gave medians 0.81-1.25
(middle ~0.94), and the old tree against itself 0.95: the machine's noise, not the store,
sets those figures. Steadier ones: the client CPU per pair is the same (median new/old 1.03
over 12 pairs of slices) and the library's Python per pair is 357 calls against 333.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import pymysql
from pymysql.constants import CLIENT

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Driver, Pinned, Pool, Steps, drive
from latchkey.stores.io.mysql_bell import Bell
from latchkey.stores.io.mysql_dsn import (
    WRITABLE,
    Hosts,
    address_text,
    hosts_of,
    read_only,
    reason,
    tls_context,
)
from latchkey.stores.io.mysql_session import (
    READ_ONLY,
    REFUSED,
    SESSION_ENDING,
    Overdue,
    Refused,
)
from latchkey.stores.io.watchdog import WATCHDOG
from latchkey.stores.rows_sql import Statement

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")

#: Every error a PyMySQL call can raise.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (pymysql.err.MySQLError, OSError)
#: Connections one backend opens at most; more concurrent calls queue for one.
POOL_SIZE = 8
#: How far (seconds) the socket's timeout may be off the time a call has left before it is
#: set again: a call that ends within it pays no ``settimeout``; its bound is off by as much.
SLACK = 0.01

_SOCKETS: weakref.WeakKeyDictionary[Any, socket.socket] = weakref.WeakKeyDictionary()


# -- TLS ----------------------------------------------------------------------------------
# PyMySQL wraps the socket it was given in an ``SSLSocket`` when a connection goes over TLS,
# and the socket latchkey opened (the one it polls, times out and shuts down) is detached from
# its descriptor. So latchkey hands PyMySQL contexts of its own (``ssl=``, public), whose
# ``wrap_socket`` notes what it made (``_WRAPPED``): the connection's socket is then that one.


class _Noting(ssl.SSLContext):
    """An SSL context that notes the socket it made of each socket it wrapped."""

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped = super().wrap_socket(sock, *args, **kwargs)
        _WRAPPED[sock] = wrapped
        return wrapped


_WRAPPED: weakref.WeakKeyDictionary[socket.socket, ssl.SSLSocket] = weakref.WeakKeyDictionary()

#: Without ``ssl_*`` options PyMySQL's TLS is "preferred": TLS when the server offers it, the
#: certificate not checked, plain otherwise. Its context is made anew for every connection
#: (``ssl.create_default_context()``, which loads the system's CA bundle: 30-50 ms a
#: connection here, 20-100 times the rest of a loopback connect, for certificates
#: nobody checks). latchkey's is one per process, with the same settings and no CA loaded.
#: Passed as ``ssl=`` it makes TLS required: a server that offers none is refused before
#: anything is sent (error 2026), remembered in ``_NO_TLS`` and reached with
#: ``ssl_disabled``, as the preferred mode falls back — from then on at once, in this process.
_PREFERRED: list[ssl.SSLContext] = []
_NO_TLS: set[tuple[str, int]] = set()
#: PyMySQL's "SSL is required but the server doesn't support it" (CR_SSL_CONNECTION_ERROR).
_SERVER_HAS_NO_TLS = 2026


def _preferred() -> ssl.SSLContext:
    if not _PREFERRED:
        context = _Noting(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        _PREFERRED.append(context)
    return _PREFERRED[0]


def _tls(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """PyMySQL's arguments without its ``ssl_*`` options, and the TLS ones latchkey passes
    instead: one of its own contexts, or ``ssl_disabled``."""
    plain = {k: v for k, v in args.items() if not k.startswith("ssl_")}
    options = {k: v for k, v in args.items() if k.startswith("ssl_")}
    if options.get("ssl_disabled"):
        return plain, {"ssl_disabled": True}
    required = tls_context(options, _Noting)  # the URL asks for TLS: required, as PyMySQL's
    if required is not None:
        return plain, {"ssl": required}
    if (args["host"], args["port"]) in _NO_TLS:
        return plain, {"ssl_disabled": True}
    return plain, {"ssl": _preferred()}


def connect(args: dict[str, Any], deadline: float | None = None, **more: Any) -> Any:
    """``pymysql.connect(**args, **more)`` on a socket we opened (see the module docstring):
    :func:`server_hung_up` and :func:`socket_of` then work on it without a round trip.
    ``deadline`` (monotonic): the TCP connect and the whole handshake end by then, however
    many round trips the handshake takes (PyMySQL runs it in one call, each read bounded by
    its read timeout: the watchdog shuts the socket down at the deadline instead). TLS as
    PyMySQL reads the URL's ``ssl_*`` options, through latchkey's contexts (above)."""
    plain, tls = _tls(args)
    try:
        return _connect(plain, deadline, {**tls, **more})
    except pymysql.err.OperationalError as exc:
        if tls.get("ssl") not in _PREFERRED or not exc.args or exc.args[0] != _SERVER_HAS_NO_TLS:
            raise
    _NO_TLS.add((args["host"], args["port"]))  # offers no TLS: plain, as preferred falls back
    return _connect(plain, deadline, {"ssl_disabled": True, **more})


def _connect(args: dict[str, Any], deadline: float | None, more: dict[str, Any]) -> Any:
    conn = pymysql.connect(**args, **more, defer_connect=True)
    wait = args["connect_timeout"]
    if deadline is not None:
        wait = min(wait, deadline - time.monotonic())
    try:
        if wait <= 0:
            raise TimeoutError("timed out")
        sock = socket.create_connection((args["host"], args["port"]), wait)
    except OSError as exc:  # as PyMySQL reports it when it opens the socket itself
        host = args["host"]
        raise pymysql.err.OperationalError(
            2003, f"Can't connect to MySQL server on {host!r} ({exc})"
        ) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if deadline is None:
        conn.connect(sock)  # closes the socket if the handshake fails
    else:
        # (TLS moves the descriptor to the wrapped socket, cut once made; the TLS handshake
        # itself, inside its making, is bounded by PyMySQL's read timeout, the store's)
        WATCHDOG.arm(sock, deadline - time.monotonic(), lambda: _WRAPPED.get(sock, sock).fileno())
        try:
            conn.connect(sock)
        except BaseException:
            if WATCHDOG.disarm(sock):
                raise TimeoutError(f"no answer within {args['read_timeout']:g}s") from None
            raise
        if WATCHDOG.disarm(sock):  # cut just as it answered: not to be used
            with contextlib.suppress(Exception):
                conn.close()
            raise TimeoutError(f"no answer within {args['read_timeout']:g}s")
    _SOCKETS[conn] = _WRAPPED.pop(sock, sock)
    return conn


def socket_of(conn: Any) -> socket.socket | None:
    """The socket of a connection :func:`connect` opened (None for another)."""
    return _SOCKETS.get(conn)


def server_hung_up(conn: Any) -> bool:
    """True if the server has closed (or written to) our idle connection: a restart, an idle
    timeout or a KILL. No round trip on a connection :func:`connect` opened (a ``select()``
    of its socket); a ``ping()`` on another."""
    if not conn.open:
        return True
    sock = _SOCKETS.get(conn)
    if sock is None:
        try:
            conn.ping(reconnect=False)
        except DRIVER_ERRORS:
            return True
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _unbounded() -> None:
    """No deadline of ours (a borrowed connection keeps the application's timeouts)."""


def drain(
    cur: Any, sql: str, params: Any, bound: Callable[[], None] = _unbounded
) -> tuple[list[Any], int]:
    """Execute ``sql`` and read every result; the last result set and row count. ``bound``
    runs before the statement and before each further result set (the call's deadline)."""
    bound()
    cur.execute(sql, params or None)
    rows: list[Any] = []
    count: int = cur.rowcount
    while True:
        if cur.description:
            rows = list(cur.fetchall())
        else:
            count = cur.rowcount
        bound()  # (a next result set is read only if there is one)
        if not cur.nextset():
            return rows, count


class Connection:
    """One pooled connection, its one cursor, its socket and the socket's poll object; and
    the deadline of the call it serves (see :meth:`begin`)."""

    __slots__ = ("conn", "cur", "current", "deadline", "fresh", "poll", "sock", "timeout")

    def __init__(self, conn: Any, timeout: float, deadline: float) -> None:
        self.conn = conn
        self.cur = conn.cursor()
        self.sock = _SOCKETS[conn]
        self.timeout = timeout
        self.current = timeout  # the socket's timeout now (PyMySQL's read = write timeout)
        self.deadline = deadline
        self.fresh = True  # opened for the call in progress: its deadline is that call's
        self.poll: Callable[[int], object]
        if hasattr(select, "poll"):  # a third of the cost of select() at every call
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            self.poll = poller.poll
        else:  # pragma: no cover - Windows
            self.poll = lambda _timeout: server_hung_up(conn)

    def alive(self) -> bool:
        """False if the server has closed (or written to) this idle connection."""
        return not self.poll(0)

    def begin(self) -> None:
        """A call starts on this connection: it ends within the store's timeout from now
        (a connection opened for it: from when the opening started)."""
        if self.fresh:
            self.fresh = False
        else:
            self.deadline = time.monotonic() + self.timeout

    def bound(self) -> None:
        """Before each read or write of the call: the socket's timeout is the time left
        (set only when the one in place would overrun the deadline by more than ``SLACK``,
        or is shorter than a new call needs: a call that ends quickly costs no system
        call); past the deadline, ``Overdue`` (an OSError: the connection is then discarded,
        as a result set may be left unread)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Overdue(f"no answer within {self.timeout:g}s")
        if not -SLACK <= self.current - left <= SLACK:
            self.sock.settimeout(left)
            self.current = left

    def drain(self, sql: str, params: Any) -> tuple[list[Any], int]:
        """:func:`drain`, each read bounded by the call's deadline."""
        return drain(self.cur, sql, params, self.bound)

    def answer(self, request: Any) -> Any:
        sql, params, _ = request
        try:
            return self.drain(sql, params)
        except pymysql.err.MySQLError as exc:
            refused = REFUSED.get(exc.args[0]) if exc.args else None
            if refused is None:
                raise
            raise refused(*exc.args) from exc

    def statement(self, request: Statement) -> tuple[list[str] | None, list[Any]]:
        """:func:`statement`, each read bounded by the call's deadline."""
        return statement(self.cur, request, self.bound)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class PyMySQLDriver(Driver):
    errors = (*DRIVER_ERRORS, Refused)
    #: MariaDB's wake-up for this process's waiters (None over a borrowed client: it polls).
    bell: Bell | None = None

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.hosts: Hosts | None = None  # several in the URL: where to look for the primary
        if backend.client is not None:  # the application's connection or engine
            from latchkey.stores.io.pymysql_borrowed import BorrowedPool

            self.pool: Pool[Connection] = BorrowedPool(self, backend.client)  # type: ignore[assignment]
            return
        self.pool = Pool(self._open, Connection.close, alive=Connection.alive, size=POOL_SIZE)
        if len(addresses := hosts_of(backend.url)) > 1:
            self.hosts = Hosts(addresses)
        self.bell = Bell(self, self._open)

    def _open(self) -> Connection:
        """A new connection for the call that asked for it: opening it (TCP, handshake,
        the store's setup) and then the call itself end within one timeout from now."""
        timeout = self.backend.timeout
        deadline = time.monotonic() + timeout
        if self.hosts is None:
            conn = connect(self.store.connect_args, deadline, client_flag=CLIENT.MULTI_STATEMENTS)
        else:
            conn = self._writable(self.hosts, deadline)
        try:
            pooled = Connection(conn, timeout, deadline)
            for sql, params, _ in self.store.setup(str(conn.get_server_info())):
                pooled.drain(sql, params)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        return pooled

    def _writable(self, hosts: Hosts, deadline: float) -> Any:
        """A connection to the first host, in ``hosts``' order, that takes writes; each host
        gets its share of what is left of the connect timeout, and of the call's ``deadline``
        (:func:`reach`)."""
        args = self.store.connect_args
        deadline = min(deadline, time.monotonic() + args["connect_timeout"])
        order = hosts.order()
        tried: list[str] = []  # host:port: why not, one each
        for step, index in enumerate(order):
            left = deadline - time.monotonic()
            if tried and left <= 0:
                break
            address = hosts.addresses[index]
            share = max(left, 0.001) / (len(order) - step)
            try:
                conn, why = reach(args, *address, share)
            except DRIVER_ERRORS as exc:
                tried.append(f"{address_text(address)}: {reason(exc)}")
                continue
            if why is None:
                hosts.found(index)
                return conn
            tried.append(f"{address_text(address)}: {why}")
        hosts.missed(order, len(tried))
        raise pymysql.err.OperationalError(2003, hosts.none_writable(tried))

    def answer(self, request: Any) -> Any:  # pragma: no cover - run() answers on its connection
        raise NotImplementedError

    def run(self, steps: Steps[T], action: str) -> T:
        """The primitive on one pooled connection, connected before the primitive starts (so
        it knows whether the server prepared its statements)."""
        pool = self.pool
        try:
            pooled = pool.get()
            try:
                pooled.begin()
                result = drive(steps, pooled.answer)
            except Refused:  # rolled back: the connection is fine
                pool.put(pooled)
                raise
            except BaseException:
                pool.discard(pooled)
                raise
            pool.put(pooled)
            return result
        except StoreUnavailable:
            raise
        except self.errors as exc:
            if self.hosts is not None and exc.args and exc.args[0] in READ_ONLY:
                pool.close()  # the others to the demoted primary: new ones find the writable
            self.backend.unavailable(exc, action)

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
        self.pool.close()

    def pin(self) -> Pinned:
        """One pooled connection held across calls (a take's transaction): ``Statement``
        requests run on its cursor (``%s``, the application's style); given back if sound."""
        pool = self.pool
        with self.backend.translate("connect", self.errors):
            pooled = pool.get()
            if hasattr(pooled, "hold"):  # borrowed: latchkey's settings for the transaction
                try:
                    pooled.hold()
                except BaseException:
                    pool.discard(pooled)
                    raise

        def answer(request: Any) -> Any:
            if type(request) is Statement:
                return pooled.statement(request)
            return pooled.answer(request)

        def give_back(pooled: Connection, reuse: bool) -> None:
            (pool.put if reuse else pool.discard)(pooled)

        return Pinned(self, pooled, answer, give_back, user_error, pooled.begin)


def reach(args: dict[str, Any], host: str, port: int, seconds: float) -> tuple[Any, str | None]:
    """A connection to ``host`` (:func:`connect`) and why it takes no writes (None: it does;
    closed then). Connecting, the handshake and the check each wait at most ``seconds``, so a
    host that accepts and never answers leaves the others their time; a connection kept then
    gets the store's timeout on its socket. (PyMySQL sets its socket's timeout only when its
    read and write timeouts differ from the one it set last — both are ``seconds`` here — so
    it never undoes that one: as for a wait in :mod:`latchkey.stores.io.sessions_pymysql`.)"""
    brief = {**args, "host": host, "port": port, "connect_timeout": seconds,
             "read_timeout": seconds, "write_timeout": seconds}  # fmt: skip
    deadline = time.monotonic() + seconds
    conn = connect(brief, deadline, client_flag=CLIENT.MULTI_STATEMENTS)
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {seconds:g}s")
        _SOCKETS[conn].settimeout(left)
        with conn.cursor() as cur:
            cur.execute(WRITABLE)
            why = read_only(cur.fetchone())
        if why is None:
            _SOCKETS[conn].settimeout(args["read_timeout"])  # (= its write timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.close()
        raise
    if why is not None:
        with contextlib.suppress(Exception):
            conn.close()
    return conn, why


def statement(
    cur: Any, request: Statement, bound: Callable[[], None] = _unbounded
) -> tuple[list[str] | None, list[Any]]:
    """The application's statement (``params`` None: sent as is): its columns and rows.
    ``bound``: as for :func:`drain`."""
    bound()
    cur.execute(request.sql, request.params)
    columns = [column[0] for column in cur.description] if cur.description else None
    rows = list(cur.fetchall()) if columns is not None else []
    while True:
        bound()
        if not cur.nextset():
            return columns, rows


def user_error(exc: BaseException) -> bool:
    """Whether a driver error is the application's statement failing (bad SQL, an unknown
    column, a constraint, a lost deadlock or lock wait: the server answered with an error of
    its own, the connection is sound), not the server or the network failing. PyMySQL and
    asyncmy raise OperationalError for many of the former (1054, unknown column), so the
    error's number decides: client errors (2000 and up) never are."""
    if isinstance(exc, Refused):
        return True
    code = exc.args[0] if exc.args else None
    return isinstance(code, int) and code < 2000 and code not in SESSION_ENDING
