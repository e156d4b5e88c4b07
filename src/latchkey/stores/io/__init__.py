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
            return drive(steps, self.answer)
        except StoreUnavailable:
            raise
        except self.errors as exc:
            self.backend.unavailable(exc, action)

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
    """Connections of one sync driver, shared by the threads of one process.

    ``open()`` makes a connection, ``close(conn)`` ends one (errors ignored), ``alive(conn)``
    says whether an idle one can still be used — called only for a connection idle for
    ``check_after`` seconds or more (a cheap local test, e.g. has the server hung up), so the
    hot path pays nothing. ``keep(exc)`` says whether an error leaves the connection usable
    (a statement error) or not (the default: it is closed, the next caller opens a new one).
    :meth:`close` closes the idle connections and those in use as they come back; the pool
    can be used again afterwards (it opens new ones).
    """

    def __init__(
        self,
        open: Callable[[], C],
        close: Callable[[C], None],
        *,
        alive: Callable[[C], bool] | None = None,
        keep: Callable[[Exception], bool] | None = None,
        size: int = 8,
        check_after: float = 0.0,
    ) -> None:
        self._open, self._close, self._alive, self._keep = open, close, alive, keep
        self.size = size
        self.check_after = check_after
        self._reset()
        after_fork(self)

    def _reset(self) -> None:
        self._idle: list[tuple[C, float]] = []
        self._busy: dict[int, int] = {}  # id(conn) -> the generation it was opened in
        self._generation = 0
        self._cond = threading.Condition(threading.Lock())
        self._pid = os.getpid()

    def forget_after_fork(self) -> None:
        self._reset()

    def get(self, timeout: float) -> C:
        """An idle connection, or a new one; waits up to ``timeout`` when ``size`` are busy."""
        with self._cond:
            if self._pid != os.getpid():  # forked without register_at_fork
                self._reset()
            deadline = None
            while not self._idle and len(self._busy) >= self.size:
                deadline = deadline or time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise TimeoutError(f"no free connection within {timeout:g}s")
            generation = self._generation
            conn: Any = None
            since = 0.0
            if self._idle:
                conn, since = self._idle.pop()
                self._busy[id(conn)] = generation
                if self._alive is None or time.monotonic() - since < self.check_after:
                    return conn  # type: ignore[no-any-return]
        if conn is not None:
            if self._alive is not None and self._alive(conn):
                return conn  # type: ignore[no-any-return]
            self.discard(conn)
        try:
            conn = self._open()
        except BaseException:
            with self._cond:
                self._cond.notify()
            raise
        with self._cond:
            self._busy[id(conn)] = generation
        return conn  # type: ignore[no-any-return]

    def put(self, conn: C) -> None:
        """Give back a connection in a known state."""
        with self._cond:
            if self._pid != os.getpid():
                return  # the parent's: not ours to close or reuse
            generation = self._busy.pop(id(conn), None)
            self._cond.notify()
            if generation == self._generation:
                self._idle.append((conn, time.monotonic()))
                return
        self._close(conn)  # opened before close(): close it now

    def discard(self, conn: C) -> None:
        """Close a connection whose state is unknown (an error or an interrupt mid-call)."""
        with self._cond:
            if self._pid != os.getpid():
                return
            self._busy.pop(id(conn), None)
            self._cond.notify()
        self._close(conn)

    @contextlib.contextmanager
    def connection(self, timeout: float) -> Iterator[C]:
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
            if self._pid != os.getpid():
                self._reset()
                return
            idle, self._idle = self._idle, []
            self._generation += 1
        for conn, _ in idle:
            self._close(conn)
