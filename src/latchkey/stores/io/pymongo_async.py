"""MongoDB through PyMongo's native asyncio client (``AsyncMongoClient``, PyMongo ≥ 4.13).

The twin of :mod:`latchkey.stores.io.pymongo`: the same requests, awaited; the client's
sockets are the loop's and nothing runs on a thread. Timeouts are the driver's (server
selection, connect and every socket read bounded by the URL's ``timeout``); the driver closes
a connection whose operation failed, timed out or was cancelled, and the next call connects
again. A request that may grant a lease (``Call.grants``) is not dropped when its caller is
cancelled: it finishes first, so that the core's release after the cancellation reaches the
server after it (see :func:`to_the_end`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from latchkey.stores.io.aio import AsyncDriver
from latchkey.stores.io.pymongo import Call, Document, client_settings, config_errors

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")


async def to_the_end(request: Awaitable[T]) -> T:
    """Await a request that may grant leases; if the caller is cancelled meanwhile, let the
    request finish first (the driver's timeouts bound it), then pass the cancellation on.

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


class AsyncMongoDriver(AsyncDriver):
    errors = (PyMongoError,)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        uri, kwargs = client_settings(backend.url, backend.timeout, store.database)
        with config_errors(backend.url):
            self.client: AsyncMongoClient[Document] = AsyncMongoClient(uri, **kwargs)
        db = self.client[store.database]
        self.locks = db[store.collection]
        self.records = db[f"{store.collection}_records"]
        self.targets = {"locks": self.locks, "records": self.records, "admin": self.client.admin}

    async def answer(self, request: Any) -> Any:
        if type(request) is Call:
            method = getattr(self.targets[request.target], request.method)
            call = method(*request.args, **request.kwargs)
            return await (to_the_end(call) if request.grants else call)
        target, method_name, args, stop = request
        cursor = getattr(self.targets[target], method_name)(*args)
        if method_name == "aggregate":  # the async aggregate returns its cursor when awaited
            cursor = await cursor
        docs = []
        async with cursor:
            async for doc in cursor:
                if stop is not None and stop(doc):
                    break
                docs.append(doc)
        return docs

    async def aclose(self) -> None:
        await self.client.close()
