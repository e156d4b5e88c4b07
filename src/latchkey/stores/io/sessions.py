"""The sessions of a session-lock store (:mod:`latchkey.stores.sessionlocks`), sync flavour.

A lock lives on the connection that took it, so these sessions are not a pool of
interchangeable connections: a *main* session (opened on first use, replaced when the server
ended it — found without a round trip: an idle connection has nothing to read unless the
server hung up), and *spares*, each checked out for one wait in the server, then pinned to the
lock it got until the store frees it (at most ``IDLE_SPARES`` kept idle). A session's end
(an error leaving it unusable, a hang-up, :meth:`close`) is told to the store, whose locks on
it are then lost.

One mutex per backend: a primitive runs under it from start to end, except while it waits in
the server (its spare is its own then), so the store's bookkeeping is never interleaved. A
wait that fails or is interrupted (Ctrl-C) closes its spare: whatever the server granted it at
that instant ends with it. :meth:`close` interrupts the waits of other threads (they fail with
StoreUnavailable). In a forked child the parent's sessions are dropped unclosed (closing would
end the parent's sessions) and none of its locks is the child's.

A driver module subclasses :class:`SessionDriver` with how to open a session and run one
:class:`~latchkey.stores.sessionlocks.Statement` on it (``io/sessions_psycopg.py``,
``io/sessions_pymysql.py``).

Over the application's own pool or engine (``connect(client=…, locks="session")``) the
sessions are borrowed instead (:class:`~latchkey.stores.io.sessions_lending.Lending`): a
session is a connection checked out of that pool, kept while it holds a lock or waits, and
given back —
never closed — once it holds nothing (:meth:`SessionDriver.give_back`); one that failed is
discarded the pool's way (:meth:`SessionDriver.disconnect`), and :meth:`close` unlocks what
each still holds before giving it back (:meth:`SessionDriver.let_go`).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, TypeVar

from latchkey.stores.io import Driver, Steps, after_fork
from latchkey.stores.sessionlocks import (
    WAIT,
    Alive,
    End,
    Free,
    Reach,
    Refused,
    Run,
    SessionEnded,
    Spare,
    Statement,
)

T = TypeVar("T")

#: Idle spare sessions kept open for the next wait; a spare set free beyond these is closed.
IDLE_SPARES = 2

#: Connections left behind by a fork: the child must neither use nor close them, and keeping
#: them referenced avoids "deleted while open" warnings.
FORKED_AWAY: list[object] = []


class Session:
    """One connection: ``id`` is its server-side session id, ``server`` the server's version
    string, ``spare`` whether it is a spare (not the main session), ``closed`` whether it
    ended (then its locks did too)."""

    __slots__ = ("closed", "conn", "id", "server", "spare", "used")

    def __init__(self, conn: Any, id: int, server: str, spare: bool) -> None:
        self.conn = conn
        self.id = id
        self.server = server
        self.spare = spare
        self.closed = False
        self.used = 0.0


def held_keys(store: Any) -> dict[Any, list[Any]]:
    """The keys each session holds, from the store's map."""
    keys: dict[Any, list[Any]] = {}
    for key, hold in store.held.items():
        keys.setdefault(hold.session, []).append(key)
    return keys


