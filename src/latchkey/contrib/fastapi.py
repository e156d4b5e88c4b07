"""FastAPI and Starlette: the store opened and closed with the app, and a lock per request.

::

    from fastapi import Depends, FastAPI
    from latchkey.contrib.fastapi import lifespan, locked

    app = FastAPI(lifespan=lifespan("redis://localhost/0"))

    @app.post("/reports/{user_id}", dependencies=[Depends(locked("report:{user_id}"))])
    async def build_report(user_id: int) -> dict[str, str]: ...

The store is an :class:`~latchkey.AsyncStore` kept on ``app.state.latchkey`` from startup to
shutdown. The dependency answers 409 when the lock stays busy after ``wait``, 503 when the
store cannot be reached, and releases the lock when FastAPI closes the request's
dependencies (after the response is sent, with FastAPI's default dependency scope). A busy
answer carries ``Retry-After``: the seconds left on the holder's lease by the store's clock,
rounded up, when the store says when it ends.

.. versionadded:: 0.2
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp

from latchkey._async.lock import AsyncLock
from latchkey._async.store import AsyncStore, connect_async
from latchkey._durations import Duration
from latchkey.errors import ConfigError, StoreUnavailable

__all__ = ["STATE_KEY", "get_store", "lifespan", "locked", "open_store"]

log = logging.getLogger("latchkey.contrib.fastapi")

#: The attribute of ``app.state`` that holds the store.
STATE_KEY = "latchkey"


@asynccontextmanager
async def open_store(app: ASGIApp, url: str | None = None) -> AsyncIterator[AsyncStore]:
    """Open the store (``url``, else ``LATCHKEY_URL``…, as :func:`latchkey.connect_async`),
    keep it on ``app.state.latchkey`` and close it on exit. For an app with a lifespan of
    its own: ``async with open_store(app, url): yield``.

    A bad URL raises :class:`~latchkey.ConfigError` here, at startup; the store connects on
    first use, so an unreachable one does not stop the app from starting.
    """
    store = connect_async(url)
    state = app.state  # type: ignore[attr-defined]  # Starlette and FastAPI apps have one
    setattr(state, STATE_KEY, store)
    try:
        yield store
    finally:
        if getattr(state, STATE_KEY, None) is store:
            delattr(state, STATE_KEY)
        await store.aclose()


def lifespan(url: str | None = None) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A ``lifespan=`` for ``FastAPI(...)`` or ``Starlette(...)`` that opens the store on
    startup and closes it on shutdown (see :func:`open_store`)."""

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        async with open_store(app, url):
            yield

    return run


def get_store(request: Request) -> AsyncStore:
    """The app's store, as a dependency: ``store: AsyncStore = Depends(get_store)``."""
    store = getattr(request.app.state, STATE_KEY, None)
    if not isinstance(store, AsyncStore):
        raise ConfigError(
            f"no latchkey store on app.state.{STATE_KEY}: create the app with "
            "lifespan=latchkey.contrib.fastapi.lifespan(url), or enter "
            "latchkey.contrib.fastapi.open_store(app, url) in its own lifespan"
        )
    return store


def locked(
    name: str | Callable[[Request], str],
    *,
    ttl: Duration = "30s",
    wait: Duration | None = 0,
    renew: bool = False,
    metadata: Mapping[str, Any] | None = None,
    busy_status: int = 409,
) -> Callable[[Request], AsyncIterator[AsyncLock]]:
    """A dependency that holds the lock ``name`` while the request is handled.

    ``name`` is a template filled from the path parameters (``"report:{user_id}"``) or a
    function of the request. The lock is tried for up to ``wait`` (0: once; None: without
    limit); still busy, the request gets ``busy_status`` (409) and the handler does not run;
    the answer's ``Retry-After`` header is the whole seconds (rounded up, at least 1) left on
    the holder's lease by the store's clock (one more round trip: the store's clock), left
    out where the store has no TTL (session-tied stores) or cannot be asked.
    A store that cannot be reached gives 503. ``ttl`` and ``renew`` are as for
    :meth:`latchkey.AsyncStore.lock`: a request that may outlive ``ttl`` wants
    ``renew=True``. The dependency's value is the held :class:`~latchkey.AsyncLock`
    (its ``token`` fences the request's writes).
    """
    if not callable(name) and (not isinstance(name, str) or not name):
        raise ConfigError(f"locked() needs a non-empty name template or a function, got {name!r}")

    async def hold(request: Request) -> AsyncIterator[AsyncLock]:
        lock_name = _lock_name(name, request)
        lock = get_store(request).lock(
            lock_name, ttl=ttl, wait=wait, renew=renew, metadata=metadata
        )
        try:
            acquired = await lock.acquire()
        except StoreUnavailable as exc:
            log.warning("lock %r: store unavailable: %s", lock_name, exc)
            raise HTTPException(503, detail="lock store unavailable") from exc
        if not acquired:
            retry_after = await _retry_after(lock)
            headers = None if retry_after is None else {"Retry-After": str(retry_after)}
            raise HTTPException(busy_status, detail=f"busy: {lock_name}", headers=headers)
        try:
            yield lock
        finally:
            try:
                await lock.release()
            except StoreUnavailable as exc:  # the lease ends by its TTL; the answer is sent
                log.warning("lock %r: release failed, it ends by its TTL: %s", lock_name, exc)

    return hold


async def _retry_after(lock: AsyncLock) -> int | None:
    """Whole seconds until the lease that kept ``lock`` out ends, by the store's clock
    (rounded up, at least 1); None when the store gives no end or cannot be asked. A holder
    that renews its lease keeps the name longer: this is when a retry can first succeed."""
    holder = lock.holder
    if holder is None or holder.expires_at is None:
        return None
    try:
        now = await lock.store.now()
    except StoreUnavailable:
        return None
    left = (holder.expires_at - now).total_seconds()
    return max(1, math.ceil(left))


def _lock_name(name: str | Callable[[Request], str], request: Request) -> str:
    if callable(name):
        return name(request)
    try:
        return name.format(**request.path_params)
    except (KeyError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"locked({name!r}): cannot fill the name from the path parameters "
            f"{sorted(request.path_params)}: {exc!r}"
        ) from None
