"""The background renewer for ``renew=True`` leases.

One daemon thread per renewing lease. It holds only a weak reference to its lease, so a
forgotten lock object is not kept alive by its renewer; it extends the lease every ttl/3 and,
when an extend says the lease is gone or the local deadline passes without a successful
extend, marks the lease lost and stops.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from latchkey.errors import LatchkeyError, LockLost

log = logging.getLogger("latchkey")


class Renewable(Protocol):
    name: str

    def _renew_once(self) -> float:
        """Extend the lease; return seconds until the next renewal. Raises LockLost or
        StoreUnavailable."""

    def _mark_lost(self, reason: str) -> None: ...

    def _seconds_left(self) -> float: ...


def _stopper(stop: threading.Event) -> Callable[[object], None]:
    """A weakref callback that sets ``stop`` (and holds nothing else)."""
    return lambda _ref: stop.set()


class Renewer:
    def __init__(self, lease: Renewable, interval: float) -> None:
        self._stop = threading.Event()
        # A lease collected while held (its object forgotten) stops its renewer at once.
        self._ref = weakref.ref(lease, _stopper(self._stop))
        self._interval = interval
        self._thread = threading.Thread(
            target=self._run, name=f"latchkey-renew:{lease.name[:40]}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = self._interval
        while not self._stop.wait(delay):
            lease = self._ref()
            if lease is None:
                return
            try:
                delay = lease._renew_once()
            except LockLost as exc:
                lease._mark_lost(str(exc))
                return
            except LatchkeyError as exc:  # StoreUnavailable and the like: retry while time is left
                left = lease._seconds_left()
                if left <= 0:
                    lease._mark_lost(f"could not renew before the lease ended: {exc}")
                    return
                log.warning("renewing %r failed, retrying: %s", lease.name, exc)
                delay = min(self._interval, max(left / 4, 0.05))
            finally:
                del lease
