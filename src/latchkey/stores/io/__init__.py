"""The shared I/O layer: how a store's requests reach its server, sync flavour.

A built-in store (:class:`latchkey.stores.primitives.Store`) writes each primitive once, as a
generator that yields *requests* — run this statement, evaluate this script, open a waiter —
and receives the answers. It does no I/O. A *driver* carries the requests out: this package
holds what every driver shares, and one module per driver family holds the rest
(``io/sqlite.py``, ``io/psycopg.py``, …; the asyncio flavours in ``io/*_async.py`` modules
and :mod:`latchkey.stores.io.aio`, so the sync API never imports asyncio).

What lives here once, for every driver:

- :func:`drive`: runs a store generator, each request answered by a callable, each error
  thrown back in (so the store's ``finally`` and ``except`` see it);
- :class:`Driver`: the sync driver's contract — ``run(steps, action)`` maps the driver's errors
  to :class:`~latchkey.errors.StoreUnavailable` naming the action, ``close()``;
- :class:`Pool`: connections reused last-in first-out, at most ``size`` open (callers queue
  for one), checked before reuse when idle a while, closed when an error leaves them in an
  unknown state, and never used across ``fork()``: a child opens its own and leaves its
  parent's sockets alone (:func:`after_fork`).
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from latchkey.errors import StoreUnavailable

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")
C = TypeVar("C")

#: A store primitive: a generator of driver requests that returns the primitive's answer.
Steps = Generator[Any, Any, T]


def drive(steps: Steps[T], answer: Callable[[Any], Any]) -> T:
    """Run ``steps`` to its end, each request it yields answered by ``answer(request)``; an
    error raised by ``answer`` is thrown into the generator at the ``yield``."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = answer(request), None
        except BaseException as exc:  # thrown into the store's generator
            value, error = None, exc


class Driver(abc.ABC):
    """One store's connection(s) to its server, sync. Made by the store's backend with the
    backend (URL, options, timeout) and the store (statements, settings)."""

    #: The driver's own errors: any of them ending a primitive becomes StoreUnavailable.
    errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        self.backend = backend
        self.store = store

    @abc.abstractmethod
    def answer(self, request: Any) -> Any:
        """Carry out one request (called by :meth:`run` on the connection it holds)."""

    def run(self, steps: Steps[T], action: str) -> T:
        """Run a store primitive; a driver error becomes StoreUnavailable naming ``action``."""
        try:
            return drive(steps, self.answerer())
        except StoreUnavailable:
            raise
        except self.errors as exc:
            self.backend.unavailable(exc, action)

    def answerer(self) -> Callable[[Any], Any]:
        """What answers the requests of one primitive: :meth:`answer`, or (a driver that
        bounds a whole primitive by one deadline, etcd's and ZooKeeper's) a function that
        carries the primitive's deadline to it."""
        return self.answer

    def close(self) -> None:  # noqa: B027 - a driver with nothing to close
        """Release every connection (leases tied to a session end with it)."""


# -- fork safety -----------------------------------------------------------------------------

_AFTER_FORK: weakref.WeakSet[Any] = weakref.WeakSet()


def after_fork(obj: Any) -> None:
    """Call ``obj.forget_after_fork()`` in a forked child: drop the parent's connections
    without closing them (their sockets are the parent's) and make new locks (a lock held by
    another thread at the fork stays held for ever in the child)."""
    _AFTER_FORK.add(obj)


def _forget_in_child() -> None:
    for obj in list(_AFTER_FORK):
        obj.forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


# -- a pool of connections -------------------------------------------------------------------


