"""A psycopg connection's socket, watched by its event loop for as long as latchkey uses it,
and the one thing a task waits on while a libpq statement's reply comes (asyncio).

The usual way to wait for a socket in asyncio — ``loop.add_reader`` with a callback that sets
a fresh future, ``loop.remove_reader`` once it has — costs per wait two ``epoll_ctl`` system
calls, the selector's bookkeeping for both, a handle and a future, and a second turn of the
loop: the future's callback wakes the task in the turn after the socket's. On the development
VM that was ~140k of the ~370k instructions of an asyncio ``postgresql+advisory`` acquire +
release pair (callgrind), more than latchkey's own Python code in it (docs/benchmarks.md,
run 18).

A :class:`Watch` is registered with the loop once (:meth:`Watch.watch`) and stays registered
between statements. The task awaits the watch itself: it is future-like to the task (the
``_asyncio_future_blocking`` protocol, as :class:`~latchkey.stores.io.sessions_async._Hold`),
which hands it its wake-up; when the socket becomes readable the loop calls the watch, and
the watch calls that wake-up at once, in the task's context: the task goes on in the same turn.

- **Cancellation is held back**: the watch refuses the task's cancel (:meth:`Watch.cancel`
  returns False), so asyncio throws CancelledError in when the task is next woken — when the
  reply comes. ``reply`` catches it, marks the cancellation deferred and reads the reply to
  its end: a statement on a shared session is never cut in half.
- **A deadline** per statement (:meth:`Watch.start`): an entry in the loop's keeper
  (:mod:`latchkey.stores.io.deadlines`), no timer of its own. When it comes the waiting task
  is woken with TimeoutError (in a turn of its own, not inside the keeper's round).
- **Between statements** nothing waits: what the socket brings then was sent unasked (a
  notice; a server's goodbye before it closes the connection). It is left unread, for the
  session driver's idle check (``hung_up``: one ``poll``, and what it reads), and the watch
  lets go, or the loop would report it again at every turn; the next statement watches again.
- **Before anything else uses the connection** (psycopg's own ``execute``, whose wait
  registers the socket itself and removes it after; closing it; handing it back to the
  application's pool) the session driver lets go of the watch (:meth:`Watch.unwatch`): the
  watch cannot tell that another registration replaced its own. In another loop than the one
  it watches in, it moves there.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections.abc import Callable, Generator
from typing import Any

import psycopg

from latchkey.stores.io.deadlines import Keeper, keeper


class Watch:
    """See the module docstring. One per connection; a session's statements run one at a
    time (the session driver's mutex), so one waiter at most."""

    __slots__ = ("_asyncio_future_blocking", "_loop", "context", "deadline", "error",
                 "expired", "fd", "keeper", "pgconn", "wakeup")  # fmt: skip

    def __init__(self, pgconn: psycopg.pq.abc.PGconn) -> None:
        self.pgconn = pgconn
        self._asyncio_future_blocking = False
        self.fd = -1  # the socket watched (-1: none yet)
        self._loop: asyncio.AbstractEventLoop | None = None  # the task reads it: same loop?
        self.keeper: Keeper | None = None
        self.wakeup: Callable[[Any], object] | None = None  # the waiting task's
        self.context: contextvars.Context | None = None
        self.error: BaseException | None = None
        self.deadline = math.inf
        self.expired = False

    # -- the loop's watch ------------------------------------------------------------------------

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Be watched by ``loop`` (the running one), and by no other."""
        if self._loop is not loop:
            self.unwatch()
            # The socket as libpq has it now: OperationalError if libpq closed it (the
            # connection failed), never a number since reused by another connection.
            self.fd = self.pgconn.socket
            loop.add_reader(self.fd, self._readable)
            self._loop, self.keeper = loop, keeper(loop)

    @property
    def watching(self) -> asyncio.AbstractEventLoop | None:
        """The loop watching the socket now, if any."""
        return self._loop

    def unwatch(self) -> None:
        """No longer watched (idempotent): something else is about to use the connection."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)

    def _readable(self) -> None:
        wakeup = self.wakeup
        if wakeup is not None:  # the reply: the task goes on, here and now
            self.wakeup = None
            self.context.run(wakeup, self)  # type: ignore[union-attr]
            return
        # Nothing waits: sent unasked (a notice), or the connection's end. Left unread for
        # the session driver's idle check (it reads it: ``hung_up``), and watched no more,
        # or the loop would report it again at every turn; the next statement watches again.
        self.unwatch()

    # -- one statement ---------------------------------------------------------------------------

    def start(self, deadline: float) -> None:
        """A statement begins: TimeoutError for its waits after ``deadline`` (loop time)."""
        self.deadline, self.expired = deadline, False
        keeper = self.keeper
        assert keeper is not None  # watched
        keeper.calls[self] = None
        if deadline < keeper.at:
            keeper.arm(deadline)

    def end(self) -> None:
        if self.keeper is not None:
            self.keeper.calls.pop(self, None)

    def expire(self) -> None:
        """The deadline came (the keeper took the entry out)."""
        self.expired = True
        if self._loop is not None:
            self._loop.call_soon(self._time_up)

    def _time_up(self) -> None:
        wakeup = self.wakeup
        if self.expired and wakeup is not None:  # (not a later statement's wait)
            self.wakeup = None
            self.error = TimeoutError("no reply within the timeout")
            self.context.run(wakeup, self)  # type: ignore[union-attr]

    # -- what the task sees: a future it waits on ----------------------------------------------

    def add_done_callback(
        self, fn: Callable[[Any], object], *, context: contextvars.Context | None = None
    ) -> None:
        self.wakeup = fn
        self.context = context if context is not None else contextvars.copy_context()

    def result(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    def cancel(self, msg: Any = None) -> bool:
        """The task's cancel: refused, so that it is thrown in when the reply has come."""
        return False

    def __await__(self) -> Generator[Any, None, None]:
        self._asyncio_future_blocking = True
        yield self
