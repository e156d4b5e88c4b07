"""etcd v3 over its JSON gateway with ``httpx.AsyncClient``: the asyncio driver of ``etcd://``.

The twin of :mod:`latchkey.stores.io.etcd`: the same requests and endpoints, awaited; the
client's connections are the loop's and nothing runs on a thread. Every call is bounded by the
URL's ``timeout`` (httpx's connect, read, write and pool timeouts). A request is not dropped
half-way when its caller is cancelled: it finishes first (bounded by the same timeout), so
that the core's release after the cancellation reaches etcd after whatever the request
granted (see :func:`~latchkey.stores.io.aio.to_the_end`). The watch is a plain HTTP/1.1
stream on a connection of its own (``asyncio.open_connection``), read with a deadline per
wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from latchkey.stores.base import AsyncWaiter
from latchkey.stores.io.aio import AsyncDriver, awoken, to_the_end
from latchkey.stores.io.etcd import (
    ERRORS,
    NOT_SENT,
    UNANSWERED,
    Endpoints,
    Post,
    StreamParser,
    Watch,
    deletions,
    endpoints,
    is_created,
    left_until,
    reply_of,
    timeouts,
    watch_request,
)

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase


class AsyncEtcdDriver(AsyncDriver):
    errors = (*ERRORS, asyncio.TimeoutError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.endpoints = Endpoints(endpoints(backend))
        self.timeout = backend.timeout
        self._client: httpx.AsyncClient | None = None
        self.hub = AsyncWatchHub()

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=timeouts(self.timeout), limits=httpx.Limits(max_connections=32)
            )
        return self._client

    def answerer(self) -> Callable[[Any], Awaitable[Any]]:
        """A primitive — several requests, some of them — runs within one timeout in all."""
        deadline = time.monotonic() + self.timeout
        return lambda request: self.answer(request, deadline)

    async def answer(self, request: Any, deadline: float | None = None) -> Any:
        left = self.timeout if deadline is None else left_until(deadline)
        if type(request) is Post:
            return await to_the_end(self.post(request, left))
        return await self.watch(request, left)

    async def post(self, request: Post, left: float) -> dict[str, Any]:
        client, error = self.client(), None
        for base, time_left in self.endpoints.tries(left):
            try:
                response = await client.post(
                    base + request.path, json=request.body, timeout=timeouts(time_left)
                )
            except NOT_SENT as exc:
                error = exc
                continue
            except UNANSWERED:
                self.endpoints.unanswered(base)
                raise
            self.endpoints.answered(base)
            return reply_of(response)
        assert error is not None
        raise error

    async def watch(self, request: Watch, left: float) -> AsyncWaiter:
        shared = self.hub.get(request)
        if shared is not None:
            return AsyncDeleteWaiter(self.hub, request, shared)
        error: BaseException | None = None
        for base, time_left in self.endpoints.tries(left):
            try:
                stream = await AsyncWatchStream.open(base, request, time_left)
            except (OSError, asyncio.TimeoutError) as exc:
                error = exc
                self.endpoints.unanswered(base)  # the next request starts elsewhere too
                continue
            return AsyncDeleteWaiter(self.hub, request, self.hub.add(request, stream))
        assert error is not None
        raise error

    async def aclose(self) -> None:
        self.hub.close()
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


class AsyncWatchStream:
    """:class:`latchkey.stores.io.etcd.WatchStream` on asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = StreamParser()

    @classmethod
    async def open(cls, base: str, request: Watch, timeout: float) -> AsyncWatchStream:
        host, port, payload = watch_request(base, request)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        stream = cls(reader, writer)
        try:
            writer.write(payload)
            await asyncio.wait_for(writer.drain(), timeout)
            if not await stream.read_until(is_created, time.monotonic() + timeout):
                raise TimeoutError(f"etcd did not confirm a watch within {timeout:g}s")
        except BaseException:
            stream.close()
            raise
        return stream

    async def read_until(self, found: Callable[[dict[str, Any]], bool], deadline: float) -> bool:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except asyncio.TimeoutError:
                return False
            messages = self.parser.feed(data)
            if any(found(m) for m in messages):
                return True
            if self.parser.ended:
                raise OSError("etcd closed the watch")

    def close(self) -> None:
        self.writer.close()


class AsyncSharedWatch:
    """:class:`latchkey.stores.io.etcd.SharedWatch` in the loop: one watch per name, read by
    a task; each DELETE event wakes the one waiter that has waited longest."""

    def __init__(self, stream: AsyncWatchStream) -> None:
        self.stream = stream
        self.line: list[asyncio.Event] = []
        self.broken = False
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        parser = self.stream.parser
        try:
            while not parser.ended:
                self.wake(deletions(parser.feed(await self.stream.reader.read(65536))))
        except (OSError, ValueError):
            pass
        finally:
            self.broken = True
            for event in self.line:
                event.set()

    def wake(self, count: int) -> None:
        for event in self.line:
            if count <= 0:
                break
            if not event.is_set():
                event.set()
                count -= 1

    def leave(self, event: asyncio.Event) -> bool:
        self.line.remove(event)
        if event.is_set() and not self.broken:
            self.wake(1)  # a wake-up not taken goes to the next in line
        return not self.line

    def close(self) -> None:
        self.task.cancel()
        self.stream.close()


class AsyncDeleteWaiter(AsyncWaiter):
    """A place in an :class:`AsyncSharedWatch`'s line."""

    def __init__(self, hub: AsyncWatchHub, key: Watch, shared: AsyncSharedWatch) -> None:
        self.hub, self.key, self.shared = hub, key, shared
        self.event: asyncio.Event | None = asyncio.Event()
        shared.line.append(self.event)

    async def wait(self, timeout: float) -> bool:
        event = self.event
        if event is None or self.shared.broken:
            await asyncio.sleep(max(0.0, timeout))  # the watch broke: poll
            return False
        return await awoken(event, timeout) and not self.shared.broken

    async def close(self) -> None:
        event, self.event = self.event, None
        if event is not None:
            self.hub.leave(self.key, self.shared, event)


class AsyncWatchHub:
    """The shared watches of one asyncio driver, by watched range."""

    def __init__(self) -> None:
        self.watches: dict[Watch, AsyncSharedWatch] = {}

    def get(self, key: Watch) -> AsyncSharedWatch | None:
        shared = self.watches.get(key)
        return None if shared is None or shared.broken else shared

    def add(self, key: Watch, stream: AsyncWatchStream) -> AsyncSharedWatch:
        shared = self.get(key)
        if shared is not None:  # another coroutine opened one meanwhile
            stream.close()
            return shared
        shared = self.watches[key] = AsyncSharedWatch(stream)
        return shared

    def leave(self, key: Watch, shared: AsyncSharedWatch, event: asyncio.Event) -> None:
        if shared.leave(event):
            if self.watches.get(key) is shared:
                del self.watches[key]
            shared.close()

    def close(self) -> None:
        watches, self.watches = self.watches, {}
        for shared in watches.values():
            shared.close()