class Pool(Generic[C]):
    """Connections of one sync driver, shared by the threads of one process: reused last-in
    first-out, at most ``size`` open (callers queue for one, up to the timeout given to
    :meth:`get`), ``alive(conn)`` asked before each reuse (a cheap local test, e.g. has the
    server hung up: no round trip), never used across ``fork()`` (a child opens its own and
    leaves its parent's sockets alone). :meth:`close` closes the idle connections and those
    in use as they come back; the pool can be used again afterwards (it opens new ones).

    The fast path takes no lock: a free connection is taken with ``list.pop()`` and given
    back with ``list.append()`` (each atomic in CPython); the lock is taken only to open one,
    to wait for one, or to wake a waiter. (A Condition-guarded get + put cost ~11 µs a call
    here against ~2.5 µs: 3-4 % of a MariaDB acquire + release pair.)

    ``keep(exc)`` (for :meth:`connection`) says whether an error leaves the connection usable
    (a statement error) or not (the default: it is closed, the next caller opens a new one).
    """

    def __init__(
        self,
        open: Callable[[], C],
        close: Callable[[C], None],
        *,
        alive: Callable[[C], bool] | None = None,
        keep: Callable[[Exception], bool] | None = None,
        size: int = 8,
    ) -> None:
        self._open, self._close, self._alive, self._keep = open, close, alive, keep
        self.size = size
        self._reset()
        after_fork(self)

    def _reset(self) -> None:
        self._idle: list[C] = []
        self._born: dict[int, int] = {}  # id(conn) -> the generation it was opened in
        self._count = 0  # open or being opened
        self._waiting = 0
        self._generation = 0
        self._cond = threading.Condition(threading.Lock())

    def forget_after_fork(self) -> None:
        self._reset()  # the parent's connections: neither used nor closed here

    def get(self, timeout: float | None = None) -> C:
        """A free connection that is still alive, or a new one; while ``size`` are in use,
        waits for one (up to ``timeout`` seconds if given: TimeoutError after that)."""
        deadline = 0.0
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                pass
            else:
                if self._alive is None or self._alive(conn):
                    return conn
                self.discard(conn)
                continue
            with self._cond:
                if self._count >= self.size and not self._idle:
                    if timeout is not None:
                        deadline = deadline or time.monotonic() + timeout
                    self._waiting += 1
                    try:
                        while self._count >= self.size and not self._idle:
                            if timeout is None:
                                self._cond.wait()
                                continue
                            left = deadline - time.monotonic()
                            if left <= 0 or not self._cond.wait(left):
                                raise TimeoutError(f"no free connection within {timeout:g}s")
                    finally:
                        self._waiting -= 1
                if self._idle:
                    continue
                self._count += 1
                generation = self._generation
            try:
                conn = self._open()
            except BaseException:
                with self._cond:
                    self._count -= 1
                    self._cond.notify()
                raise
            self._born[id(conn)] = generation
            return conn

    def put(self, conn: C) -> None:
        """Give back a connection in a known state."""
        generation = self._born.get(id(conn))
        if generation is None:
            return  # opened before a fork: the parent's, not ours to close or reuse
        if generation != self._generation:
            self.discard(conn)  # opened before close()
            return
        self._idle.append(conn)
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def discard(self, conn: C) -> None:
        """Close a connection whose state is unknown (an error or an interrupt mid-call)."""
        with self._cond:
            if self._born.pop(id(conn), None) is None:
                return  # the parent's
            self._count -= 1
            self._cond.notify()
        self._close(conn)

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[C]:
        """A connection for the block: given back after it, closed if the block failed with
        an error that ``keep`` does not accept."""
        conn = self.get(timeout)
        try:
            yield conn
        except Exception as exc:
            if self._keep is not None and self._keep(exc):
                self.put(conn)
            else:
                self.discard(conn)
            raise
        except BaseException:
            self.discard(conn)
            raise
        self.put(conn)

    def close(self) -> None:
        """Close the idle connections; those in use are closed when given back."""
        with self._cond:
            self._generation += 1
            idle, self._idle = self._idle, []
        while idle:
            self.discard(idle.pop())


# -- a connection held across calls ----------------------------------------------------------


class Pinned:
    """One connection held by one caller across several calls, then given back: a
    ``rows.take`` batch's open transaction (:mod:`latchkey.stores.rows_sql`). Made by a
    driver's ``pin()``, with how it answers requests on that connection, how it gives the
    connection back (``give_back(conn, reuse)``: reuse False closes it), and which of the
    driver's errors are the application's own statement failing (``user_error``: raised to
    the application as the driver raised them, the connection kept).

    Any other error (the server or the network failed, an interrupt mid-statement) marks the
    connection broken: :meth:`release` then closes it instead of pooling it, so a connection
    left inside a transaction, or half-read, never goes back to the pool.
    """

    def __init__(
        self,
        driver: Driver,
        conn: Any,
        answer: Callable[[Any], Any],
        give_back: Callable[[Any, bool], None],
        user_error: Callable[[BaseException], bool],
        begin: Callable[[], None] | None = None,
    ) -> None:
        self.driver, self.conn = driver, conn
        self._answer, self._give_back, self._user_error = answer, give_back, user_error
        #: Called as each call starts (a driver that bounds a whole call by one deadline).
        self._begin = begin
        self.broken = False

    def run(self, steps: Steps[T], action: str, user: bool = False) -> T:
        """Run ``steps`` on the held connection; a driver error becomes StoreUnavailable
        naming ``action``, except an error of the application's statement (``user``)."""
        if self.conn is None:
            raise StoreUnavailable(f"{action}: the connection was already given back")
        try:
            if self._begin is not None:
                self._begin()
            return drive(steps, self._answer)
        except StoreUnavailable:
            self.broken = True
            raise
        except self.driver.errors as exc:
            if user and self._user_error(exc):
                raise
            self.broken = True
            self.driver.backend.unavailable(exc, action)
        except BaseException:
            self.broken = True
            raise

    def release(self, reuse: bool) -> None:
        """Give the connection back (pooled if ``reuse`` and nothing broke it, else closed);
        once."""
        conn, self.conn = self.conn, None
        if conn is not None:
            self._give_back(conn, reuse and not self.broken)
