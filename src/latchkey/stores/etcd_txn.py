"""The etcd store's requests and replies as data: etcd v3 in the JSON gateway's spelling.

Keys and values are base64, 64-bit integers decimal strings (protobuf's JSON mapping). Each
builder returns one element of a transaction's ``compare`` list or of its ``success`` /
``failure`` branches; :func:`txn` nests a transaction as an operation of another (etcd ≥ 3.3).
The readers at the end turn the holder keys etcd returns (and an acquire's transaction reply)
into latchkey's plain values; :func:`holder_value` and :func:`value_of` write what they read.
The rules that use both are in :mod:`latchkey.stores.etcd`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey.stores.io.etcd import b64, unb64

Op = dict[str, Any]
#: etcd's default ``--max-txn-ops``: operations along one nesting path of a transaction.
MAX_OPS = 128
#: Semaphore slots one acquire can try: one nested transaction (2 operations) per slot along
#: one path, within :data:`MAX_OPS`.
MAX_LIMIT = 60
#: Names per claim request (keeps a request well under etcd's 1.5 MiB default).
CLAIM_BATCH = 1000


def compare(key: bytes, target: str, value: int, result: str = "EQUAL") -> Op:
    """A compare on one key: ``target`` CREATE (create_revision), MOD, VERSION or LEASE."""
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version"}
    return {"key": b64(key), "target": target, "result": result,
            field.get(target, target.lower()): str(value)}  # fmt: skip


def put(key: bytes, value: bytes, lease: int = 0, prev_kv: bool = False) -> Op:
    return {"request_put": {"key": b64(key), "value": b64(value), "lease": str(lease),
                            "prev_kv": prev_kv}}  # fmt: skip


def get(key: bytes, end: bytes | None = None) -> Op:
    return {"request_range": {"key": b64(key), **({"range_end": b64(end)} if end else {})}}


def delete(key: bytes, end: bytes | None = None, prev_kv: bool = False) -> Op:
    body = {"key": b64(key), "prev_kv": prev_kv, **({"range_end": b64(end)} if end else {})}
    return {"request_delete_range": body}


def txn(compares: Sequence[Op], success: Sequence[Op], failure: Sequence[Op] = ()) -> Op:
    """A nested transaction (an operation of another transaction)."""
    return {"request_txn": {"compare": list(compares), "success": list(success),
                            "failure": list(failure)}}  # fmt: skip


def grouped(ops: list[Op]) -> list[Op]:
    """``ops`` (each a nested transaction of at most 2 operations, or a read) as one branch:
    as they are while few, else in nested transactions of about √n each (etcd counts the
    operations along every nesting path against ``--max-txn-ops``: groups + per group + 2).
    Read back with :func:`ungrouped`."""
    if len(ops) <= MAX_OPS - 2:
        return ops
    size = math.isqrt(len(ops) - 1) + 1
    return [txn((), ops[i : i + size]) for i in range(0, len(ops), size)]


def ungrouped(responses: list[Op], count: int) -> list[Op]:
    if count <= MAX_OPS - 2:
        return responses
    return [r for group in responses for r in group["response_txn"].get("responses", [])]


def end_of(prefix: bytes) -> bytes:
    """The range end of every key starting with ``prefix`` (its last byte plus one)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def kvs(response: Op) -> list[Op]:
    """The key-values of a range reply (or of a ``response_range``)."""
    return list((response.get("response_range", response)).get("kvs") or [])


def lease_seconds(ttl: float) -> int:
    """etcd lease TTLs are whole seconds: round up, so etcd never ends a lease first."""
    return max(1, math.ceil(ttl - 1e-9))


def lease_id(owner: str, name: str) -> int:
    """The etcd lease ID of ``owner``'s lease on ``name``: derived from the secret owner token,
    so release is one revoke with no read first, and a lease granted twice is caught by etcd
    ("lease already exists") rather than doubled. Positive, below 2**63."""
    digest = hashlib.blake2b(f"{owner}\0{name}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


# -- replies: holder keys (JSON values, see the store's layout) → latchkey's values ------------


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def num(value: Any) -> int:
    return int(value or 0)


def meta_of(kv: Op) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(unb64(kv.get("value")))
    return data


def value_of(meta: dict[str, Any]) -> bytes:
    """A holder key's value: ``meta`` as compact JSON (:func:`meta_of` reads it back)."""
    return json.dumps(meta, separators=(",", ":")).encode()


def holder_value(slot: int, info: str, acquired: int, ttl: float, shared: bool) -> bytes:
    """A new holder key's value (see the store's layout): its slot, the owner's JSON, acquired
    and expiry ms, the etcd lease's TTL in seconds, whether the lease is a claim's shared one."""
    meta = {"slot": slot, "info": info, "acq": acquired, "exp": acquired + round(ttl * 1000),
            "ttl": lease_seconds(ttl), "shared": shared}  # fmt: skip
    return value_of(meta)


def holder_of(kv: Op) -> Holder:
    meta = meta_of(kv)
    return Holder(num(kv.get("create_revision")), Owner.from_json(meta.get("info")),
                  utc(meta["acq"]), utc(meta["exp"]))  # fmt: skip


def busy_of(holders: list[Op]) -> Busy:
    if not holders:
        return Busy(0)
    soonest = min(holders, key=lambda kv: meta_of(kv)["exp"])
    # No retry_after: etcd ends a lease up to a second after its holder's deadline, and the
    # watch wakes waiters when it does.
    return Busy(len(holders), holder_of(soonest))


def own_of(kv: Op) -> Grant:
    """The owner's live lease found again: its token and expiry, and the time it has left."""
    meta = meta_of(kv)
    return Grant(num(kv.get("create_revision")), utc(meta["exp"]),
                 max(0.0, (meta["exp"] - now_ms()) / 1000))  # fmt: skip


def info_of(name: str, holders: list[Op]) -> LockInfo | None:
    if not holders:
        return None
    ordered = sorted(holders, key=lambda kv: num(kv.get("create_revision")))
    return LockInfo(name, tuple(holder_of(kv) for kv in ordered))


def acquired_of(reply: Op, now: int, ttl: float) -> Grant | Busy:
    """Read an acquire's transaction: granted (the token is the transaction's revision),
    the owner's own lease, or busy."""
    if not reply.get("succeeded"):
        return own_of(kvs(reply["responses"][0])[0])
    response = reply["responses"][0]
    while "response_txn" in response:
        inner = response["response_txn"]
        if inner.get("succeeded"):
            expires = utc(now + round(ttl * 1000))
            return Grant(num(reply["header"]["revision"]), expires)
        response = inner["responses"][0]
    return busy_of(kvs(response))
