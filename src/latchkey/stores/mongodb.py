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
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote_plus

from pymongo import MongoClient, ReturnDocument, UpdateOne
from pymongo.collection import Collection
from pymongo.errors import (
    BulkWriteError,
    ConfigurationError,
    DuplicateKeyError,
    PyMongoError,
)

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, identifier
from latchkey.errors import ConfigError
from latchkey.stores.base import Backend, Capabilities

Document = dict[str, Any]
Pipeline = list[Document]
_DUPLICATE_KEY = 11000
_DATABASE = re.compile(r"^[A-Za-z0-9_-]{1,63}$")

# -- expressions shared by the pipelines below ($$owner, $$info, $$ttl (ms), $$limit come from
# each command's ``let``; $$NOW is the server's clock, one value for the whole command) --------

_HOLDERS: Document = {"$ifNull": ["$holders", []]}
# The holders whose lease has not ended by the server's clock.
_LIVE: Document = {"$filter": {"input": _HOLDERS, "cond": {"$gt": ["$$this.expires", "$$NOW"]}}}
# True if the caller's own lease is live: the only documents release and extend may touch.
_OURS_LIVE: Document = {
    "$anyElementTrue": [
        {
            "$map": {
                "input": _HOLDERS,
                "in": {
                    "$and": [
                        {"$eq": ["$$this.owner", "$$owner"]},
                        {"$gt": ["$$this.expires", "$$NOW"]},
                    ]
                },
            }
        }
    ]
}
# When the document may be garbage-collected: after every lease has ended and the server's
# clock (ms) has passed its last token, so that a re-created document's tokens start higher.
_SET_GC: Document = {
    "$set": {"gc": {"$max": [{"$toDate": "$fence"}, {"$max": "$holders.expires"}]}}
}

