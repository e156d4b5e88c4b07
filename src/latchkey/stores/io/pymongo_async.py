"""MongoDB through PyMongo's native asyncio client (``AsyncMongoClient``, PyMongo ≥ 4.13).

The twin of :mod:`latchkey.stores.io.pymongo`: the same requests, awaited; the client's
sockets are the loop's and nothing runs on a thread. Each primitive runs inside one
``pymongo.timeout`` of the URL's ``timeout``, as in the sync driver (server selection,
connect, every socket read and every request of the primitive); the driver closes
a connection whose operation failed, timed out or was cancelled, and the next call connects
again. A request that may grant a lease (``Call.grants``) is not dropped when its caller is
cancelled: it finishes first, so that the core's release after the cancellation reaches the
server after it (see :func:`~latchkey.stores.io.aio.to_the_end`). A borrowed
``AsyncMongoClient`` or ``AsyncDatabase`` is used as the sync driver uses a borrowed client
(its module docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import pymongo
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from latchkey.stores.io import Steps
from latchkey.stores.io.aio import AsyncDriver, to_the_end
from latchkey.stores.io.pymongo import (
    Call,
    Document,
    borrowed_root,
    borrowed_targets,
    client_settings,
    config_errors,
)

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

T = TypeVar("T")


class AsyncMongoDriver(AsyncDriver):
    errors = (PyMongoError,)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        #: Ours (closed by aclose()), or None over a borrowed client.
        self.client: AsyncMongoClient[Document] | None = None
        if backend.client is not None:
            from pymongo.asynchronous.database import AsyncDatabase

            root = borrowed_root(backend.client, AsyncDatabase)
            self.targets = borrowed_targets(root, store.database, store.collection)
            self.locks, self.records = self.targets["locks"], self.targets["records"]
            return
        uri, kwargs = client_settings(backend.url, backend.config, store.database)
        with config_errors(backend.url):
            self.client = AsyncMongoClient(uri, **kwargs)
        db = self.client[store.database]
        self.locks = db[store.collection]
        self.records = db[f"{store.collection}_records"]
        self.targets = {"locks": self.locks, "records": self.records, "admin": self.client.admin}

    async def run(self, steps: Steps[T], action: str) -> T:
        """:meth:`AsyncDriver.run` inside one ``pymongo.timeout``: the primitive's deadline
        (a context variable of this task, which a request finished by ``to_the_end``, a task
        of its own, inherits)."""
        with pymongo.timeout(self.backend.timeout):
            return await super().run(steps, action)

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
        if self.client is not None:  # ours, never a borrowed one
            await self.client.close()
