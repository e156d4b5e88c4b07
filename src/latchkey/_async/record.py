"""AsyncRecord: the asyncio shell over the versioned-record rules
(:mod:`latchkey._core.record`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from latchkey._async._run import arun
from latchkey._core.record import RecordCore

if TYPE_CHECKING:
    from latchkey._async.store import AsyncStore


class AsyncRecord(RecordCore):
    """A JSON value with a version, for asyncio; the twin of :class:`latchkey.Record`.

    .. versionadded:: 0.2
    """

    store: AsyncStore

    async def get(self) -> tuple[Any, int]:
        return await arun(self._get(), self.store.backend)

    async def set(self, value: Any, *, version: int) -> int:
        """Write ``value`` if the record is still at ``version`` (0: absent); return the new
        version."""
        return await arun(self._set(value, version), self.store.backend)

    async def delete(self, *, version: int) -> None:
        """Delete the record if it is still at ``version``; raise :class:`Conflict` if not."""
        await arun(self._delete(version), self.store.backend)

    async def update(self, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read, apply ``fn`` (sync or async), write back; retry on a conflict. Returns the
        value written."""
        return await arun(self._update(fn, retries), self.store.backend)
