"""The etcd store (``etcd://host:2379[,host:2379…]``): etcd v3 leases, transactions and watches.

Key layout, for a name whose UTF-8 bytes in hex are ``H`` and the ``?prefix=`` ``P`` (default
``latchkey:``); hex keeps any name safe and keeps prefixes and byte order, so ``list(prefix)``
is one range read::

    P s/H/<i>        slot i of the name (0 for a mutex, 0…limit-1 for a semaphore): the
                     holder's owner token; bound to the holder's etcd lease
    P o/H/<owner>    the holder: JSON {slot, info, acquired ms, expires ms, ttl s, shared};
                     created in the same transaction as its slot, on the same lease, so its
                     create_revision is the fencing token
    P r/H            the versioned record ``name``; its version is etcd's own key version

Every lease is an etcd lease whose TTL is the requested TTL rounded *up* to whole seconds
(etcd's unit; and never below the server's minimum, which etcd raises it to): etcd never ends
a lease before the holder's local deadline, and may end it up to a second (more after a leader
change, which restarts lease timers) later. Expiry is etcd's: the leader deletes a lease's
keys when its timer runs out, whatever any client's clock says.

Fencing tokens are the holder key's create_revision: etcd's revision counter increases with
every write to the cluster, is persisted with the data and never goes back, so a name's tokens
strictly increase across release, expiry and restart.

Round trips. Acquire: grant the owner's etcd lease (its ID derived from the owner token and
the name, :func:`lease_id`), then one transaction — create the holder only if the owner holds
none, then the first free slot (nested transactions, one per slot) — 2. An owner that waits
(after :meth:`Etcd.wait_in_line`) sends the transaction first: a busy name answers at once and
nothing is granted (1); the puts fail while the lease does not exist, and then it is granted
and the transaction sent again. A lease left by an attempt that lost a race is kept for the
next one (renewed to its full TTL when it wins). Release: revoke the lease, which deletes its
keys atomically — 1 (a lease moved by an extend with another TTL, or a claim's shared lease:
read and delete, 2-3). Extend: read, keep-alive, rewrite the holder's expiry — 3 (another
TTL: a new lease swapped in, 4). A claim of N names: one lease and one transaction per 1,000
names (nested groups, within etcd's default ``--max-txn-ops`` of 128 along any nesting path).
Waiters are woken by a watch on the name's slots (DELETE events: release, expiry, force
release), one watch per name per process, each deletion waking the waiter that has waited
longest.

etcd has no clock API: ``now()`` is this machine's UTC clock, read after a round trip to the
server (so that it fails like the other primitives when etcd is unreachable), and the
``expires_at`` of leases is that clock at the request plus the TTL. The store's clock, for
expiry, is the etcd leader's lease timers.

Here: the layout, the transactions and the reply parsing, I/O-free; the bytes move in
:mod:`latchkey.stores.io.etcd` (httpx, sync) and :mod:`latchkey.stores.io.etcd_async`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import Option, boolean, key_prefix
from latchkey.errors import Unsupported
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.etcd_txn import (
    CLAIM_BATCH,
    MAX_LIMIT,
    Op,
    acquired_of,
    compare,
    delete,
    end_of,
    get,
    grouped,
    holder_value,
    info_of,
    kvs,
    lease_id,
    lease_seconds,
    meta_of,
    now_ms,
    num,
    put,
    txn,
    ungrouped,
    utc,
    value_of,
)
from latchkey.stores.io import Steps
from latchkey.stores.io.etcd import EtcdError, Post, Watch, b64, unb64
from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend

#: Waiting owners remembered for acquire's choice of order (see wait_in_line).
MAX_HINTS = 10_000


class Etcd(Store):
    """Leases as etcd keys bound to etcd leases; every primitive a few gateway calls."""

    scheme = "etcd"
    capabilities = Capabilities(push=True)
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key (letters, digits, _:.-)"),
        "tls": Option(boolean, False, "talk https to the endpoints"),
    }
    sync_driver = "latchkey.stores.io.etcd:EtcdDriver"
    async_driver = "latchkey.stores.io.etcd_async:AsyncEtcdDriver"

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        self.prefix: bytes = self.config["prefix"].encode()
        #: (name, owner) of the acquires that wait here (see acquire).
        self._waiting: dict[tuple[str, str], None] = {}

    # -- key layout (see the module docstring) -----------------------------------------------

    def _key(self, kind: str, name: str, tail: str = "") -> bytes:
        return self.prefix + f"{kind}/{name.encode().hex()}/{tail}".encode()

    def slot(self, name: str, i: int) -> bytes:
        return self._key("s", name, str(i))

    def holder(self, name: str, owner: str) -> bytes:
        return self._key("o", name, owner)

    def record_key(self, name: str) -> bytes:
        return self.prefix + f"r/{name.encode().hex()}".encode()

    def name_of(self, key: bytes) -> str:
        return bytes.fromhex(key[len(self.prefix) + 2 :].split(b"/", 1)[0].decode()).decode()

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        if limit > MAX_LIMIT:
            raise Unsupported(f"the etcd store takes semaphores of at most {MAX_LIMIT} slots")
        lease, now, seconds = lease_id(owner, name), now_ms(), lease_seconds(ttl)
        holder, holders = self.holder(name, owner), self._key("o", name)
        # Innermost first: no slot was free → read every holder (for Busy).
        level: list[Op] = [get(holders, end_of(holders))]
        for i in reversed(range(limit)):
            value = holder_value(i, owner_info, now, ttl, False)
            level = [txn([compare(self.slot(name, i), "CREATE", 0)],
                         [put(self.slot(name, i), owner.encode(), lease),
                          put(holder, value, lease)], level)]  # fmt: skip
        # The owner holds none yet → the first free slot; else read the owner's own lease.
        body = {"compare": [compare(holder, "CREATE", 0)], "success": level,
                "failure": [get(holder)]}  # fmt: skip
        # A first attempt grants the lease, then sends the transaction (2 round trips). An
        # owner that waits (see wait_in_line) sends the transaction first: a busy name answers
        # at once and nothing is granted (1). Either way the puts fail while the lease does
        # not exist, and a lease that exists already is used (then renewed, below).
        granted = False
        if (name, owner) not in self._waiting:
            granted = yield from self._grant(lease, seconds)
        try:
            reply = yield Post("/v3/kv/txn", body)
        except EtcdError as exc:
            if not exc.not_found:
                raise
            granted = yield from self._grant(lease, seconds)
            reply = yield Post("/v3/kv/txn", body)
        result = acquired_of(reply, now, ttl)
        if type(result) is Grant:
            self._waiting.pop((name, owner), None)
        if type(result) is not Grant:
            # Lost a race for a slot that was free: the lease is kept (it ends by itself after
            # its TTL), so this owner's next attempts are one transaction again.
            return result
        if result.remaining is not None:  # held already: on this lease, or on its own
            if granted:
                yield from self._revoke(lease)
            return result
        if not granted:
            # The lease existed before this call (kept from an attempt that lost a race):
            # renew it to its full TTL now — or give the grant back if that is shorter than
            # this TTL (or the lease just ended), and the core tries again at once.
            alive = yield Post("/v3/lease/keepalive", {"ID": str(lease)})
            if num((alive.get("result") or {}).get("TTL")) < seconds:
                yield from self._revoke(lease)
                return Busy(0)
        return result

    def _grant(self, lease: int, seconds: int) -> Steps[bool]:
        """Grant the owner's etcd lease; False if it exists already (held, or kept)."""
        try:
            yield Post("/v3/lease/grant", {"ID": str(lease), "TTL": str(seconds)})
        except EtcdError as exc:
            if not exc.already_exists:
                raise
            return False
        return True

    def _revoke(self, lease: int) -> Steps[bool]:
        """Revoke an etcd lease (its keys are deleted with it); False if it was gone."""
        try:
            yield Post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if not exc.not_found:
                raise
            return False
        return True

    def release(self, name: str, owner: str) -> Steps[bool]:
        if (yield from self._revoke(lease_id(owner, name))):
            return True
        # Moved to another lease (an extend with another TTL) or a claim's shared lease.
        reply = yield Post("/v3/kv/range", {"key": b64(self.holder(name, owner))})
        found = kvs(reply)
        if not found:
            return False
        return (yield from self._delete(name, owner, found[0]))

    def _delete(self, name: str, owner: str, kv: Op) -> Steps[bool]:
        """Delete a holder and its slot if it is still that lease; revoke its own lease."""
        meta, key = meta_of(kv), self.holder(name, owner)
        body = {"compare": [compare(key, "CREATE", num(kv.get("create_revision")))],
                "success": [delete(key), delete(self.slot(name, meta["slot"]))]}  # fmt: skip
        reply = yield Post("/v3/kv/txn", body)
        if reply.get("succeeded") and not meta.get("shared"):
            yield from self._revoke(num(kv.get("lease")))
        return bool(reply.get("succeeded"))

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        key = self.holder(name, owner)
        found = kvs((yield Post("/v3/kv/range", {"key": b64(key)})))
        if not found:
            return None
        kv, seconds = found[0], lease_seconds(ttl)
        old, lease = meta_of(kv), num(kv.get("lease"))
        meta = {**old, "exp": now_ms() + round(ttl * 1000), "ttl": seconds, "shared": False}
        value = value_of(meta)
        if not old.get("shared") and seconds == old["ttl"]:
            # Same TTL: keep the lease alive, then record the new expiry.
            alive = yield Post("/v3/lease/keepalive", {"ID": str(lease)})
            if num((alive.get("result") or {}).get("TTL")) <= 0:
                return None
            new, ops = lease, [put(key, value, lease)]
        else:
            # Another TTL (or a claim's shared lease): a lease of its own, swapped in.
            granted = yield Post("/v3/lease/grant", {"ID": "0", "TTL": str(seconds)})
            new = num(granted["ID"])
            ops = [put(key, value, new), put(self.slot(name, old["slot"]), owner.encode(), new)]
        # Only if the holder is unchanged since the read: never another holder's lease.
        body = {"compare": [compare(key, "MOD", num(kv.get("mod_revision")))], "success": ops}
        if not (yield Post("/v3/kv/txn", body)).get("succeeded"):
            if new != lease:
                yield from self._revoke(new)
            return None
        if new != lease and not old.get("shared"):
            yield from self._revoke(lease)
        return Grant(num(kv.get("create_revision")), utc(meta["exp"]))

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        start = self._key("o", name)
        reply = yield Post("/v3/kv/range", {"key": b64(start), "range_end": b64(end_of(start))})
        return info_of(name, kvs(reply))

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        start = self.prefix + b"o/" + prefix.encode().hex().encode()
        end = end_of(start if prefix else self.prefix + b"o/")
        reply = yield Post("/v3/kv/range", {"key": b64(start), "range_end": b64(end)})
        out: list[LockInfo] = []
        keys = kvs(reply)  # in key order: each name's holders together, names in order
        for name, group in itertools.groupby(keys, key=lambda kv: self.name_of(unb64(kv["key"]))):
            info = info_of(name, list(group))
            if info is not None:
                out.append(info)
        return out

    def force_release(self, name: str) -> Steps[bool]:
        holders, slots = self._key("o", name), self._key("s", name)
        body = {"success": [delete(holders, end_of(holders), prev_kv=True),
                            delete(slots, end_of(slots))]}  # fmt: skip
        reply = yield Post("/v3/kv/txn", body)
        dropped = reply["responses"][0]["response_delete_range"].get("prev_kvs") or []
        for kv in dropped:  # so that the former holders' release and extend find nothing
            if not meta_of(kv).get("shared"):
                yield from self._revoke(num(kv.get("lease")))
        return bool(dropped)

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """etcd deletes a lease's keys when it expires: nothing is left to purge."""
        return 0
        yield  # a generator

    # -- batch claims: one shared lease, one transaction ---------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        if not names:
            return {}
        granted = yield Post("/v3/lease/grant", {"ID": "0", "TTL": str(lease_seconds(ttl))})
        lease, now, out = num(granted["ID"]), now_ms(), dict[str, Grant]()
        value = holder_value(0, owner_info, now, ttl, True)
        for start in range(0, len(names), CLAIM_BATCH):
            chunk = names[start : start + CLAIM_BATCH]
            ops = [txn([compare(self.slot(n, 0), "CREATE", 0)],
                       [put(self.slot(n, 0), owner.encode(), lease),
                        put(self.holder(n, owner), value, lease)]) for n in chunk]  # fmt: skip
            reply = yield Post("/v3/kv/txn", {"success": grouped(ops)})
            token, expires = num(reply["header"]["revision"]), utc(now + round(ttl * 1000))
            for n, r in zip(chunk, ungrouped(reply["responses"], len(ops)), strict=True):
                if r["response_txn"].get("succeeded"):
                    out[n] = Grant(token, expires)
        if not out:
            yield from self._revoke(lease)
        return out

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        live = 0
        for start in range(0, len(names), CLAIM_BATCH):
            chunk = names[start : start + CLAIM_BATCH]
            reads = [get(self.holder(n, owner)) for n in chunk]
            reply = yield Post("/v3/kv/txn", {"success": grouped(reads)})
            found = [
                (n, kvs(r))
                for n, r in zip(chunk, ungrouped(reply["responses"], len(reads)), strict=True)
            ]
            ops = [txn([compare(self.holder(n, owner), "CREATE", num(k[0]["create_revision"]))],
                       [delete(self.holder(n, owner)), delete(self.slot(n, meta_of(k[0])["slot"]))])
                   for n, k in found if k]  # fmt: skip
            if not ops:
                continue
            reply = yield Post("/v3/kv/txn", {"success": grouped(ops)})
            done = ungrouped(reply["responses"], len(ops))
            live += sum(bool(r["response_txn"].get("succeeded")) for r in done)
            for _, k in found:  # a lease of its own (not a claim's): revoked, not left to expire
                if k and not meta_of(k[0]).get("shared"):
                    yield from self._revoke(num(k[0].get("lease")))
        return live

    # -- versioned records: etcd's key version, compared and set in one transaction ----------

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        found = kvs((yield Post("/v3/kv/range", {"key": b64(self.record_key(name))})))
        if not found:
            return None, 0
        return unb64(found[0].get("value")).decode(), num(found[0].get("version"))

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        key = self.record_key(name)
        body = {"compare": [compare(key, "VERSION", version)],
                "success": [put(key, value.encode())]}  # fmt: skip
        reply = yield Post("/v3/kv/txn", body)
        return version + 1 if reply.get("succeeded") else None

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        if version == 0:
            return False
        key = self.record_key(name)
        body = {"compare": [compare(key, "VERSION", version)], "success": [delete(key)]}
        return bool((yield Post("/v3/kv/txn", body)).get("succeeded"))

    # -- waiting, clock ----------------------------------------------------------------------

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        # A hint for acquire, not state it relies on: this owner's next attempts send their
        # transaction first (bounded: all hints are dropped when there are too many).
        if len(self._waiting) >= MAX_HINTS:
            self._waiting.clear()
        self._waiting[(name, owner)] = None
        if self.config["tls"]:
            return None  # the watch stream speaks plain HTTP only: waiters poll
        slots = self._key("s", name)
        return (yield Watch(b64(slots), b64(end_of(slots))))

    def now(self) -> Steps[datetime]:
        """This machine's clock, after a round trip (etcd has no clock API; see above)."""
        yield Post("/v3/maintenance/status", {})
        return datetime.now(timezone.utc)


class EtcdBackend(StoreBackend):
    store_class = Etcd


class AsyncEtcdBackend(AsyncStoreBackend):
    store_class = Etcd
