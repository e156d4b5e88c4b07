"""Lock and Semaphore, the sync shell over the lease rules (:mod:`latchkey._core.lease`)."""

from __future__ import annotations

from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING

from latchkey import _observe
from latchkey._core.lease import UNSET, LeaseCore, after_failure, describe_holder, drift_margin
from latchkey._core.ops import call
from latchkey._durations import Duration
from latchkey._run import Renewer, run
from latchkey._types import Grant

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
        backend = self._backend
        if _observe.hooks is not None:  # (None also while no store call is timed)
            return run(self._acquire(wait), backend)
        # The direct path: the core's acquire composed of its parts without driving its
        # generator, while the first attempt is one plain store call and neither metrics nor
        # tracing watch (``LeaseCore._acquire_steps`` is the same composition as steps).
        attempt = wait_s, args = self._attempt(wait)
        if not self._asks_store_first(wait_s):
            return run(self._acquire_steps(wait, attempt), backend)
        sent = monotonic()
        try:
            result = backend.acquire(*args)
        except BaseException as exc:
            return run(after_failure(exc, call("release", self.name, args[1]), self.ttl), backend)
        if type(result) is not Grant and wait_s != 0:
            result, sent = run(self._wait_more(result, args, sent, wait_s), backend)
        if not self._took(result, args, sent):
            return False
        if self.renew:
            self._renewer = Renewer(self, backend)
        return True

    def release(self) -> bool:
        """End the lease. True if it was still live in the store; False if it had already
        expired or was taken from us (and then nothing is touched). Never raises for a lease
        that is not held; raises StoreUnavailable if the store cannot be asked."""
        owner = self._owner
        if owner is None or self._renewer is not None or _observe.hooks is not None:
            return run(self._release(), self._backend)
        # The direct path, as acquire's: ``LeaseCore._release_steps`` without its generator.
        if self._hold is not None:  # before the release: a waiter it wakes must not find it
            self._unhold()
        try:
            return self._backend.release(self.name, owner)  # type: ignore[no-any-return]
        finally:
            self._forget()

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
        if not self.acquire():  # (``LeaseCore._enter``, on the direct path)
            raise self._timeout_error(self.wait)
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
