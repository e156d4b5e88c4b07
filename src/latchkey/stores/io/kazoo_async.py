"""ZooKeeper through kazoo, asyncio flavour: the twin of :mod:`latchkey.stores.io.kazoo`.

kazoo has no asyncio API, but its ``*_async`` methods are its native non-blocking API: each
queues one request on the session's own I/O thread and returns an ``IAsyncResult`` at once.
This driver hands each result a ``rawlink`` callback that, on kazoo's thread, passes the
answer to the event loop with ``loop.call_soon_threadsafe`` — so a waiting coroutine holds no
thread, and nothing blocking is wrapped in a thread. (``aiozk``, the asyncio-native client,
was not chosen: it has had no release since 2021 and far fewer users; kazoo is the client tooz
and most Python ZooKeeper users run, and both drivers then share one session code and one
set of requests.) The session is kazoo's thread, shared with nothing else: starting it
returns at once, and its connection is awaited through a state listener.

Watches are bridged the same way: a waiter's ``wake`` sets an :class:`asyncio.Event` through
``call_soon_threadsafe``. Closing stops the kazoo client on a short-lived thread of its own
(kazoo's ``stop`` waits for its I/O thread), awaited no longer than the store's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient, KazooState
from kazoo.handlers.threading import KazooTimeoutError

from latchkey._types import Grant
from latchkey.stores.base import AsyncWaiter
from latchkey.stores.io.aio import AsyncDriver, awoken, bounded
from latchkey.stores.io.kazoo import (
    ERRORS,
    OUTCOMES,
    Batch,
    NewWaiter,
    Session,
    abandon,
    issue,
)

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.zookeeper import ZooKeeper


#: Batches sent on one session at once (see ``AsyncKazooDriver._in_flight``).
IN_FLIGHT = 32


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():
        return
    try:
        future.set_result(result.get_nowait())
    except OUTCOMES as exc:
        future.set_result(exc)
    except BaseException as exc:
        future.set_exception(exc)


def bridge(result: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
    """An asyncio future settled (in ``loop``) with a kazoo IAsyncResult's answer; the store's
    outcomes (:data:`OUTCOMES`) as values."""
    future: asyncio.Future[Any] = loop.create_future()

    def done(result: Any) -> None:  # on kazoo's thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(_settle, future, result)

    result.rawlink(done)
    return future


class AsyncKazooDriver(AsyncDriver):
    """Answers each Batch with every operation queued at once and its answers awaited."""

    errors = (*ERRORS, asyncio.TimeoutError)

    def __init__(self, backend: BackendBase, store: ZooKeeper) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        self.session = Session(store)
        self._slots: asyncio.Semaphore | None = None

    def _in_flight(self) -> asyncio.Semaphore:
        """At most :data:`IN_FLIGHT` batches on the session at once; the others wait their
        turn in the loop (first come, first served) before their timeout starts. A thousand
        waiters' first attempts sent at once overran the session (the server dropped the
        connection, kazoo's reconnect gave up)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(IN_FLIGHT)
        return self._slots

    async def client(self) -> KazooClient:
        """A started client; the first time, await its connection (a state listener)."""
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[None] = loop.create_future()

        def listen(state: Any) -> bool:  # on kazoo's thread; True: remove the listener
            if state == KazooState.CONNECTED:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_connected, connected)
                return True
            return False

        client, _ = self.session.started()
        if client.connected:
            return client
        client.add_listener(listen)
        try:
            if not client.connected:
                await bounded(asyncio.shield(connected), self.timeout)
        except asyncio.TimeoutError:
            raise KazooTimeoutError(f"no ZooKeeper session within {self.timeout:g}s") from None
        finally:
            client.remove_listener(listen)
        return client

    def answerer(self) -> Callable[[Any], Awaitable[Any]]:
        """A primitive — one batch or several — runs within one timeout in all, counted from
        when its first batch gets a slot (:meth:`_in_flight`)."""
        deadline: list[float] = []
        return lambda request: self.answer(request, deadline)

    async def answer(self, request: Any, deadline: list[float] | None = None) -> Any:
        if type(request) is Batch:
            async with self._in_flight():
                left = self.timeout
                if deadline is not None:
                    if not deadline:
                        deadline.append(time.monotonic() + self.timeout)
                    left = deadline[0] - time.monotonic()
                    if left <= 0:
                        raise KazooTimeoutError(
                            f"no time left within the timeout ({self.timeout:g}s)"
                        )
                return await bounded(self._batch(request), left)
        if type(request) is NewWaiter:
            return AsyncLineWaiter(self, request.name, request.owner)
        raise TypeError(f"not a ZooKeeper request: {request!r}")

    async def _batch(self, request: Batch) -> list[Any]:
        client = await self.client()
        loop = asyncio.get_running_loop()
        results = [issue(client, op) for op in request.ops]
        try:
            return list(await asyncio.gather(*(bridge(r, loop) for r in results)))
        except BaseException:  # failed, timed out or cancelled: no late node stays behind
            abandon(client, request.ops, results)
            raise

    async def aclose(self) -> None:
        client = self.session.detach()
        if client is None:
            return
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()

        def stop() -> None:
            with contextlib.suppress(Exception):
                client.stop()
                client.close()
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_connected, stopped)

        threading.Thread(target=stop, name="latchkey-kazoo-stop", daemon=True).start()
        with contextlib.suppress(asyncio.TimeoutError):
            await bounded(asyncio.shield(stopped), self.timeout)


def _connected(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AsyncLineWaiter(AsyncWaiter):
    """:class:`latchkey.stores.io.kazoo.LineWaiter` for asyncio: ``wake`` (called on kazoo's
    thread) sets an asyncio.Event in the waiter's loop."""

    def __init__(self, driver: AsyncKazooDriver, name: str, owner: str) -> None:
        self.driver, self.name, self.owner = driver, name, owner
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self.granted = False
        self.finished = False  # finish() is not called when the wait ends by an error

    def wake(self, _event: Any = None) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.event.set()
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> bool:
        return await awoken(self.event, timeout)

    async def finish(self, result: Any) -> None:
        self.granted = isinstance(result, Grant)
        self.finished = True

    async def close(self) -> None:
        steps = self.driver.store.leave_line(
            self.name, self.owner, self.granted, delete=self.finished
        )
        with contextlib.suppress(Exception):  # best effort: the node lapses after its TTL
            await self.driver.run(steps, "leave the line")
