"""The sync runner: drives a core generator (``latchkey._core``) with blocking calls.

Its asyncio twin is :mod:`latchkey._async._run`; the two differ only in how each operation
is carried out (a call or an await, ``time.sleep`` or ``asyncio.sleep``, a thread or a task).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey import _observe
from latchkey._core.ops import BACKGROUND, CALL, RENEW, SLEEP, UNRENEW, USER, Steps
from latchkey.errors import LatchkeyError

if TYPE_CHECKING:
    from latchkey._core.lease import LeaseCore
    from latchkey.stores.base import Backend

T = TypeVar("T")
log = logging.getLogger("latchkey")


def run(steps: Steps[T], backend: Backend) -> T:
    """Run ``steps`` to its end, doing each operation it yields; return its value. An error
    raised by an operation is thrown into the generator (so its ``finally`` can clean up)."""
    value: Any = None
    error: BaseException | None = None
    timer = _observe.timer  # store round trips are timed while metrics are on
    while True:
        try:
            op = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            kind, target, method, args = op
            if kind == CALL:  # the common case, inline
                if timer is None or target is not None:  # a waiter's wait is no round trip
                    value = getattr(backend if target is None else target, method)(*args)
                else:
                    started = perf_counter()
                    try:
                        value = getattr(backend, method)(*args)
                    finally:
                        timer(backend, method, perf_counter() - started)
            else:
                value = _do(kind, target, args, backend)
        except BaseException as exc:
            value, error = None, exc


def _do(kind: int, target: Any, args: tuple[Any, ...], backend: Backend) -> Any:
    if kind == SLEEP:
        time.sleep(max(0.0, args[0]))
        return None
    if kind == USER:
        return target(*args)
    if kind == RENEW:
        target._renewer = Renewer(target, backend)
        return None
    if kind == UNRENEW:
        lease = target
        renewer, lease._renewer = lease._renewer, None
        if renewer is not None:
            renewer.stop()
        return None
    if kind == BACKGROUND:
        threading.Thread(
            target=_quietly, args=(target, backend), name="latchkey-give-back", daemon=True
        ).start()
        return None
    raise AssertionError(f"unknown operation {kind!r}")


def _quietly(steps: Steps[Any], backend: Backend) -> None:
    try:
        run(steps, Closed(backend))  # type: ignore[arg-type]
    except Exception:  # a give-back that fails: the lease ends by its TTL as it would have
        log.debug("giving back in the background failed", exc_info=True)


class Closed:
    """A backend as a background give-back sees it: once the store is closed, every call
    raises, which ends the give-back (it opens no connection on a closed store)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        if getattr(self._backend, "latchkey_closed", False):
            raise LatchkeyError("the store was closed")
        return getattr(self._backend, name)


def _stopper(stop: threading.Event) -> Callable[[object], None]:
    """A weakref callback that sets ``stop`` (and holds nothing else)."""
    return lambda _ref: stop.set()


class Renewer:
    """The background renewer of a ``renew=True`` lease: one daemon thread that runs the
    lease's renewal step (``LeaseCore._renew_step``) every third of the lease the store granted
    (``LeaseCore._renew_interval``: the TTL, or less) until it is stopped or the lease is lost.
    It holds only a weak reference to the lease, so a forgotten lock object is not kept alive
    by its renewer, and its collection stops the thread. Stopping it (a release) does not wait
    for a renewal in flight: a release against a stalled server would otherwise take that
    renewal's timeout and then its own; the renewal's answer is dropped (``_renew_step``)."""

    def __init__(self, lease: LeaseCore, backend: Backend) -> None:
        self._stop = threading.Event()
        self._busy = False  # inside a renewal step (a store call)
        self._ref = weakref.ref(lease, _stopper(self._stop))
        self._backend = backend
        self._thread = threading.Thread(
            target=self._run,
            args=(lease._renew_interval(),),
            name=f"latchkey-renew:{lease.name[:40]}",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # Idle, it ends at once: wait for that. In a renewal, it ends when its call returns.
        if threading.current_thread() is not self._thread and not self._busy:
            self._thread.join(timeout=5)

    def _run(self, delay: float) -> None:
        while not self._stop.wait(delay):
            lease = self._ref()
            if lease is None:
                return
            self._busy = True
            if self._stop.is_set():  # stopped between the wait and the flag: stop() joins
                return
            try:
                next_delay = run(lease._renew_step(), self._backend)
            finally:
                self._busy = False
                del lease
            if next_delay is None:
                return
            delay = next_delay
