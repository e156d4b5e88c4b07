"""The MongoDB store's aggregation pipelines and filter expressions, one named constant each.

Kept beside the store module (:mod:`latchkey.stores.mongodb`), not in it, only for length, as
the Redis store's Lua scripts are: the store module is its layout, requests, reply parsing and
primitives; this one is what runs inside MongoDB — every update's pipeline and filter
expression, with a comment: what it matches, what it changes, the invariant it keeps (by the
server's clock, ``$$NOW``) — and the ``let`` variables they read (:func:`lock_let`).
"""

from __future__ import annotations

from pymongo import ReturnDocument

from latchkey.stores.io.pymongo import Document

Pipeline = list[Document]

# -- expressions shared by the pipelines below ($$owner, $$info, $$ttl (ms), $$limit come from
# each command's ``let``; $$NOW is the server's clock, one value for the whole command) --------

_HOLDERS: Document = {"$ifNull": ["$holders", []]}
# The holders whose lease has not ended by the server's clock.
LIVE: Document = {"$filter": {"input": _HOLDERS, "cond": {"$gt": ["$$this.expires", "$$NOW"]}}}
# True if the caller's own lease is live: the only documents release and extend may touch.
OURS_LIVE: Document = {
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
    {"$set": {"holders": LIVE}},
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
# time a lease found again has left); upserted, the document after the update.
ACQUIRE_OPTIONS: Document = {
    "upsert": True,
    "projection": {"holders": 1, "now": "$$NOW"},
    "return_document": ReturnDocument.AFTER,
}
INDEX: Document = {"expireAfterSeconds": 0, "name": "latchkey_gc"}

# Release (update on {_id: name(s), $expr: OURS_LIVE}): remove the caller's lease. Matches
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

# Extend (find_one_and_update on {_id: name, $expr: OURS_LIVE}): the caller's lease now ends
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
ANY_LIVE: Document = {"$gt": [{"$size": LIVE}, 0]}

# Purge (delete_many): documents whose gc time has passed: no live lease, tokens safe.
PURGE_FILTER: Document = {"gc": {"$type": "date"}, "$expr": {"$lt": ["$gc", "$$NOW"]}}


def lock_let(owner: str, info: str = "", ttl: float = 0.0, limit: int = 1) -> Document:
    """The ``let`` variables of the lease pipelines; user strings are literals."""
    return {
        "owner": {"$literal": owner},
        "info": {"$literal": info},
        "ttl": max(1, round(ttl * 1000)),
        "limit": limit,
    }


def list_pipeline(prefix: str) -> Pipeline:
    """Documents with live holders from ``prefix`` on, in _id order (the store's scan stops
    once past the prefix)."""
    start: Pipeline = [{"$match": {"_id": {"$gte": prefix}}}] if prefix else []
    return [
        *start,
        {"$sort": {"_id": 1}},
        {"$project": {"holders": LIVE}},
        {"$match": {"holders.0": {"$exists": True}}},
    ]
