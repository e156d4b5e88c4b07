"""``sqlite://`` for asyncio: the same file and statements as :mod:`latchkey.stores.sqlite`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import AsyncBackend
from latchkey.stores.sqlite import SQLiteBackend

T = TypeVar("T")


class AsyncSQLiteBackend(AsyncBackend):
    """The same file for asyncio. sqlite3 has no non-blocking interface (every asyncio SQLite
    library, aiosqlite included, runs it on a thread), so each primitive runs on one worker
    thread that this backend owns: the loop never blocks on the database, and a waiting
    coroutine holds no thread (waits are the core's sleeps, in the loop)."""

    scheme = SQLiteBackend.scheme
    capabilities = SQLiteBackend.capabilities
    options = SQLiteBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self._sync = SQLiteBackend(url)
        self._thread: ThreadPoolExecutor | None = None

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="latchkey-sqlite")
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        return await self._on_thread(self._sync.acquire, name, owner, owner_info, ttl, limit)

    async def release(self, name: str, owner: str) -> bool:
        return await self._on_thread(self._sync.release, name, owner)

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        return await self._on_thread(self._sync.extend, name, owner, ttl)

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        return await self._on_thread(self._sync.claim, names, owner, owner_info, ttl)

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        return await self._on_thread(self._sync.release_many, names, owner)

    async def inspect(self, name: str) -> LockInfo | None:
        return await self._on_thread(self._sync.inspect, name)

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        for info in await self._on_thread(lambda: [*self._sync.list(prefix)]):
            yield info

    async def force_release(self, name: str) -> bool:
        return await self._on_thread(self._sync.force_release, name)

    async def purge_expired(self) -> int:
        return await self._on_thread(self._sync.purge_expired)

    async def record_get(self, name: str) -> tuple[str | None, int]:
        return await self._on_thread(self._sync.record_get, name)

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        return await self._on_thread(self._sync.record_set, name, value, version)

    async def record_delete(self, name: str, version: int) -> bool:
        return await self._on_thread(self._sync.record_delete, name, version)

    async def now(self) -> datetime:
        return await self._on_thread(self._sync.now)

    async def init(self) -> None:
        await self._on_thread(self._sync.init)

    async def aclose(self) -> None:
        if self._thread is not None:
            await self._on_thread(self._sync.close)
            self._thread.shutdown(wait=False)
            self._thread = None
