"""Session locks over the application's own pool or engine (``connect(client=…,
locks="session")``), sync: where a session's connection comes from and where it goes back.

A *lender* is the application's client seen through its public API:

- a ``psycopg_pool.ConnectionPool``: ``getconn(timeout)`` (the store's timeout: a pool that
  stays exhausted is StoreUnavailable), ``putconn()``; a connection in an unknown state is
  closed first, and the pool, finding it closed, discards it and opens another;
- a SQLAlchemy ``Engine``: ``raw_connection()``, its DB-API connection used, the proxy's
  ``close()`` giving it back to the engine's pool; ``invalidate()`` first to discard it.

:class:`Lending` makes a session driver borrow (a mixin placed before the driver's class): a
session is a connection checked out of the lender — the main session for the statements of
one primitive, and for as long as a lock it took lives; a spare for a wait, and for as long
as the lock it got lives — and given back (:meth:`Lending.give_back`), never closed, once it
holds nothing: the main session after any primitive that leaves it holding nothing, a spare
when its lock is released or its wait ended without one. A session that failed or timed out
mid-statement is discarded the lender's way (:meth:`Lending.disconnect`); one the driver
cannot vouch for when it goes back (a lost connection, an unknown state) is discarded too.
``store.close()`` unlocks what each session still holds (the store's own release statement:
only latchkey's keys, never the application's) and gives it back; the client is never closed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from latchkey.stores.io import Driver, Steps

T = TypeVar("T")


#: Connections lent dead (the server ended them while they sat in the pool: a restart) are
#: discarded and another taken, this many times in all.
DEAD_TRIES = 3


class DeadOnArrival(ConnectionError):
    """The pool lent a connection the server had already ended."""


def _engine(client: Any) -> bool:
    return hasattr(client, "raw_connection") and hasattr(client, "dialect")


def application_error(exc: BaseException, what: str) -> BaseException:
    """An error of the application's library outside the driver's own (SQLAlchemy's pool
    timeout, say) as a ConnectionError, which becomes StoreUnavailable."""
    return ConnectionError(f"the application's {what}: {type(exc).__name__}: {exc}")


class PoolLender:
    """A psycopg_pool ConnectionPool (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def take(self, timeout: float) -> Any:
        return self.pool.getconn(timeout)

    def give_back(self, conn: Any) -> None:
        self.pool.putconn(conn)

    def discard(self, conn: Any) -> None:
        with contextlib.suppress(Exception):
            conn.close()  # the pool discards a closed connection and opens another
        self.pool.putconn(conn)


class EngineLender:
    """A SQLAlchemy Engine: its pool's DB-API connections (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.proxies: dict[int, Any] = {}  # id(DB-API connection) -> SQLAlchemy's proxy

    def take(self, timeout: float) -> Any:
        try:
            proxy = self.engine.raw_connection()  # (the engine's own pool_timeout applies)
        except Exception as exc:
            if type(exc).__module__.startswith("sqlalchemy"):
                raise application_error(exc, "engine") from exc
            raise
        conn = proxy.driver_connection
        self.proxies[id(conn)] = proxy
        return conn

    def give_back(self, conn: Any) -> None:
        self.proxies.pop(id(conn)).close()  # back to the engine's pool

    def discard(self, conn: Any) -> None:
        proxy = self.proxies.pop(id(conn))
        with contextlib.suppress(Exception):
            proxy.invalidate()  # closed and dropped from the engine's pool
        with contextlib.suppress(Exception):
            proxy.close()


def lender(client: Any) -> PoolLender | EngineLender:
    return EngineLender(client) if _engine(client) else PoolLender(client)


class Lending:
    """Sessions borrowed from the application's pool or engine (module docstring); mixed in
    before a :class:`~latchkey.stores.io.sessions.SessionDriver` subclass, which supplies
    :meth:`lent` (a checked-out connection made a session), :meth:`sound` and :meth:`tidy`."""

    idle_spares = 0  # a spare holding nothing goes back to the application's pool at once
    # (the SessionDriver's attributes and methods, for the type checker)
    main: Any
    mutex: Any
    store: Any
    timeout: float
    driver_errors: ClassVar[tuple[type[BaseException], ...]]

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)  # type: ignore[call-arg]
        self.lender = lender(backend.client)

    # -- the driver's part -----------------------------------------------------------------------

    def lent(self, conn: Any, spare: bool) -> Any:
        """A session over ``conn``, just checked out (made ready for latchkey's statements)."""
        raise NotImplementedError

    def sound(self, session: Any) -> bool:
        """Whether ``session`` can go back to the pool as it is (no round trip)."""
        raise NotImplementedError

    def tidy(self, session: Any) -> None:
        """Make ``session``'s connection as it was lent, before it goes back."""

    if TYPE_CHECKING:  # the SessionDriver's

        def execute(self, session: Any, statement: Any, params: Any) -> Any: ...
        def _end(self, session: Any, holds_nothing: bool = False) -> None: ...

    # -- borrowing -------------------------------------------------------------------------------

    def run(self, steps: Steps[T], action: str) -> T:
        with self.mutex:
            try:
                return Driver.run(self, steps, action)  # type: ignore[arg-type]
            finally:
                self.after_primitive()

    def after_primitive(self) -> None:
        """The main session goes back when no lock lives on it."""
        main = self.main
        if main is not None and not any(h.session is main for h in self.store.held.values()):
            self._end(main, holds_nothing=True)

    def connect(self, spare: bool) -> Any:
        for attempt in range(DEAD_TRIES, 0, -1):
            conn = self.lender.take(self.timeout)
            try:
                return self.lent(conn, spare)
            except DeadOnArrival:
                self.lender.discard(conn)
                if attempt == 1:
                    raise
            except BaseException:
                self.lender.discard(conn)
                raise
        raise AssertionError("unreachable")

    def give_back(self, session: Any) -> None:
        if not self.sound(session):
            self.disconnect(session)
            return
        try:
            self.tidy(session)
        except self.driver_errors:
            self.disconnect(session)
            return
        self.lender.give_back(session.conn)

    def disconnect(self, session: Any) -> None:
        with contextlib.suppress(Exception):
            self.lender.discard(session.conn)

    def let_go(self, session: Any, keys: list[Any]) -> None:
        if keys and self.sound(session):
            run = self.store.release_many_run(keys, session)
            try:
                self.execute(session, run.statement, run.params)
            except self.driver_errors:
                self.disconnect(session)
                return
        elif keys:  # cannot be unlocked: closed, its locks with it
            self.disconnect(session)
            return
        self.give_back(session)
