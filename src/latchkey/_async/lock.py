"""AsyncLock and AsyncSemaphore: the asyncio shell over the lease rules
(:mod:`latchkey._core.lease`), the twins of :class:`latchkey.Lock` and
:class:`latchkey.Semaphore`."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from latchkey._async._run import arun
from latchkey._core.lease import UNSET, LeaseCore
from latchkey._durations import Duration

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
        return await arun(self._acquire(wait), self._backend)

    async def release(self) -> bool:
        """End the lease. True if it was still live in the store; False if it had already
        expired or was taken from us (and then nothing is touched)."""
        return await arun(self._release(), self._backend)

    async def extend(self, ttl: Duration | None = None) -> None:
        """Make the lease end ``ttl`` from now (default: the lock's TTL). Only the holder can.

        Raises :class:`LockLost` if the lease already ended (by our clock or the store's).
        """
        await arun(self._extend(ttl), self._backend)

    async def _finish(self, keep: float) -> bool:
        return await arun(self._end(keep), self._backend)

    async def __aenter__(self) -> AsyncLock:
        await arun(self._enter(), self._backend)
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
