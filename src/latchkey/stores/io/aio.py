"""The shared I/O layer, asyncio flavour: the twin of :mod:`latchkey.stores.io`.

:func:`adrive` runs the same store generators as :func:`~latchkey.stores.io.drive`, each
request awaited; :class:`AsyncDriver` is the asyncio driver's contract; :class:`AsyncPool`
keeps connections for one event loop. A call is bounded by the store's timeout
(:func:`bounded`), and a connection that was cancelled or timed out mid-call is closed,
never reused (its protocol state is unknown).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Steps
from latchkey.stores.io.watchdog import shut_down

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")
C = TypeVar("C")


async def adrive(steps: Steps[T], answer: Callable[[Any], Awaitable[Any]]) -> T:
    """:func:`latchkey.stores.io.drive` with each request awaited."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, error = await answer(request), None
        except BaseException as exc:  # thrown into the store's generator
            value, error = None, exc


if sys.version_info >= (3, 11):
    # One timer per event loop for every call in it, not one per call (asyncio.timeout's):
    # see the module's docstring for what that saves.
    from latchkey.stores.io.deadlines import bounded as bounded

else:  # pragma: no cover - 3.10

    async def bounded(aw: Awaitable[T], seconds: float, start: float | None = None) -> T:
        if start is not None:
            seconds -= asyncio.get_running_loop().time() - start
        return await asyncio.wait_for(aw, max(seconds, 0.0))


async def awoken(event: asyncio.Event, timeout: float) -> bool:
    """The asyncio twin of ``stores.base.woken``: wait up to ``timeout`` seconds for
    ``event``; whether it was set, clearing it then. Read from the event after the wait, never
    from how the wait ended: a timed wait can end by its timer with the event set (at once
    with a timeout of 0, or when the timer and the set fall in one turn of the loop), and
    clearing it then lost the wake-up. No set can come between the read and the clear (one
    thread, no await)."""
    if not event.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await bounded(event.wait(), max(0.0, timeout))
    woke = event.is_set()
    event.clear()
    return woke


#: The primitives (``AsyncDriver.run``'s and ``AsyncPinned.run``'s ``action``) that may grant
#: a lease: drivers whose server runs a statement on after its connection is dropped run these
#: :func:`to_the_end`, and so does every pinned connection (a lease batch of rows).
GRANTING = frozenset({"acquire", "claim", "lease rows"})


async def to_the_end(request: Awaitable[T]) -> T:
    """Await a request that may grant leases; if the caller is cancelled meanwhile, let the
    request finish first (the driver's timeout bounds it), then pass the cancellation on.

    After a cancellation the core releases what the owner may hold. Were the request dropped
    mid-flight instead, its connection closed, the server could still run it *after* that
    release, which then finds nothing, and the lease would stay held until its TTL.
    """
    task = asyncio.ensure_future(request)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the caller gets the cancellation
        raise


async def cut_after(aw: Awaitable[T], seconds: float, fd: int) -> T:
    """Await ``aw``, a call on the socket ``fd``; ``seconds`` later, if it is still running,
    shut the socket down (the call fails by itself, at once) and raise TimeoutError — also when
    it answered just then: the connection is gone. Unlike :func:`bounded` it never cancels
    the call: psycopg answers a cancellation by asking the server to cancel the statement and
    waiting up to ten seconds for that, which a frozen server never grants."""
    cut: list[bool] = []

    def expire() -> None:
        cut.append(True)
        with contextlib.suppress(OSError):
            shut_down(fd)

    handle = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        result = await aw
    except BaseException:
        if cut:
            raise TimeoutError(f"no answer within {seconds:g}s") from None
        raise
    finally:
        handle.cancel()
    if cut:
        raise TimeoutError(f"no answer within {seconds:g}s")
    return result


class AsyncDriver(abc.ABC):
    """One store's connection(s) to its server, asyncio: :class:`~latchkey.stores.io.Driver`
    with every request awaited."""

    errors: ClassVar[tuple[type[BaseException], ...]] = (OSError, asyncio.TimeoutError)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        self.backend = backend
        self.store = store

    @abc.abstractmethod
    async def answer(self, request: Any) -> Any:
        """Carry out one request."""

    async def run(self, steps: Steps[T], action: str) -> T:
        """Run a store primitive; a driver error becomes StoreUnavailable naming ``action``."""
        try:
            return await adrive(steps, self.answerer())
        except StoreUnavailable:
            raise
        except self.errors as exc:
            self.backend.unavailable(exc, action)

    def answerer(self) -> Callable[[Any], Awaitable[Any]]:
        """What answers the requests of one primitive (see
        :meth:`latchkey.stores.io.Driver.answerer`)."""
        return self.answer

    async def aclose(self) -> None:  # noqa: B027 - a driver with nothing to close
        """Release every connection."""


