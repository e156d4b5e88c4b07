"""``mongodb://`` and ``mongodb+srv://``: one document per name, one pipeline update per acquire.

Seed 004's ``get_lock`` upserted over the current holder's document (stealing a live lock) and
its ``release_lock`` deleted without checking the owner. Here every write is a single-document
update whose *aggregation pipeline* decides, by the server's clock (``$$NOW``), what may change:

- acquire keeps every live holder, drops expired ones, and adds the caller only if fewer than
  ``limit`` remain — a live holder is never overwritten, whatever the caller claims to be;
- release and extend match only a document where the caller's own lease is live.

Layout: collection ``?collection=`` (default ``latchkey_locks``) of the URL's database (default
``latchkey``), one document per name::

    {_id: name, fence: Long, holders: [{owner, info, token, acquired, expires}], gc: Date}

``fence`` is the name's last fencing token: folded into the lease document, so that acquire
(token included) is one round trip. A new token is ``max(fence + 1, $$NOW in ms)``: tokens
strictly increase while the document lives, and a document may be deleted only once ``gc`` —
the latest of its leases' expiry and its ``fence`` read as a date — has passed, so a document
deleted by the TTL index on ``gc`` (garbage collection only; MongoDB sweeps once a minute) or by
``purge_expired`` restarts above every token it gave. Records live in ``<collection>_records``
as ``{_id: name, v: version, d: JSON text}``.

Needs MongoDB ≥ 5.0 (``let`` variables in updates). Waiters poll: change streams would need a
replica set, and latchkey does not require one.

Each primitive is a generator of requests (:class:`~latchkey.stores.io.pymongo.Call`: a
method of the lease or records collection; :class:`~latchkey.stores.io.pymongo.Scan`: a
cursor read) carried out by PyMongo's sync client or its native asyncio client
(``stores/io/pymongo.py``, ``stores/io/pymongo_async.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from pymongo import ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, identifier
from latchkey.stores.base import BackendBase
from latchkey.stores.io import Steps
from latchkey.stores.io.pymongo import PYMONGO, Call, Scan, database_of, only_duplicate_keys
from latchkey.stores.mongodb_pipelines import (
    ACQUIRE,
    ACQUIRE_OPTIONS,
    ANY_LIVE,
    EXTEND,
    FORCE_RELEASE,
    INDEX,
    LIVE,
    OURS_LIVE,
    PURGE_FILTER,
    RELEASE,
    list_pipeline,
    lock_let,
)
from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def _holder(data: Mapping[str, Any]) -> Holder:
    token, expires = _lease(data)
    return Holder(token, Owner.from_json(data.get("info")), _utc(data["acquired"]), expires)


def _lease(data: Mapping[str, Any]) -> tuple[int, datetime]:
    return int(data["token"]), _utc(data["expires"])


def acquired(doc: Mapping[str, Any] | None, owner: str) -> Grant | Busy:
    """Read the document an acquire returned: the caller's grant, or who keeps it busy."""
    holders = (doc or {}).get("holders") or []
    for data in holders:
        if data.get("owner") == owner:
            expires, now = _utc(data["expires"]), (doc or {}).get("now")
            left = None if now is None else (expires - _utc(now)).total_seconds()
            return Grant(int(data["token"]), expires, left)
    if not holders:
        return Busy(0)
    soonest = min(holders, key=lambda h: h["expires"])
    return Busy(len(holders), _holder(soonest))


def extended(doc: Mapping[str, Any] | None, owner: str) -> Grant | None:
    """Read the document an extend returned: the caller's lease, if it was live."""
    for data in (doc or {}).get("holders") or []:
        if data.get("owner") == owner:
            return Grant(*_lease(data))
    return None


def past(prefix: str) -> Any:
    """A list scan's stop: true once the _id order (UTF-8 byte order) has left the prefix's
    range."""
    return lambda doc: not isinstance(doc["_id"], str) or not doc["_id"].startswith(prefix)