# A slot is free, and the caller holds none yet (its own live lease is answered as it is).
_GRANT: Document = {
    "$and": [
        {"$lt": [{"$size": "$holders"}, "$$limit"]},
        {"$not": [{"$in": ["$$owner", "$holders.owner"]}]},
    ]
}
_NEXT_TOKEN: Document = {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$toLong": "$$NOW"}]}

# Acquire (find_one_and_update on {_id: name}, upsert, returns the document after): drop
# expired holders; if fewer than $$limit are left, take the next token and add the caller.
# A live holder is never removed or overwritten; the caller learns from the returned document
# whether it is among the holders.
ACQUIRE: Pipeline = [
    {"$set": {"holders": _LIVE}},
    {
        "$set": {
            "fence": {"$cond": [_GRANT, _NEXT_TOKEN, "$fence"]},
            "holders": {
                "$cond": [
                    _GRANT,
                    {
                        "$concatArrays": [
                            "$holders",
                            [
                                {
                                    "owner": "$$owner",
                                    "info": "$$info",
                                    "token": _NEXT_TOKEN,
                                    "acquired": "$$NOW",
                                    "expires": {"$add": ["$$NOW", "$$ttl"]},
                                }
                            ],
                        ]
                    },
                    "$holders",
                ]
            },
        }
    },
    _SET_GC,
]

# What an acquire returns: the holders, and the server's clock of the same command (for the
# time a lease found again has left).
ACQUIRE_PROJECTION: Document = {"holders": 1, "now": "$$NOW"}

# Release (update on {_id: name(s), $expr: _OURS_LIVE}): remove the caller's lease. Matches
# nothing — and changes nothing — unless the caller's own lease is live.
RELEASE: Pipeline = [
    {
        "$set": {
            "holders": {
                "$filter": {"input": "$holders", "cond": {"$ne": ["$$this.owner", "$$owner"]}}
            }
        }
    },
    _SET_GC,
]

# Extend (find_one_and_update on {_id: name, $expr: _OURS_LIVE}): the caller's lease now ends
# $$ttl ms after $$NOW; token and other holders unchanged.
EXTEND: Pipeline = [
    {
        "$set": {
            "holders": {
                "$map": {
                    "input": "$holders",
                    "in": {
                        "$cond": [
                            {"$eq": ["$$this.owner", "$$owner"]},
                            {
                                "$mergeObjects": [
                                    "$$this",
                                    {"expires": {"$add": ["$$NOW", "$$ttl"]}},
                                ]
                            },
                            "$$this",
                        ]
                    },
                }
            }
        }
    },
    _SET_GC,
]

# Force release (update on {_id: name, $expr: some live holder}): drop every lease; the fence
# stays in the document.
FORCE_RELEASE: Pipeline = [{"$set": {"holders": {"$literal": []}}}, _SET_GC]
_ANY_LIVE: Document = {"$gt": [{"$size": _LIVE}, 0]}

# Purge (delete_many): documents whose gc time has passed: no live lease, tokens safe.
PURGE_FILTER: Document = {"gc": {"$type": "date"}, "$expr": {"$lt": ["$gc", "$$NOW"]}}


def _text(value: str) -> str:
    return value


# MongoDB connection-string options passed through to pymongo as given.
_PASSTHROUGH = (
    "appName", "authMechanism", "authMechanismProperties", "authSource", "compressors",
    "directConnection", "journal", "loadBalanced", "maxPoolSize", "minPoolSize",
    "readConcernLevel", "readPreference", "replicaSet", "retryReads", "retryWrites", "ssl",
    "tls", "tlsAllowInvalidCertificates", "tlsAllowInvalidHostnames", "tlsCAFile",
    "tlsCertificateKeyFile", "tlsCertificateKeyFilePassword", "tlsInsecure", "w", "wTimeoutMS",
)  # fmt: skip


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def _holder(data: Mapping[str, Any]) -> Holder:
    return Holder(
        int(data["token"]),
        Owner.from_json(data.get("info")),
        _utc(data["acquired"]),
        _utc(data["expires"]),
    )


def client_settings(url: StoreURL, timeout: float) -> tuple[str, str, dict[str, Any]]:
    """The connection string, database name and client keyword arguments for ``url``: the
    same for the sync and the asyncio client. Raises ConfigError for a bad URL."""
    if not url.hosts:
        raise ConfigError(f"{url.scheme} store: the URL names no host")
    database = url.path.strip("/") or "latchkey"
    if not _DATABASE.match(database):
        raise ConfigError(
            f"{url.scheme} store: database {database!r} must be letters, digits, _ and -"
        )
    netloc = url.raw.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    given = {k: v for k, v in url.query.items() if k in _PASSTHROUGH}
    # pymongo unquotes values (unquote_plus), except authMechanismProperties' "K:V,K:V".
    query = "&".join(f"{k}={quote_plus(v, safe=':,/')}" for k, v in given.items())
    path = f"/{database}" if url.path.strip("/") else "/"
    uri = f"{url.scheme}://{netloc}{path}" + (f"?{query}" if query else "")
    ms = max(1, round(timeout * 1000))
    kwargs: dict[str, Any] = {
        "connect": False,
        "tz_aware": True,
        "serverSelectionTimeoutMS": ms,
        "connectTimeoutMS": ms,
        "socketTimeoutMS": ms,
    }
    if "w" not in given:
        kwargs["w"] = "majority"
    if "appName" not in given:
        kwargs["appname"] = "latchkey"
    return uri, database, kwargs


@contextlib.contextmanager
def config_errors(url: StoreURL) -> Iterator[None]:
    """Creating a client: a bad option value (pymongo only warns about some) is ConfigError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            yield
    except (ConfigurationError, ValueError, TypeError, UserWarning) as exc:
        raise ConfigError(
            f"{url.scheme} store at {url.redacted()}: {url.scrub(str(exc))}"
        ) from None


def lock_let(owner: str, info: str = "", ttl: float = 0.0, limit: int = 1) -> Document:
    """The ``let`` variables of the lease pipelines; user strings are literals."""
    return {
        "owner": {"$literal": owner},
        "info": {"$literal": info},
        "ttl": max(1, round(ttl * 1000)),
        "limit": limit,
    }


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
            return Grant(int(data["token"]), _utc(data["expires"]))
    return None


def inspect_pipeline(name: str) -> Pipeline:
    return [{"$match": {"_id": name}}, {"$project": {"holders": _LIVE}}]


def list_pipeline(prefix: str) -> Pipeline:
    """Documents with live holders from ``prefix`` on, in _id order (stop past the prefix:
    see :func:`past_prefix`)."""
    start: Pipeline = [{"$match": {"_id": {"$gte": prefix}}}] if prefix else []
    return [
        *start,
        {"$sort": {"_id": 1}},
        {"$project": {"holders": _LIVE}},
        {"$match": {"holders.0": {"$exists": True}}},
    ]


def past_prefix(doc: Mapping[str, Any], prefix: str) -> bool:
    """True once the _id order (UTF-8 byte order) has left the prefix's range."""
    return not isinstance(doc["_id"], str) or not doc["_id"].startswith(prefix)


def claim_requests(names: Sequence[str]) -> list[UpdateOne]:
    return [UpdateOne({"_id": n}, ACQUIRE, upsert=True) for n in names]


def claim_lost_races_only(exc: BulkWriteError) -> bool:
    """True if a claim's bulk write failed only where two first acquires raced to insert (busy
    names); any other write error fails the claim."""
    errors = exc.details.get("writeErrors", [])
    return not exc.details.get("writeConcernErrors") and all(
        e.get("code") == _DUPLICATE_KEY for e in errors
    )


def claimed_filter(names: Sequence[str], owner: str) -> tuple[Document, Document]:
    """The find (filter, projection) of the names a claim took."""
    return {"_id": {"$in": list(names)}, "holders.owner": owner}, {
        "holders": {"$elemMatch": {"owner": owner}}
    }


def claimed(doc: Mapping[str, Any]) -> Grant:
    data = doc["holders"][0]
    return Grant(int(data["token"]), _utc(data["expires"]))


def record_reply(doc: Mapping[str, Any] | None) -> tuple[str | None, int]:
    return (None, 0) if doc is None else (str(doc["d"]), int(doc["v"]))


class MongoDBBackend(Backend):
    """Leases as MongoDB documents; every primitive is one single-document (or bulk) command."""

    scheme = "mongodb"
    capabilities = Capabilities()
    options = {
        "collection": Option(identifier, "latchkey_locks", "collection of the lease documents"),
        **{name: Option(_text, None, "passed to pymongo") for name in _PASSTHROUGH},
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        uri, database, kwargs = client_settings(url, self.timeout)
        with config_errors(url):
            self.client: MongoClient[Document] = MongoClient(uri, **kwargs)
        db = self.client[database]
        name = self.config["collection"]
        self.locks: Collection[Document] = db[name]
        self.records: Collection[Document] = db[f"{name}_records"]
        self._indexed = False

    def _ensure_index(self) -> None:
        """The TTL index on ``gc`` (garbage collection only; expiry is checked by $$NOW)."""
        if not self._indexed:
            self.locks.create_index("gc", expireAfterSeconds=0, name="latchkey_gc")
            self._indexed = True

    def init(self) -> None:
        with self.translate("init", (PyMongoError,)):
            self._ensure_index()

    _let = staticmethod(lock_let)

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        with self.translate("acquire", (PyMongoError,)):
            self._ensure_index()
            try:
                doc = self.locks.find_one_and_update(
                    {"_id": name},
                    ACQUIRE,
                    upsert=True,
                    projection=ACQUIRE_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                    let=self._let(owner, owner_info, ttl, limit),
                )
            except DuplicateKeyError:
                return Busy(0)  # two first acquires raced to insert: the core retries at once
        return acquired(doc, owner)

    def release(self, name: str, owner: str) -> bool:
        with self.translate("release", (PyMongoError,)):
            result = self.locks.update_one(
                {"_id": name, "$expr": _OURS_LIVE}, RELEASE, let=self._let(owner)
            )
        return result.matched_count == 1

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        with self.translate("extend", (PyMongoError,)):
            doc = self.locks.find_one_and_update(
                {"_id": name, "$expr": _OURS_LIVE},
                EXTEND,
                return_document=ReturnDocument.AFTER,
                let=self._let(owner, ttl=ttl),
            )
        return extended(doc, owner)

    def inspect(self, name: str) -> LockInfo | None:
        with self.translate("inspect", (PyMongoError,)):
            docs = list(self.locks.aggregate(inspect_pipeline(name)))
        return _info(docs[0]) if docs else None

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        pipeline = list_pipeline(prefix)
        with self.translate("list", (PyMongoError,)), self.locks.aggregate(pipeline) as cursor:
            for doc in cursor:
                if past_prefix(doc, prefix):
                    break
                info = _info(doc)
                if info is not None:
                    yield info

    def force_release(self, name: str) -> bool:
        with self.translate("force_release", (PyMongoError,)):
            result = self.locks.update_one({"_id": name, "$expr": _ANY_LIVE}, FORCE_RELEASE)
        return result.matched_count == 1

    def purge_expired(self) -> int:
        """Delete the documents whose every lease has ended (see ``gc``); return how many."""
        with self.translate("purge_expired", (PyMongoError,)):
            return self.locks.delete_many(PURGE_FILTER).deleted_count

    # -- batch claims: one bulk write, then one find -----------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        requests = claim_requests(names)
        with self.translate("claim", (PyMongoError,)):
            self._ensure_index()
            try:
                self.locks.bulk_write(
                    requests, ordered=False, let=self._let(owner, owner_info, ttl, 1)
                )
            except BulkWriteError as exc:
                if not claim_lost_races_only(exc):
                    raise
            grants = {
                doc["_id"]: claimed(doc) for doc in self.locks.find(*claimed_filter(names, owner))
            }
        return grants

    def release_many(self, names: Sequence[str], owner: str) -> int:
        with self.translate("release_many", (PyMongoError,)):
            result = self.locks.update_many(
                {"_id": {"$in": list(names)}, "$expr": _OURS_LIVE}, RELEASE, let=self._let(owner)
            )
        return result.matched_count

    # -- versioned records -------------------------------------------------------------------

    def record_get(self, name: str) -> tuple[str | None, int]:
        with self.translate("record_get", (PyMongoError,)):
            doc = self.records.find_one({"_id": name})
        return record_reply(doc)

    def record_set(self, name: str, value: str, version: int) -> int | None:
        with self.translate("record_set", (PyMongoError,)):
            if version == 0:
                try:
                    self.records.insert_one({"_id": name, "v": 1, "d": value})
                except DuplicateKeyError:
                    return None
                return 1
            result = self.records.update_one(
                {"_id": name, "v": version}, {"$set": {"v": version + 1, "d": value}}
            )
        return version + 1 if result.matched_count == 1 else None

    def record_delete(self, name: str, version: int) -> bool:
        if version == 0:
            return False
        with self.translate("record_delete", (PyMongoError,)):
            return self.records.delete_one({"_id": name, "v": version}).deleted_count == 1

    # -- clock and lifecycle -----------------------------------------------------------------

    def now(self) -> datetime:
        """The server's clock: ``localTime`` from the ``hello`` command."""
        with self.translate("now", (PyMongoError,)):
            reply = self.client.admin.command("hello")
        return _utc(reply["localTime"])

    def close(self) -> None:
        self.client.close()


def _info(doc: Mapping[str, Any]) -> LockInfo | None:
    holders = sorted(doc.get("holders") or [], key=lambda h: (h["acquired"], h["token"]))
    if not holders:
        return None
    return LockInfo(str(doc["_id"]), tuple(_holder(h) for h in holders))
