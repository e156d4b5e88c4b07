"""Run the contract suite's sync test code against the asyncio API.

``SyncFacade`` presents an :class:`latchkey.AsyncStore` (and the locks, claims and records it
makes) with the sync API's shape: every awaited method is run as a coroutine on one event loop
in a background thread, and the calling test thread blocks on its result. Many test threads
can wait at once (they are many coroutines in that one loop), so the concurrency tests keep
their meaning. Decorated functions run on a worker thread of the loop (``asyncio.to_thread``),
so that they may call the store themselves.

This is a test device, not a way to use latchkey: applications await the async API directly.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import latchkey

T = TypeVar("T")


class LoopThread:
    """One event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="asyncmode", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("SyncFacade called from inside its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


_loop: LoopThread | None = None
_loop_guard = threading.Lock()


def loop_thread() -> LoopThread:
    global _loop
    with _loop_guard:
        if _loop is None:
            _loop = LoopThread()
        return _loop


async def _collect(items: Any) -> list[Any]:
    return [item async for item in items]


def _awaiting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A sync function given to an async decorator: run it off the loop, on a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    return call


class SyncFacade:
    """The sync API's shape over one async object (AsyncStore, AsyncLock, AsyncClaim,
    AsyncRecord)."""

    _WRAPPED = (
        "AsyncLock", "AsyncSemaphore", "AsyncClaim", "AsyncRecord",
        "AsyncRows", "AsyncTakeBatch", "AsyncLeaseBatch", "AsyncCompletion",
    )  # fmt: skip

    def __init__(self, target: Any, runner: LoopThread) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_runner", runner)

    def _wrap(self, value: Any) -> Any:
        if type(value).__name__ in self._WRAPPED:
            return SyncFacade(value, self._runner)
        return value

    def __getattr__(self, name: str) -> Any:
        target, runner = self._target, self._runner
        if name == "close" and isinstance(target, latchkey.AsyncStore):
            return lambda: runner.run(target.aclose())
        value = getattr(target, name)
        if name == "backend" and isinstance(target, latchkey.AsyncStore):
            return SyncFacade(value, runner)  # tests that call primitives directly
        if name == "list" and isinstance(target, latchkey.AsyncStore):
            return lambda *a, **k: iter(runner.run(_collect(value(*a, **k))))
        if name == "claim" and isinstance(target, latchkey.AsyncStore):
            return lambda *a, **k: self._wrap(runner.run(value(*a, **k)._ensure_taken()))
        if name in ("singleton", "locked") and isinstance(target, latchkey.AsyncStore):
            return self._decorator(value)
        if name == "update" and isinstance(target, latchkey.AsyncStore | latchkey.AsyncRecord):
            # update(name, fn) on a store, update(fn) on a record: fn comes last.
            return lambda *a, **k: runner.run(value(*a[:-1], _awaiting(a[-1]), **k))
        if inspect.iscoroutinefunction(value):
            return lambda *a, **k: self._wrap(runner.run(value(*a, **k)))
        if callable(value) and name in ("lock", "semaphore", "record", "rows", "take", "lease",
                                               "complete"):
            return lambda *a, **k: self._wrap(value(*a, **k))
        return value

    def _decorator(self, make: Callable[..., Any]) -> Callable[..., Any]:
        runner = self._runner

        def decorator_factory(*args: Any, **kwargs: Any) -> Callable[..., Any]:
            decorate = make(*args, **kwargs)

            def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
                wrapped = decorate(_awaiting(fn))

                @functools.wraps(fn)
                def call(*a: Any, **k: Any) -> Any:
                    return runner.run(wrapped(*a, **k))

                return call

            return apply

        return decorator_factory

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __enter__(self) -> Any:
        return self._wrap(self._runner.run(self._target.__aenter__()))

    def __exit__(self, *exc: Any) -> None:
        self._runner.run(self._target.__aexit__(*exc))

    def __iter__(self) -> Any:
        return iter(self._target)

    def __len__(self) -> int:
        return len(self._target)

    def __repr__(self) -> str:
        return repr(self._target)


def connect(url: str) -> Any:
    """``latchkey.connect(url)``'s twin for the async mode: a SyncFacade over
    ``latchkey.connect_async(url)``."""
    return SyncFacade(latchkey.connect_async(url), loop_thread())
