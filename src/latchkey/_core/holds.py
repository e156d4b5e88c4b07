"""What this process holds through one store object: a busy answer without a round trip.

Threads (or tasks) of one process that contend on one name through one store object need
not each ask the store to learn that it is busy: while a lease of that object is live by its
holder's own clock (its local deadline, DESIGN §2.8: never later than the store's expiry), the
store would answer busy anyway. :class:`Holds` keeps those leases by name; the core asks it
before every attempt (``_core/lease.py``, ``_core/waiting.py``) and goes to the store only
when it has no answer.

- A lease is in it from its grant until its release is *sent* (not answered: a local waiter
  woken by that release must not find the record still there), or until it is lost.
- A record is live while its lease is held, not lost and before its local deadline, read from
  the lease at each question (a renewal moves the deadline), so it ends at the holder's local
  deadline at the latest.
- It answers busy only when ``limit`` or more live leases of the same ``limit`` are held: a
  mutex (limit 1) by one, a semaphore only when all its slots are held here.
- A waiter still takes its place in the store's own line (``wait_in_line``: PostgreSQL's
  queue, the doorbells, pub/sub, lines): a release through this store object wakes it there,
  and order between processes is the store's, as before. Only the attempts are skipped.
- The blocked mutex acquires of one process also take turns at asking (:data:`PACED`):
  while an attempt of the process is in flight a waiter waits for its outcome instead of
  racing it to the store, and waiters ask in the order they came (one woken by a release
  notice asks at once, in flight or not). A newcomer's first attempt is not held back (only
  a live lease answers it): the thread that just released takes the lease again while the
  woken waiter is still waking, and joining a store's line costs more than asking on some
  stores (an SQLite doorbell: ~300 µs against ~20 µs). PACED is never an acquire's final
  answer: a wait that runs out on it asks the store once, and a try (``wait=0``) is never
  paced, so a store failure is never reported as busy.
- A forked child starts empty: the parent's leases, attempts and waiters are not its own.

Not used where a lease has no local deadline (session-tied locks: a dead session frees the
lock without the holder knowing) or where a store's attempt does more than ask (ZooKeeper: a
waiter's attempt refreshes its node): see :func:`holds_for`.

Plain state under a :class:`threading.Lock` held for a few dict operations, so the sync and
the asyncio shells share it; recording and dropping a lease take no lock (:meth:`Holds.add`):
a record lost to a race only sends an acquire to the store.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from latchkey._owner import Owner
from latchkey._types import Busy, Holder

if TYPE_CHECKING:
    from latchkey._core.lease import LeaseCore


#: The answer to a blocked mutex acquire of this process that must let another of the same
#: process go first: an attempt of it is in flight (its outcome is as good as ours would
#: be), or it waits before us. Never the final answer of an acquire: one that runs out of
#: time on it asks the store once (``_core/waiting.py``).
PACED = Busy(1)


class Holds:
    """The live leases of one store object in this process, by name, and the turns of its
    mutex acquires (see the module)."""

    __slots__ = ("_lock", "asking", "names", "pid", "queue")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Weak references: a lock the application forgot while holding it is collected
        #: (and its renewer stops) as before; its record goes with it.
        self.names: dict[str, list[weakref.ref[LeaseCore]]] = {}
        #: Mutex attempts of this process in flight, by name.
        self.asking: dict[str, int] = {}
        #: The blocked mutex acquires of this process, by name, in the order they came.
        self.queue: dict[str, dict[object, None]] = {}
        self.pid = os.getpid()

    def _forked(self) -> None:
        """Under the lock: a forked child starts empty (the parent's leases, attempts and
        waiters are not its own)."""
        if self.pid != os.getpid():
            self.names, self.asking, self.queue, self.pid = {}, {}, {}, os.getpid()

    def add(self, lease: LeaseCore) -> weakref.ref[LeaseCore]:
        """Record ``lease`` (granted); the reference to give :meth:`remove`. (A forked child's
        first question empties the record, its own leases with it: a record missing only
        sends an acquire to the store.)

        Without the lock, as :meth:`remove` (every acquire and release passes here): a race
        between them can only lose a record, in a list another thread just took out of
        ``names`` — never keep one in ``names`` for a lease already released there."""
        ref = weakref.ref(lease)
        held = self.names.get(lease.name)
        if held is None:
            held = self.names.setdefault(lease.name, [])
        held.append(ref)
        return ref

    def remove(self, name: str, ref: weakref.ref[LeaseCore]) -> None:
        held = self.names.get(name)
        if held is None:
            return
        try:
            held.remove(ref)
        except ValueError:  # its list was taken out meanwhile (dropped, forked, emptied)
            return
        if not held:
            self.names.pop(name, None)

    def drop(self, name: str) -> None:
        """Forget every lease on ``name`` (a force-release through this store object)."""
        with self._lock:
            self.names.pop(name, None)

    # -- turns (mutexes) ---------------------------------------------------------------------

    def asks(self, name: str, step: int) -> None:
        """A mutex attempt of ``name`` is sent (``step`` 1) or answered (-1)."""
        with self._lock:
            if step > 0:
                self._forked()
            count = self.asking.get(name, 0) + step
            if count > 0:
                self.asking[name] = count
            else:
                self.asking.pop(name, None)

    def join(self, name: str, waiter: object) -> None:
        with self._lock:
            self._forked()
            self.queue.setdefault(name, {})[waiter] = None

    def leave(self, name: str, waiter: object) -> None:
        with self._lock:
            line = self.queue.get(name)
            if line is not None:
                line.pop(waiter, None)
                if not line:
                    del self.queue[name]

    def first(self, name: str, waiter: object) -> bool:
        """Whether ``waiter`` is the first of its name's queue here: the one the others let
        ask (:meth:`answer`), so it must not sleep as if behind them."""
        with self._lock:
            line = self.queue.get(name)
            return line is not None and next(iter(line), None) is waiter

    def answer(self, name: str, limit: int, waiter: object, woken: bool) -> Busy | None:
        """The answer for a blocked acquire (``waiter``, in its name's queue) without the
        store, if there is one: busy while this process holds the name (:meth:`busy`); for a
        mutex, :data:`PACED` while an attempt of it is in flight, or while another of its
        waiters came first — unless a release notice ``woken`` it: an attempt in flight may
        have been answered before that release, and where a release wakes one process (Redis)
        nobody else would try. None: ask the store."""
        if self.pid != os.getpid():
            with self._lock:
                self._forked()
        local = self.busy(name, limit)
        if local is not None or limit != 1 or woken:
            return local
        if name in self.asking:
            return PACED
        if name not in self.queue:
            return None
        with self._lock:  # the first of the line, read while no other thread changes it
            line = self.queue.get(name)
            first = next(iter(line)) if line else waiter
        return PACED if first is not waiter else None

    def busy(self, name: str, limit: int) -> Busy | None:
        """A busy answer for an acquire of ``name`` with ``limit``, if this process holds
        ``limit`` live leases of it with the same limit; None: ask the store."""
        if name not in self.names:  # the common case, without the lock
            return None
        now = time.monotonic()
        with self._lock:
            self._forked()
            live = [
                (left, lease)
                for ref in self.names.get(name, ())
                if (lease := ref()) is not None
                and lease.limit == limit
                and (left := _left(lease, now)) > 0
            ]
        if len(live) < limit:
            return None
        left, soonest = min(live, key=lambda pair: pair[0])
        return Busy(len(live), _holder(soonest), left)


def _left(lease: LeaseCore, now: float) -> float:
    """Seconds the lease has left by its holder's clock (0: not held, lost or past it)."""
    if lease._owner is None or lease._lost_reason is not None:
        return 0.0
    deadline = lease._deadline
    return 0.0 if deadline is None else deadline - now


def _holder(lease: LeaseCore) -> Holder:
    """The holder as a store's busy answer shows it, from what its grant said: the acquire
    time is the store's expiry minus the TTL (unknown for a lease handed over)."""
    grant = lease._grant
    acquired = None
    if grant is not None and grant.remaining is None and grant.expires_at is not None:
        acquired = grant.expires_at - timedelta(seconds=lease.ttl)
    return Holder(lease.token, Owner.from_json(lease._owner_info), acquired, lease.expires_at)


def holds_for(backend: Any) -> Holds | None:
    """The registry of a new store object over ``backend``, or None where a local record
    could outlive the lease in the store or skip what an attempt must do (module docstring)."""
    caps = backend.capabilities
    if not caps.ttl or caps.blocking or not getattr(backend, "local_busy", True):
        return None
    return Holds()