class AsyncPool(Generic[C]):
    """:class:`latchkey.stores.io.Pool` for one event loop: ``open``/``close``/``alive`` are
    coroutine functions; a caller cancelled while it holds a connection closes it."""

    def __init__(
        self,
        open: Callable[[], Awaitable[C]],
        close: Callable[[C], Awaitable[None]],
        *,
        alive: Callable[[C], Awaitable[bool]] | None = None,
        keep: Callable[[Exception], bool] | None = None,
        size: int = 8,
        check_after: float = 0.0,
    ) -> None:
        self._open, self._close, self._alive, self._keep = open, close, alive, keep
        self.size = size
        self.check_after = check_after
        self._idle: list[tuple[C, float]] = []
        self._busy: dict[int, int] = {}
        self._generation = 0
        self._freed: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self._freed is None:
            self._freed = asyncio.Condition()
        return self._freed

    async def get(self, timeout: float) -> C:
        """An idle connection, or a new one; waits up to ``timeout`` when ``size`` are busy."""
        cond = self._cond()
        if not self._idle and len(self._busy) >= self.size:
            async with cond:
                await bounded(
                    cond.wait_for(lambda: bool(self._idle) or len(self._busy) < self.size),
                    timeout,
                )
        generation = self._generation
        while self._idle:
            conn, since = self._idle.pop()
            self._busy[id(conn)] = generation
            if self._alive is None or time.monotonic() - since < self.check_after:
                return conn
            try:
                if await self._alive(conn):
                    return conn
            except BaseException:
                await self.discard(conn)
                raise
            await self.discard(conn)
        place = object()  # this opener's place, taken before the await (one per opener)
        self._busy[id(place)] = generation
        try:
            conn = await self._open()
        except BaseException:
            self._busy.pop(id(place), None)
            await self._notify()
            raise
        self._busy.pop(id(place), None)
        self._busy[id(conn)] = generation
        return conn

    async def _notify(self) -> None:
        cond = self._cond()
        async with cond:
            cond.notify()

    async def put(self, conn: C) -> None:
        generation = self._busy.pop(id(conn), None)
        if generation == self._generation:
            self._idle.append((conn, time.monotonic()))
        else:
            await self._close(conn)
        await self._notify()

    async def discard(self, conn: C) -> None:
        self._busy.pop(id(conn), None)
        try:
            await self._close(conn)
        finally:
            await self._notify()

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float) -> AsyncIterator[C]:
        conn = await self.get(timeout)
        try:
            yield conn
        except Exception as exc:
            if self._keep is not None and self._keep(exc):
                await self.put(conn)
            else:
                await self.discard(conn)
            raise
        except BaseException:  # cancelled mid-call: the protocol state is unknown
            await asyncio.shield(self.discard(conn))
            raise
        await self.put(conn)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        self._generation += 1
        for conn, _ in idle:
            await self._close(conn)


class AsyncPinned:
    """:class:`latchkey.stores.io.Pinned` for asyncio: one connection held across calls, each
    request awaited (``answer``), each call bounded by the store's timeout; ``give_back`` is
    a coroutine function."""

    def __init__(
        self,
        driver: AsyncDriver,
        conn: Any,
        answer: Callable[[Any], Awaitable[Any]],
        give_back: Callable[[Any, bool], Awaitable[None]],
        user_error: Callable[[BaseException], bool],
        bound: bool = True,
    ) -> None:
        self.driver, self.conn = driver, conn
        self._answer, self._give_back, self._user_error = answer, give_back, user_error
        #: Whether each call is bounded here (False: the driver bounds every statement itself,
        #: as psycopg's must — a cancellation there waits for a server-side cancel).
        self._bound = bound
        self.broken = False

    async def run(self, steps: Steps[T], action: str, user: bool = False) -> T:
        """The steps on this connection, bounded by the timeout. One that may grant
        (``GRANTING``: a lease of rows) runs to its end if its caller is cancelled, so that
        the give-back that follows finds what it leased (dropped mid-statement, the server
        could commit it after that give-back)."""
        if action in GRANTING:
            return await to_the_end(self._run(steps, action, user))
        return await self._run(steps, action, user)

    async def _run(self, steps: Steps[T], action: str, user: bool) -> T:
        if self.conn is None:
            raise StoreUnavailable(f"{action}: the connection was already given back")
        try:
            if not self._bound:
                return await adrive(steps, self._answer)
            return await bounded(adrive(steps, self._answer), self.driver.backend.timeout)
        except StoreUnavailable:
            self.broken = True
            raise
        except self.driver.errors as exc:
            if user and self._user_error(exc):
                raise
            self.broken = True
            self.driver.backend.unavailable(exc, action)
        except BaseException:  # cancelled mid-statement: the protocol state is unknown
            self.broken = True
            raise

    async def release(self, reuse: bool) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            await asyncio.shield(self._give_back(conn, reuse and not self.broken))
