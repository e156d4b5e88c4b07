"""``memory://`` for asyncio: the same namespaces as :mod:`latchkey.stores.memory`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import AsyncBackend, AsyncWaiter
from latchkey.stores.io.aio import awoken
from latchkey.stores.memory import MemoryBackend


class _AsyncEventWaiter(AsyncWaiter):
    def __init__(self, event: asyncio.Event, unsubscribe: Callable[[], None]) -> None:
        self.event = event
        self._unsubscribe = unsubscribe

    async def wait(self, timeout: float) -> bool:
        return await awoken(self.event, timeout)

    async def close(self) -> None:
        self._unsubscribe()


class AsyncMemoryBackend(AsyncBackend):
    """The same namespaces for asyncio. Every primitive is a few dict operations under a
    lock held for microseconds, so it runs in the loop; releases from any thread or loop wake
    the waiters of this loop."""

    scheme = MemoryBackend.scheme
    capabilities = MemoryBackend.capabilities

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self._sync = MemoryBackend(url)

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        return self._sync.acquire(name, owner, owner_info, ttl, limit)

    async def release(self, name: str, owner: str) -> bool:
        return self._sync.release(name, owner)

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        return self._sync.extend(name, owner, ttl)

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        return self._sync.claim(names, owner, owner_info, ttl)

    async def inspect(self, name: str) -> LockInfo | None:
        return self._sync.inspect(name)

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        for info in self._sync.list(prefix):
            yield info

    async def force_release(self, name: str) -> bool:
        return self._sync.force_release(name)

    async def purge_expired(self, limit: int | None = None) -> int:
        return self._sync.purge_expired(limit)

    async def record_get(self, name: str) -> tuple[str | None, int]:
        return self._sync.record_get(name)

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        return self._sync.record_set(name, value, version)

    async def record_delete(self, name: str, version: int) -> bool:
        return self._sync.record_delete(name, version)

    async def subscribe(self, name: str) -> AsyncWaiter:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        return _AsyncEventWaiter(
            event, self._sync._listen(name, lambda: loop.call_soon_threadsafe(event.set))
        )

    async def now(self) -> datetime:
        return self._sync.now()
