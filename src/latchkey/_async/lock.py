"""AsyncLock and AsyncSemaphore: the asyncio shell over the lease rules
(:mod:`latchkey._core.lease`), the twins of :class:`latchkey.Lock` and
:class:`latchkey.Semaphore`."""

from __future__ import annotations

from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING

from latchkey import _observe
from latchkey._async._run import AsyncRenewer, arun
from latchkey._core.lease import UNSET, LeaseCore, after_failure
from latchkey._core.ops import call
from latchkey._durations import Duration
from latchkey._types import Grant

if TYPE_CHECKING:
    from latchkey._async.store import AsyncStore


class AsyncLock(LeaseCore):
    """A leased mutex, for asyncio. ``async with`` it, or await :meth:`acquire` and
    :meth:`release`. ``token``, ``expires_at``, ``lost`` and ``check()`` need no await.

    A waiting ``acquire()`` holds no thread; cancelling it leaves nothing held. With
    ``renew=True`` the lease is renewed by a task in the running loop.

    .. versionadded:: 0.2
    """

    store: AsyncStore

    async def acquire(self, wait: Duration | None = UNSET) -> bool:
        """Take the lease. Waits up to ``wait`` (default: the lock's own; None: forever).

        Returns True when acquired, False when still busy after the wait. Raises
        :class:`~latchkey.errors.StoreUnavailable` when the store fails, never False for that.
        """
        backend = self._backend
        if _observe.hooks is not None:  # (None also while no store call is timed)
            return await arun(self._acquire(wait), backend)
        # The direct path, as the sync Lock's: the core's acquire composed of its parts
        # without driving its generator (``LeaseCore._acquire_steps`` is the same, as steps).
        attempt = wait_s, args = self._attempt(wait)
        if not self._asks_store_first(wait_s):
            return await arun(self._acquire_steps(wait, attempt), backend)
        sent = monotonic()
        try:
            result = await backend.acquire(*args)
        except BaseException as exc:  # cancelled included: given back at once, as steps do
            undo = call("release", self.name, args[1])
            return await arun(after_failure(exc, undo, self.ttl), backend)
        if type(result) is not Grant and wait_s != 0:
            result, sent = await arun(self._wait_more(result, args, sent, wait_s), backend)
        if not self._took(result, args, sent):
            return False
        if self.renew:
            self._renewer = AsyncRenewer(self, backend)
        return True

    async def release(self) -> bool:
        """End the lease. True if it was still live in the store; False if it had already
        expired or was taken from us (and then nothing is touched)."""
        owner = self._owner
        if owner is None or self._renewer is not None or _observe.hooks is not None:
            return await arun(self._release(), self._backend)
        # The direct path, as acquire's: ``LeaseCore._release_steps`` without its generator.
        if self._hold is not None:  # before the release: a waiter it wakes must not find it
            self._unhold()
        try:
            return await self._backend.release(self.name, owner)  # type: ignore[no-any-return]
        finally:
            self._forget()

    async def extend(self, ttl: Duration | None = None) -> None:
        """Make the lease end ``ttl`` from now (default: the lock's TTL). Only the holder can.

        Raises :class:`LockLost` if the lease already ended (by our clock or the store's).
        """
        await arun(self._extend(ttl), self._backend)

    async def _finish(self, keep: float) -> bool:
        return await arun(self._end(keep), self._backend)

    async def __aenter__(self) -> AsyncLock:
        if not await self.acquire():  # (``LeaseCore._enter``, on the direct path)
            raise self._timeout_error(self.wait)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class AsyncSemaphore(AsyncLock):
    """One slot of a counting semaphore, for asyncio. Same interface as :class:`AsyncLock`.

    .. versionadded:: 0.2
    """

    kind = "semaphore"
