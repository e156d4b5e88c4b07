"""The asyncio runner: drives a core generator (``latchkey._core``) by awaiting.

The twin of :mod:`latchkey._run`: a store primitive is awaited instead of called,
``asyncio.sleep`` replaces ``time.sleep``, and a renewer is a task instead of a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import weakref
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

from latchkey import _observe
from latchkey._core.ops import BACKGROUND, CALL, RENEW, SLEEP, UNRENEW, USER, Steps
from latchkey._run import Closed

if TYPE_CHECKING:
    from latchkey._core.lease import LeaseCore
    from latchkey.stores.base import AsyncBackend

T = TypeVar("T")
log = logging.getLogger("latchkey")


async def arun(steps: Steps[T], backend: AsyncBackend) -> T:
    """Run ``steps`` to its end, awaiting each operation it yields; return its value. An
    error (cancellation included) is thrown into the generator, so its ``finally`` runs."""
    value: Any = None
    error: BaseException | None = None
    timer = _observe.timer  # store round trips are timed while metrics are on
    while True:
        try:
            op = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        try:
            kind, target, method, args = op
            if kind == CALL:  # the common case, inline
                if timer is None or target is not None:  # a waiter's wait is no round trip
                    value = await getattr(backend if target is None else target, method)(*args)
                else:
                    started = perf_counter()
                    try:
                        value = await getattr(backend, method)(*args)
                    finally:
                        timer(backend, method, perf_counter() - started)
            else:
                value = await _do(kind, target, args, backend)
        except BaseException as exc:
            value, error = None, exc


async def _do(kind: int, target: Any, args: tuple[Any, ...], backend: AsyncBackend) -> Any:
    if kind == SLEEP:
        await asyncio.sleep(max(0.0, args[0]))
        return None
    if kind == USER:
        result = target(*args)
        return (await result) if inspect.isawaitable(result) else result
    if kind == RENEW:
        lease = target
        lease._renewer = AsyncRenewer(lease, backend)
        return None
    if kind == UNRENEW:
        lease = target
        renewer, lease._renewer = lease._renewer, None
        if renewer is not None:
            await renewer.stop()
        return None
    if kind == BACKGROUND:
        task = asyncio.get_running_loop().create_task(
            _quietly(target, backend), name="latchkey-give-back"
        )
        _GIVING_BACK.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(_GIVING_BACK.discard)
        return None
    raise AssertionError(f"unknown operation {kind!r}")


_GIVING_BACK: set[asyncio.Task[None]] = set()


async def _quietly(steps: Steps[Any], backend: AsyncBackend) -> None:
    try:
        await arun(steps, Closed(backend))  # type: ignore[arg-type]
    except Exception:  # a give-back that fails: the lease ends by its TTL as it would have
        log.debug("giving back in the background failed", exc_info=True)


class AsyncRenewer:
    """The renewer of a ``renew=True`` lease in the loop: one task that runs the lease's
    renewal step (``LeaseCore._renew_step``) every third of the lease the store granted
    (``LeaseCore._renew_interval``: the TTL, or less) until it is stopped or the lease is lost.
    Like the sync renewer it holds only a weak reference to the lease, and the lease's
    collection cancels the task."""

    def __init__(self, lease: LeaseCore, backend: AsyncBackend) -> None:
        loop = asyncio.get_running_loop()
        self._backend = backend
        self._busy = False  # a renewal's round trip in flight (read by tests)
        self._task = loop.create_task(
            self._run(lease._renew_interval()), name=f"latchkey-renew:{lease.name[:40]}"
        )
        task = self._task

        def cancel(_ref: object) -> None:
            # Collection may happen on any thread: cancel through the loop — unless the loop
            # is closed (the task went with it; there is nothing left to cancel).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

        self._ref = weakref.ref(lease, cancel)

    async def stop(self) -> None:
        task = self._task
        if task is asyncio.current_task():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            lease = self._ref()
            if lease is None:
                return
            self._busy = True
            try:
                next_delay = await arun(lease._renew_step(), self._backend)
            finally:
                self._busy = False
                del lease
            if next_delay is None:
                return
            delay = next_delay
