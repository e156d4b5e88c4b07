"""A local deadline for blocking calls whose driver offers none: one daemon thread per
process that shuts down the socket of a call still running past its deadline.

Why: libpq (psycopg's sync API) bounds a wait on the network only by TCP (keepalives,
``tcp_user_timeout``) and by the server (``statement_timeout``). A server that is frozen —
``SIGSTOP``, a stalled VM, a process stuck in the kernel — or a middlebox that swallows
traffic while acknowledging it leaves the call blocked for ever: the kernel at the other end
still acknowledges every packet and keepalive, and the server never runs the timer. psycopg's
sync ``execute`` takes no deadline (its asyncio flavour is bounded by the event loop, see
:func:`latchkey.stores.io.aio.bounded`). Shutting the socket down wakes libpq's ``poll()`` at
once; the call fails with "server closed the connection", and the caller reports
StoreUnavailable ("no answer within …") and drops the connection.

Cost: :meth:`Watchdog.arm` is a dict store and a comparison, :meth:`Watchdog.disarm` a dict
pop (and a lock only while the thread is cutting a socket) — no wake-up of the thread on the
hot path: it sleeps until the earliest deadline armed (each new deadline of a steady workload
is later than the one it sleeps for), and without any call in flight for two of its periods
it sleeps until poked.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable

#: What :attr:`Watchdog.armed` holds for a call whose socket was shut down.
CUT = (math.inf, None)


class Watchdog:
    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        #: call key -> (deadline, the socket's fd getter), or CUT.
        self.armed: dict[Hashable, tuple[float, Callable[[], int] | None]] = {}
        self.lock = threading.Lock()
        #: Set by the thread (under the lock) while it may cut a call's socket: disarm then
        #: takes the lock.
        self.cutting = False
        self._wake = threading.Event()
        self._next = math.inf  # when the thread wakes next (inf: asleep until poked, or scanning)
        self._thread: threading.Thread | None = None

    def arm(self, key: Hashable, seconds: float, fileno: Callable[[], int]) -> None:
        """Watch the call ``key`` (e.g. its connection) for ``seconds``; ``fileno()`` gives
        its socket when the time is up."""
        deadline = time.monotonic() + seconds
        self.armed[key] = (deadline, fileno)
        if deadline < self._next:
            if self._thread is None:
                self._start()
            self._wake.set()

    def disarm(self, key: Hashable) -> bool:
        """The call ``key`` returned (or failed): True if its socket was shut down by then —
        its connection must not be used again, whatever the call answered.

        Without the lock unless the thread is cutting (every statement passes here): the
        thread sets :attr:`cutting` before it reads an entry to cut it, and this reads the
        flag after taking the entry out. If the flag is down, the thread will find the entry
        gone; if it is up, this waits for the thread's lock — the cut, if it was ours, is
        then done and its CUT back in :attr:`armed` (a socket is never shut down after its
        connection went back to the pool)."""
        entry = self.armed.pop(key, None)
        if not self.cutting:
            return entry is CUT
        with self.lock:
            return entry is CUT or self.armed.pop(key, None) is CUT

    def _start(self) -> None:
        with self.lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="latchkey-deadlines", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        idle_scans = 0
        while True:
            self._wake.clear()
            self._next = math.inf  # a call armed while we scan pokes us: we look again
            now = time.monotonic()
            earliest = math.inf
            with self.lock:
                for key, entry in list(self.armed.items()):
                    deadline, fileno = entry
                    if fileno is None:
                        continue
                    if deadline > now:
                        earliest = min(earliest, deadline)
                        continue
                    self.cutting = True  # before the entry is read again (see disarm)
                    if self.armed.get(key) is entry:  # not disarmed (nor armed again) since
                        self.armed[key] = CUT
                        _shut_down(fileno)  # (under the lock: disarm waits for it)
                self.cutting = False
            idle_scans = idle_scans + 1 if earliest == math.inf else 0
            if idle_scans == 1:
                earliest = now + 1.0  # quiet for now: look again in a second before idling
            self._next = earliest
            self._wake.wait(None if earliest == math.inf else earliest - now)


def _shut_down(fileno: Callable[[], int]) -> None:
    with contextlib.suppress(Exception):  # closed meanwhile: nothing left to cut
        shut_down(fileno())


def shut_down(fd: int) -> None:
    """Shut down the socket ``fd`` (owned by a driver) in both directions, leaving the fd
    itself to its owner: a read or write waiting on it ends at once, with end of file."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


#: The process's watchdog (its thread starts with the first call armed).
WATCHDOG = Watchdog()
