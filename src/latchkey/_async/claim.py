"""AsyncClaim: the asyncio shell over the batch-claim rules (:mod:`latchkey._core.claim`)."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from latchkey._async._run import arun
from latchkey._core.claim import ClaimCore

if TYPE_CHECKING:
    from latchkey._async.store import AsyncStore


class AsyncClaim(ClaimCore):
    """A batch claim, for asyncio: ``async with store.claim(names, ttl=…) as claim`` (or
    ``claim = await store.claim(…)``) takes every free name at once; the context releases
    what is left. Same attributes as :class:`latchkey.Claim`.

    .. versionadded:: 0.2
    """

    def __init__(
        self, store: AsyncStore, names: Iterable[str], *, ttl: float, metadata: Mapping[str, Any]
    ) -> None:
        super().__init__(store, names, ttl=ttl, metadata=metadata)
        self._taken = False

    async def _ensure_taken(self) -> AsyncClaim:
        if not self._taken:
            self._taken = True
            await arun(self._take(), self.store.backend)
        return self

    def __await__(self) -> Generator[Any, None, AsyncClaim]:
        return self._ensure_taken().__await__()

    async def release(self, name: str) -> bool:
        """Release one acquired name; True if its lease was still live."""
        return await arun(self._release(name), self.store.backend)

    async def release_all(self) -> int:
        """Release every name still held, in a constant number of round trips."""
        return await arun(self._release_all(), self.store.backend)

    async def __aenter__(self) -> AsyncClaim:
        return await self._ensure_taken()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release_all()
