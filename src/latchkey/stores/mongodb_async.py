"""``mongodb://`` for asyncio: :class:`AsyncMongoDBBackend`, on PyMongo's native asyncio client.

The same documents, pipelines, filters and reply parsing as the sync store (imported from
:mod:`latchkey.stores.mongodb`); only the client differs: ``pymongo.AsyncMongoClient``
(PyMongo ≥ 4.13, where its asyncio API is stable), whose sockets are the loop's. Nothing runs
on a thread. Waiters poll as in the sync store (no push without a replica set), so a waiting
coroutine is the core's ``asyncio.sleep``.

Timeouts are the driver's, as in the sync store: server selection, connect and every socket
read are bounded by the URL's ``timeout``. The driver closes a connection whose operation
failed, timed out or was cancelled (it never returns a half-read one to its pool), and the
next call connects again. A request that may grant a lease (acquire, claim) is not dropped
when its caller is cancelled: it finishes first, so that the core's release after the
cancellation reaches the server after it (see :func:`_to_the_end`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from datetime import datetime
from typing import Any, TypeVar

from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import AsyncBackend
from latchkey.stores.mongodb import (
    _ANY_LIVE,
    _OURS_LIVE,
    ACQUIRE,
    ACQUIRE_PROJECTION,
    EXTEND,
    FORCE_RELEASE,
    PURGE_FILTER,
    RELEASE,
    Document,
    MongoDBBackend,
    _info,
    _utc,
    acquired,
    claim_lost_races_only,
    claim_requests,
    claimed,
    claimed_filter,
    client_settings,
    config_errors,
    extended,
    inspect_pipeline,
    list_pipeline,
    lock_let,
    past_prefix,
    record_reply,
)

_ERRORS = (PyMongoError,)
T = TypeVar("T")


async def _to_the_end(request: Coroutine[Any, Any, T]) -> T:
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


class AsyncMongoDBBackend(AsyncBackend):
    """Leases as MongoDB documents, awaited: each primitive is the sync store's command."""

    scheme = MongoDBBackend.scheme
    capabilities = MongoDBBackend.capabilities
    options = MongoDBBackend.options

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        uri, database, kwargs = client_settings(url, self.timeout)
        with config_errors(url):
            self.client: AsyncMongoClient[Document] = AsyncMongoClient(uri, **kwargs)
        db = self.client[database]
        name = self.config["collection"]
        self.locks: AsyncCollection[Document] = db[name]
        self.records: AsyncCollection[Document] = db[f"{name}_records"]
        self._indexed = False

    async def _ensure_index(self) -> None:
        """The TTL index on ``gc`` (garbage collection only; expiry is checked by $$NOW)."""
        if not self._indexed:
            await self.locks.create_index("gc", expireAfterSeconds=0, name="latchkey_gc")
            self._indexed = True

    async def init(self) -> None:
        with self.translate("init", _ERRORS):
            await self._ensure_index()

    # -- leases ------------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        with self.translate("acquire", _ERRORS):
            await self._ensure_index()
            request = self.locks.find_one_and_update(
                {"_id": name},
                ACQUIRE,
                upsert=True,
                projection=ACQUIRE_PROJECTION,
                return_document=ReturnDocument.AFTER,
                let=lock_let(owner, owner_info, ttl, limit),
            )
            try:
                doc = await _to_the_end(request)
            except DuplicateKeyError:
                return Busy(0)  # two first acquires raced to insert: the core retries at once
        return acquired(doc, owner)

    async def release(self, name: str, owner: str) -> bool:
        with self.translate("release", _ERRORS):
            result = await self.locks.update_one(
                {"_id": name, "$expr": _OURS_LIVE}, RELEASE, let=lock_let(owner)
            )
        return result.matched_count == 1

    async def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        with self.translate("extend", _ERRORS):
            doc = await self.locks.find_one_and_update(
                {"_id": name, "$expr": _OURS_LIVE},
                EXTEND,
                return_document=ReturnDocument.AFTER,
                let=lock_let(owner, ttl=ttl),
            )
        return extended(doc, owner)

    async def inspect(self, name: str) -> LockInfo | None:
        with self.translate("inspect", _ERRORS):
            cursor = await self.locks.aggregate(inspect_pipeline(name))
            docs = await cursor.to_list()
        return _info(docs[0]) if docs else None

    async def list(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        with self.translate("list", _ERRORS):
            cursor = await self.locks.aggregate(list_pipeline(prefix))
            async with cursor:
                async for doc in cursor:
                    if past_prefix(doc, prefix):
                        break
                    info = _info(doc)
                    if info is not None:
                        yield info

    async def force_release(self, name: str) -> bool:
        with self.translate("force_release", _ERRORS):
            result = await self.locks.update_one({"_id": name, "$expr": _ANY_LIVE}, FORCE_RELEASE)
        return result.matched_count == 1

    async def purge_expired(self) -> int:
        with self.translate("purge_expired", _ERRORS):
            return (await self.locks.delete_many(PURGE_FILTER)).deleted_count

    # -- batch claims: one bulk write, then one find -----------------------------------------

    async def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        with self.translate("claim", _ERRORS):
            await self._ensure_index()
            request = self.locks.bulk_write(
                claim_requests(names), ordered=False, let=lock_let(owner, owner_info, ttl, 1)
            )
            try:
                await _to_the_end(request)
            except BulkWriteError as exc:
                if not claim_lost_races_only(exc):
                    raise
            cursor = self.locks.find(*claimed_filter(names, owner))
            return {doc["_id"]: claimed(doc) async for doc in cursor}

    async def release_many(self, names: Sequence[str], owner: str) -> int:
        with self.translate("release_many", _ERRORS):
            result = await self.locks.update_many(
                {"_id": {"$in": list(names)}, "$expr": _OURS_LIVE}, RELEASE, let=lock_let(owner)
            )
        return result.matched_count

    # -- versioned records -------------------------------------------------------------------

    async def record_get(self, name: str) -> tuple[str | None, int]:
        with self.translate("record_get", _ERRORS):
            doc = await self.records.find_one({"_id": name})
        return record_reply(doc)

    async def record_set(self, name: str, value: str, version: int) -> int | None:
        with self.translate("record_set", _ERRORS):
            if version == 0:
                try:
                    await self.records.insert_one({"_id": name, "v": 1, "d": value})
                except DuplicateKeyError:
                    return None
                return 1
            result = await self.records.update_one(
                {"_id": name, "v": version}, {"$set": {"v": version + 1, "d": value}}
            )
        return version + 1 if result.matched_count == 1 else None

    async def record_delete(self, name: str, version: int) -> bool:
        if version == 0:
            return False
        with self.translate("record_delete", _ERRORS):
            return (await self.records.delete_one({"_id": name, "v": version})).deleted_count == 1

    # -- clock and lifecycle -----------------------------------------------------------------

    async def now(self) -> datetime:
        """The server's clock: ``localTime`` from the ``hello`` command."""
        with self.translate("now", _ERRORS):
            reply = await self.client.admin.command("hello")
        return _utc(reply["localTime"])

    async def aclose(self) -> None:
        await self.client.close()