class SessionDriver(Driver):
    """The main session, the spares, and the mutex; see the module docstring."""

    #: Errors a statement may raise; ``errors`` adds the store's own (mapped to
    #: StoreUnavailable when they end a primitive).
    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    #: Spares kept idle for the next wait (a borrowing driver keeps none: they go back to
    #: the application's pool at once).
    idle_spares: ClassVar[int] = IDLE_SPARES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.errors = (*cls.driver_errors, SessionEnded, Refused)  # the store's mapped too

    def __init__(self, backend: Any, store: Any) -> None:
        super().__init__(backend, store)
        self.timeout: float = backend.timeout
        self._reset()
        after_fork(self)

    def _reset(self) -> None:
        self.mutex = threading.Lock()
        self.main: Any = None
        self.idle: list[Any] = []  # spares holding nothing, for the next wait
        self.spares: set[Any] = set()  # every open spare: idle, waiting, or holding a lock
        self.waiting: set[Any] = set()  # spares in a wait in the server

    # -- the driver's part -----------------------------------------------------------------------

    def connect(self, spare: bool) -> Session:
        raise NotImplementedError

    def execute(self, session: Any, statement: Statement, params: Any) -> Any:
        """Run one statement; its answer (see sessionlocks.YES and the others)."""
        raise NotImplementedError

    def wait(self, session: Any, statement: Statement, params: Any) -> Any:
        """Run a WAIT statement: the server may take its ``params``' seconds to answer."""
        raise NotImplementedError

    def hung_up(self, session: Any) -> bool:
        """Whether the server ended an idle session (no round trip)."""
        raise NotImplementedError

    def usable(self, session: Any, exc: BaseException) -> bool:
        """After ``exc``, a driver error: whether the session can still be used."""
        return False

    def disconnect(self, session: Any) -> None:
        """Close the connection (a borrowed one: discard it the pool's way), errors ignored."""
        raise NotImplementedError

    def give_back(self, session: Any) -> None:
        """A session that holds nothing leaves: closed (a borrowed one goes back to its pool)."""
        self.disconnect(session)

    def let_go(self, session: Any, keys: list[Any]) -> None:
        """At :meth:`close`: end ``session`` and the locks ``keys`` it holds (closed; a
        borrowed one is unlocked, then given back)."""
        self.disconnect(session)

    def no_answer(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the server did not answer in time (frozen, or the network
        swallowing traffic): then a failed session's statement is an outage to report at
        once, not a question for a new connection that would wait out its own timeout."""
        return isinstance(exc, TimeoutError)

    def interrupt(self, session: Any) -> None:
        """End the wait another thread is in on ``session`` (it then fails, and closes it)."""
        raise NotImplementedError

    # -- running primitives ----------------------------------------------------------------------

    def run(self, steps: Steps[T], action: str) -> T:
        with self.mutex:
            return super().run(steps, action)

    def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is Run:
            statement, params, session = request
            if session is None:
                session = self._main()
            elif session.closed:
                raise SessionEnded("the session holding the lock has ended")
            if statement.answer == WAIT:
                return self._wait(session, statement, params), session
            try:
                return self.execute(session, statement, params), session
            except self.driver_errors as exc:
                if self.usable(session, exc):
                    raise
                self._end(session)
                if request.session is None or self.no_answer(exc):
                    raise  # the main session's statement failed, or no answer: an outage
                raise SessionEnded(str(exc)) from exc
        if kind is Free:
            return self._free(request.session)
        if kind is Alive:
            session = request.session
            if session.closed:
                return False
            if self.hung_up(session):
                self._end(session)
                return False
            return True
        if kind is Spare:
            return self._spare()
        if kind is Reach:
            self._main()
            return None
        if kind is End:
            self._end(request.session)
            return None
        raise TypeError(f"not a session-lock request: {request!r}")

    def _main(self) -> Any:
        main = self.main
        if main is not None:
            if not self.hung_up(main):
                return main
            self._end(main)  # the server ended it: its locks are gone
        main = self.main = self.connect(False)
        return main

    def _end(self, session: Any, holds_nothing: bool = False) -> None:
        """Close ``session``: its locks end (the store is told). ``holds_nothing``: it holds
        no lock, so a borrowed one may go back to its pool."""
        if session is self.main:
            self.main = None
        self.spares.discard(session)
        if session in self.idle:
            self.idle.remove(session)
        if not session.closed:
            session.closed = True
            (self.give_back if holds_nothing else self.disconnect)(session)
        self.store.session_ended(session)

    def _spare(self) -> Any:
        while self.idle:
            session = self.idle.pop()
            if not self.hung_up(session):  # a killed one is never reused
                return session
            self._end(session)
        self.mutex.release()  # connecting may take a while: the others go on
        try:
            session = self.connect(True)
        finally:
            self.mutex.acquire()
        self.spares.add(session)
        return session

    def _free(self, session: Any) -> None:
        if session is self.main or session.closed or session in self.idle:
            return
        keep = session in self.spares and len(self.idle) < self.idle_spares
        if keep and not self.hung_up(session):
            self.idle.append(session)
        else:
            self._end(session, holds_nothing=True)

    def _wait(self, session: Any, statement: Statement, params: Any) -> Any:
        self.waiting.add(session)
        self.mutex.release()
        try:
            got = self.wait(session, statement, params)
        except BaseException:
            self.mutex.acquire()
            self.waiting.discard(session)
            self._end(session)  # failed or interrupted: whatever it took ends with it
            raise
        self.mutex.acquire()
        self.waiting.discard(session)
        if session not in self.spares:  # close() meanwhile: what it got goes with it
            self._end(session)
            raise SessionEnded("the store was closed")
        return got

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Closing the sessions ends every lock they hold; a wait in progress in another
        thread fails with StoreUnavailable."""
        with self.mutex:
            sessions = list(self.spares)
            if self.main is not None:
                sessions.append(self.main)
            waiting = set(self.waiting)
            keys = held_keys(self.store)
            self.main, self.idle, self.spares = None, [], set()
            self.store.forget_all()
            for session in sessions:
                if session in waiting:
                    self.interrupt(session)  # its thread closes it
                    continue
                session.closed = True
                self.let_go(session, keys.get(session, []))

    def forget_after_fork(self) -> None:
        FORKED_AWAY.extend(s.conn for s in [self.main, *self.spares] if s is not None)
        self._reset()
        self.store.forget_all()