class MongoDB(Store):
    """Leases as MongoDB documents; every primitive is one single-document (or bulk) command."""

    scheme = "mongodb"
    options = {
        "collection": Option(identifier, "latchkey_locks", "collection of the lease documents"),
    }
    driver_options = PYMONGO
    sync_driver = "latchkey.stores.io.pymongo:MongoDriver"
    async_driver = "latchkey.stores.io.pymongo_async:AsyncMongoDriver"

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        self.database = database_of(backend)  # the URL's, or the borrowed client's
        self.collection: str = self.config["collection"]
        self._indexed = False

    def _ensure_index(self) -> Steps[None]:
        """The TTL index on ``gc`` (garbage collection only; expiry is checked by $$NOW)."""
        if not self._indexed:
            yield Call("locks", "create_index", ("gc",), INDEX)
            self._indexed = True

    def init(self) -> Steps[None]:
        yield from self._ensure_index()

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        yield from self._ensure_index()
        options = {**ACQUIRE_OPTIONS, "let": lock_let(owner, owner_info, ttl, limit)}
        try:
            doc = yield Call(
                "locks", "find_one_and_update", ({"_id": name}, ACQUIRE), options, True
            )
        except DuplicateKeyError:
            return Busy(0)  # two first acquires raced to insert: the core retries at once
        return acquired(doc, owner)

    def release(self, name: str, owner: str) -> Steps[bool]:
        args = ({"_id": name, "$expr": OURS_LIVE}, RELEASE)
        result = yield Call("locks", "update_one", args, {"let": lock_let(owner)})
        return bool(result.matched_count == 1)

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        options = {"return_document": ReturnDocument.AFTER, "let": lock_let(owner, ttl=ttl)}
        args = ({"_id": name, "$expr": OURS_LIVE}, EXTEND)
        doc = yield Call("locks", "find_one_and_update", args, options)
        return extended(doc, owner)

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        pipeline = [{"$match": {"_id": name}}, {"$project": {"holders": LIVE}}]
        docs = yield Scan("locks", "aggregate", (pipeline,))
        return _info(docs[0]) if docs else None

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        docs = yield Scan("locks", "aggregate", (list_pipeline(prefix),), past(prefix))
        return [info for info in map(_info, docs) if info is not None]

    def force_release(self, name: str) -> Steps[bool]:
        args = ({"_id": name, "$expr": ANY_LIVE}, FORCE_RELEASE)
        result = yield Call("locks", "update_one", args)
        return bool(result.matched_count == 1)

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """Delete the documents whose every lease has ended (see ``gc``); return how many.
        With ``limit``: at most that many, found through the ``gc`` index, then deleted by id
        (the filter again, so a document taken meanwhile stays)."""
        if limit is None:
            result = yield Call("locks", "delete_many", (PURGE_FILTER,))
            return int(result.deleted_count)
        docs = yield Scan("locks", "find", (PURGE_FILTER, {"_id": 1}, 0, limit))  # skip 0
        if not docs:
            return 0
        ids = {"_id": {"$in": [doc["_id"] for doc in docs]}, **PURGE_FILTER}
        result = yield Call("locks", "delete_many", (ids,))
        return int(result.deleted_count)

    # -- batch claims: one bulk write, then one find -----------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        yield from self._ensure_index()
        options = {"ordered": False, "let": lock_let(owner, owner_info, ttl, 1)}
        try:
            requests = [UpdateOne({"_id": n}, ACQUIRE, upsert=True) for n in names]
            yield Call("locks", "bulk_write", (requests,), options, True)
        except BulkWriteError as exc:
            # Duplicate keys only: two first acquires raced to insert (busy names); any other
            # write error fails the claim.
            if not only_duplicate_keys(exc):
                raise
        mine = {"_id": {"$in": list(names)}, "holders.owner": owner}
        docs = yield Scan("locks", "find", (mine, {"holders": {"$elemMatch": {"owner": owner}}}))
        return {doc["_id"]: Grant(*_lease(doc["holders"][0])) for doc in docs}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        args = ({"_id": {"$in": list(names)}, "$expr": OURS_LIVE}, RELEASE)
        result = yield Call("locks", "update_many", args, {"let": lock_let(owner)})
        return int(result.matched_count)

    # -- versioned records -------------------------------------------------------------------

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        doc = yield Call("records", "find_one", ({"_id": name},))
        return (None, 0) if doc is None else (str(doc["d"]), int(doc["v"]))

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        if version == 0:
            try:
                yield Call("records", "insert_one", ({"_id": name, "v": 1, "d": value},))
            except DuplicateKeyError:
                return None
            return 1
        change = {"$set": {"v": version + 1, "d": value}}
        result = yield Call("records", "update_one", ({"_id": name, "v": version}, change))
        return version + 1 if result.matched_count == 1 else None

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        if version == 0:
            return False
        result = yield Call("records", "delete_one", ({"_id": name, "v": version},))
        return bool(result.deleted_count == 1)

    # -- clock -------------------------------------------------------------------------------

    def now(self) -> Steps[datetime]:
        """The server's clock: ``localTime`` from the ``hello`` command."""
        reply = yield Call("admin", "command", ("hello",))
        return _utc(reply["localTime"])


class MongoDBBackend(StoreBackend):
    store_class = MongoDB


class AsyncMongoDBBackend(AsyncStoreBackend):
    store_class = MongoDB


def _info(doc: Mapping[str, Any]) -> LockInfo | None:
    holders = sorted(doc.get("holders") or [], key=lambda h: (h["acquired"], h["token"]))
    if not holders:
        return None
    return LockInfo(str(doc["_id"]), tuple(_holder(h) for h in holders))
