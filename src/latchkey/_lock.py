"""Lock and Semaphore, the sync shell over the lease rules (:mod:`latchkey._core.lease`)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from latchkey._core.lease import UNSET, LeaseCore, describe_holder, drift_margin
from latchkey._durations import Duration
from latchkey._run import run

if TYPE_CHECKING:
    from latchkey._store import Store

__all__ = ["Lock", "Semaphore", "describe_holder", "drift_margin"]


class Lock(LeaseCore):
    """A leased mutex. Use it as a context manager, or call :meth:`acquire`/:meth:`release`.

    Created by :meth:`latchkey.Store.lock`; one object holds at most one lease at a time and
    may be acquired again after release. Its asyncio twin is :class:`latchkey.AsyncLock`.

    .. versionadded:: 0.1
    """

    store: Store

    def acquire(self, wait: Duration | None = UNSET) -> bool:
        """Take the lease. Waits up to ``wait`` (default: the lock's own; None: forever).

        Returns True when acquired, False when still busy after the wait. Raises
        :class:`~latchkey.errors.StoreUnavailable` when the store fails, never False for that.
        """
        return run(self._acquire(wait), self._backend)

    def release(self) -> bool:
        """End the lease. True if it was still live in the store; False if it had already
        expired or was taken from us (and then nothing is touched). Never raises for a lease
        that is not held; raises StoreUnavailable if the store cannot be asked."""
        return run(self._release(), self._backend)

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lease end ``ttl`` from now (default: the lock's TTL). Only the holder can.

        Raises :class:`LockLost` if the lease already ended (by our clock or the store's).
        """
        run(self._extend(ttl), self._backend)

    def _finish(self, keep: float) -> bool:
        """Release now, or keep the lease ``keep`` more seconds and let it expire in the store
        (``at_least``). False if the lease had already ended."""
        return run(self._end(keep), self._backend)

    def __enter__(self) -> Lock:
        run(self._enter(), self._backend)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Semaphore(Lock):
    """One slot of a counting semaphore: at most ``limit`` holders of a name at once, each
    with its own lease, owner and fencing token. Same interface as :class:`Lock`.

    .. versionadded:: 0.1
    """

    kind = "semaphore"
