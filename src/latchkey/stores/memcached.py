"""``memcached://host:port[,host:port…]``: leases as memcached items that expire by their TTL.

Seed 000 locked rows with a bare ``add``, which answers "not stored" both when the key exists
and when the server is down. This store speaks the *meta* protocol (memcached ≥ 1.6) and checks
every reply: a server that does not answer is StoreUnavailable, never "busy". A name lives on
one server (pymemcache's rendezvous hash; its clients are not used: no meta commands, and a
failed server's keys move to another, where a second holder could take a lock). Fencing
tokens are ``(S << 32) + CAS``: the lease item's CAS unique (strictly increasing while the
server runs) and ``S``, the server's start in seconds since 2020, which a restart raises.
Acquire is one round trip (a quiet ``mg`` probe + an ``ms … ME`` add); release one, by the CAS
remembered from our acquire or extend, used only on the server process that gave it (its
``P instance`` id), else it reads first. The driver runs :meth:`Memcached.greet` on each new
connection and keeps the session (S, instance id) with it; the greeting also sets the store
clock (whole seconds, kept on the monotonic clock). A lease of ``ttl`` s is stored with TTL
``ceil(ttl) + 1``. The design at length: docs/stores/memcached.md; the commands and the item
format: :mod:`latchkey.stores.memcached_wire`; framing and connections: ``io/memcached.py``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from datetime import datetime

from pymemcache.client.rendezvous import RendezvousHash

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import Option, key_prefix
from latchkey.errors import ConfigError, Unsupported
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps, after_fork
from latchkey.stores.io.memcached import ProtocolError, Reply, flag, stats, trip, written
from latchkey.stores.memcached_wire import (
    ADD,
    DEFAULT_PORT,
    DELETE,
    DELETE_IF,
    KIND_ROOM,
    MAX_KEY,
    NEW_LEASE,
    PROBE_ADD,
    READ,
    REPLACE_IF,
    REWRITTEN_LEASE,
    SET_FOREVER,
    STATS,
    Clocks,
    Held,
    Lease,
    Session,
    dt,
    encode_name,
    json_text,
    ms,
    new_cas,
    read_lease,
    ttl_arg,
)  # fmt: skip
from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend

EPOCH = 1_577_836_800  # 2020-01-01T00:00:00Z: server start times count from here (tokens)
_HELD_MAX = 4096  # leases whose CAS a store remembers for one-round-trip release/extend
_monotonic = time.monotonic
# Requests: see :mod:`latchkey.stores.io.memcached`.


class Memcached(Store):
    """Leases in memcached: ``add`` to take, CAS-checked meta commands to extend and release."""

    scheme = "memcached"
    capabilities = Capabilities(durable=False, listing=False, survives_eviction=False)
    poll_share = 0.02  # no push, cheap polls: the first waiter polls by its wait (waiting.md)
    options = {"prefix": Option(key_prefix, "latchkey:", "prefix of every key latchkey writes")}
    sync_driver = "latchkey.stores.io.memcached:MemcachedDriver"
    async_driver = "latchkey.stores.io.memcached_async:AsyncMemcachedDriver"

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        url = self.url
        if not url.hosts:
            raise ConfigError("memcached store: the URL names no server (memcached://host:port)")
        if url.username or url.password:
            raise ConfigError("memcached store: the text protocol has no login; remove user:pass@")
        if url.path.strip("/"):
            raise ConfigError(f"memcached store: unexpected path {url.path!r} in the URL")
        self.prefix: bytes = self.config["prefix"].encode("ascii")
        self._room = MAX_KEY - KIND_ROOM - len(self.prefix)  # for a plain name in a key
        self.servers = [(host, port or DEFAULT_PORT) for host, port in url.hosts]  # by node
        self._nodes = {f"{host}:{port}": node for node, (host, port) in enumerate(self.servers)}
        self._ring = RendezvousHash(list(self._nodes))
        self._one = len(self.servers) == 1  # one server: no hashing
        self._clock = Clocks(len(self.servers))  # each server's clock (whole seconds)
        self._sessions: list[Session | None] = [None] * len(self.servers)  # the last greeted
        self._limits: dict[str, int] = {}  # slot counts of semaphores seen by this store
        self._names: dict[str, tuple[bytes, bytes]] = {}  # name → (lock key, JSON literal)
        self._held: dict[tuple[str, str], Held] = {}  # (name, owner) → our lease's CAS, …
        self._info = ("", b'""')  # the last owner_info and its JSON string literal
        after_fork(self)

    def forget_after_fork(self) -> None:
        self._held = {}  # a child remembers nothing (its parent may release those leases)

    def greet(self, node: int) -> Steps[Session]:
        """A connection's session: ``stats`` (clock, start) and the instance id, one trip."""
        fresh, key, before = os.urandom(8).hex().encode(), self.prefix + b"instance", _monotonic()
        block, added, (line, instance) = yield trip(
            node, [STATS, ADD % (key, len(fresh), 0, fresh), READ % key]
        )
        now, uptime = stats(block[1], b"time", b"uptime")
        after = _monotonic()
        written(added)  # HD: we wrote the id; NS: it was there
        if line[:2] == b"VA" and flag(line, b"c") == 0:
            message = "the server runs with CAS disabled (memcached -C): no owner checks, tokens"
            raise ConfigError(f"memcached store: {message}")
        session = max(0, now - uptime - EPOCH), instance if line[:2] == b"VA" else None
        same = session[1] is not None and self._sessions[node] == session
        self._clock.read(node, now, before, after, same)
        self._sessions[node] = session
        return session

    def _key(self, kind: str, name: str, slot: int = 0) -> bytes:
        label = kind if slot == 0 else f"slot{slot}"
        return self.prefix + label.encode("ascii") + b":" + self._encode(name)

    def _encode(self, name: str) -> bytes:
        return encode_name(name, self._room)

    def _hot_name(self, name: str) -> tuple[bytes, bytes]:
        """``P lock:N`` and the name as a JSON literal, remembered for names used lately."""
        self._names = self._names if len(self._names) < _HELD_MAX else {}
        known = self._names[name] = (self._key("lock", name), json_text(name))
        return known

    def _node(self, name: str) -> int:
        return 0 if self._one else self._nodes[self._ring.get_node(self._encode(name).decode())]

    def _by_node(self, names: Sequence[str]) -> dict[int, list[str]]:
        nodes = [self._node(name) for name in names]
        return {n: [x for x, m in zip(names, nodes, strict=True) if m == n] for n in set(nodes)}

    def _remember(self, name: str, owner: str, held: Held) -> None:
        if len(self._held) >= _HELD_MAX:  # bounded: drop the oldest (never released, say)
            self._held.pop(next(iter(self._held), ("", "")), None)
        self._held[name, owner] = held

    def _forget(self, name: str, owner: str, session: Session) -> Held | None:
        """What we remember of (name, owner), if valid on the server process of ``session``."""
        held = self._held.pop((name, owner), None)
        if held is None or held[2] != session:
            return None  # unknown, or from another server lifetime: its CAS proves nothing
        return held

    def _taken(
        self, live: Sequence[Lease], name: str, owner: str, session: Session, node: int
    ) -> Grant | Busy:
        """An acquire that added no lease (``live``: the leases it saw): the owner's lease as
        it is (never a second slot), or Busy; memcached's TTL left caps the times given."""
        mine = next((s for s in live if s.owner == owner), None)
        if mine is None:
            if not live:
                return Busy(0)
            soonest = min(live, key=lambda s: (s.ttl_left, s.expires))
            return Busy(len(live), soonest.holder(), float(max(soonest.ttl_left, 0)))
        if session[1] is not None:
            info, acquired = str(mine.data["i"]), int(mine.data["a"])
            self._remember(name, owner, (mine.key, mine.cas, session, mine.token, info, acquired))
        left = min(mine.expires - self._clock.now(node), mine.ttl_left - 1.0)
        return Grant(mine.token, dt(mine.expires), max(0.0, left))

    def _each_slot(
        self, node: int, name: str, command: bytes, limit: int = 0
    ) -> Steps[list[tuple[bytes, Reply]]]:
        """``command`` on each slot after a read of the slot count (or the write of ``limit``):
        one round trip, two for a semaphore with more slots than we knew."""
        known, key = limit or self._limits.get(name, 1), self._key("limit", name)
        first = SET_FOREVER % (key, len(str(limit)), str(limit).encode()) if limit else READ % key
        keys = [self._key("lock", name, i) for i in range(known)]
        replies = yield trip(node, [first, *(command % k for k in keys)])
        line, data = replies[0]  # the slot count (absent, or written: 1)
        if (count := int(data) if line[:2] == b"VA" and data and data.isdigit() else 1) > known:
            self._limits[name] = count
            more = [self._key("lock", name, i) for i in range(known, count)]
            keys += more
            replies += yield trip(node, [command % k for k in more])
        return list(zip(keys, replies[1:], strict=True))

    def _mine(self, node: int, name: str, owner: str) -> Steps[Lease | None]:
        slots = [read_lease(k, r) for k, r in (yield from self._each_slot(node, name, READ))]
        return next((s for s in slots if s and s.owner == owner), None)

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        """Add a lease in a free slot (a semaphore writes its limit and reads its slots first),
        else the owner's own lease (the probe read it), or Busy. Built with the last session
        seen; on a connection of another (the driver's answer), built again."""
        node = 0 if self._one else self._node(name)
        session = self._sessions[node] or (yield node)
        live: list[Lease] = []
        if limit == 1:  # a mutex: try the add at once
            key, quoted_name = self._names.get(name) or self._hot_name(name)
        else:
            read = yield from self._each_slot(node, name, READ, limit)
            slots = [(k, read_lease(k, r)) for k, r in read]
            live = [s for _, s in slots if s]
            if len(live) == limit or any(s.owner == owner for s in live):
                return self._taken(live, name, owner, session, node)
            key = random.choice([k for k, s in slots if not s])  # contenders spread out
            quoted_name = json_text(name)
        acquired = int(self._clock.now(node) * 1000)
        expires, expiry = acquired + round(ttl * 1000), ttl_arg(ttl, self._clock.at_most(node))
        last, info = self._info
        if owner_info is not last:  # the core passes the same owner JSON text again and again
            self._info = (owner_info, info := json_text(owner_info))
        value = NEW_LEASE % (quoted_name, json_text(owner), info, session[0], acquired, expires)
        answer = yield (node, PROBE_ADD % (key, key, len(value), expiry, value), 2, True, session)
        if answer.__class__ is tuple:  # a connection to a newer server process: again
            self._sessions[node] = answer
            return (yield from self.acquire(name, owner, owner_info, ttl, limit))
        probe, added = answer
        line = added[0]
        if line[:4] == b"HD c" and (digits := line[4:]).isdigit() and (cas := int(digits)) > 0:
            pass  # stored: the common reply, taken as is
        elif not written(added):
            winner = read_lease(key, probe)  # who holds the slot (None: it was taken just now)
            return self._taken([*live, winner] if winner else live, name, owner, session, node)
        else:
            cas = new_cas(added)
        token = (session[0] << 32) + cas
        if session[1] is not None:
            self._remember(name, owner, (key, cas, session, token, owner_info, acquired))
        return Grant(token, dt(expires / 1000))  # the lease's, to the ms

    def release(self, name: str, owner: str) -> Steps[bool]:
        """By the CAS we remember (one trip); else, or if it changed or is gone, read first."""
        node = 0 if self._one else self._node(name)
        if (held := self._held.pop((name, owner), None)) is not None:
            # Sent only on the server process that gave the CAS (else the answer is a session).
            answer = yield (node, DELETE_IF % (held[0], held[1]), 1, False, held[2])
            if answer.__class__ is list and (answer[0][0] == b"HD" or written(answer[0])):
                return True  # the item with our CAS was there, live: ours, now gone
        for _ in range(3):  # a renewal in flight may rewrite it (new CAS) between read and delete
            if (mine := (yield from self._mine(node, name, owner))) is None:
                return False
            if written((yield trip(node, [DELETE_IF % (mine.key, mine.cas)]))[0]):
                return True
        return False

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        """By the CAS we remember (one trip); else, or if it changed, read once to decide."""
        node = self._node(name)
        session = yield node
        if (held := self._forget(name, owner, session)) is not None:
            grant = yield from self._rewrite(node, session, name, owner, held, ttl)
            if grant is not None:
                return grant
        if (mine := (yield from self._mine(node, name, owner))) is None:
            return None
        held = (mine.key, mine.cas, session, mine.token, mine.data["i"], ms(mine.acquired))
        return (yield from self._rewrite(node, session, name, owner, held, ttl))

    def _rewrite(
        self, node: int, session: Session, name: str, owner: str, held: Held, ttl: float
    ) -> Steps[Grant | None]:
        """A new expiry if the CAS is still the one held; the value now holds the token."""
        key, cas, _, token, info, acquired_ms = held
        now = self._clock.now(node)
        value = REWRITTEN_LEASE % (
            json_text(name), json_text(owner), json_text(info), token, acquired_ms, ms(now + ttl)
        )  # fmt: skip
        expiry = ttl_arg(ttl, self._clock.at_most(node))
        command = REPLACE_IF % (key, len(value), expiry, cas, value)
        if not written(reply := (yield trip(node, [command]))[0]):
            return None
        if session[1] is not None:
            self._remember(name, owner, (key, new_cas(reply), session, token, info, acquired_ms))
        return Grant(token, dt(now + ttl))

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        slots = yield from self._each_slot(self._node(name), name, READ)
        live = sorted(
            filter(None, [read_lease(k, r) for k, r in slots]), key=lambda s: (s.acquired, s.token)
        )
        return LockInfo(name, tuple(s.holder() for s in live)) if live else None

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        raise Unsupported("the memcached store cannot list locks (memcached cannot enumerate keys)")
        yield  # (a generator)

    def force_release(self, name: str) -> Steps[bool]:
        slots = yield from self._each_slot(self._node(name), name, DELETE)
        return any([written(reply) for _, reply in slots])  # HD only for a live item

    def purge_expired(self, limit: int | None) -> Steps[int]:
        return 0  # memcached drops expired items itself
        yield

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        """Every name's add in one pipelined batch per server; held names are skipped."""
        grants: dict[str, Grant] = {}
        for node, group in self._by_node(names).items():
            session = started, _ = yield node
            now = self._clock.now(node)
            acquired, expires, quoted = (
                ms(now),
                ms(now + ttl),
                (json_text(owner), json_text(owner_info)),
            )
            hot = [self._hot_name(name) for name in group]
            values = [NEW_LEASE % (n, *quoted, started, acquired, expires) for _, n in hot]
            adds = [
                ADD % (k, len(v), ttl_arg(ttl, self._clock.at_most(node)), v)
                for (k, _), v in zip(hot, values, strict=True)
            ]
            for name, (key, _), reply in zip(group, hot, (yield trip(node, adds)), strict=True):
                if written(reply):  # else held by someone else: skipped
                    token = (started << 32) + (cas := new_cas(reply))
                    grants[name] = Grant(token, dt(now + ttl))
                    if session[1] is not None:
                        self._remember(
                            name, owner, (key, cas, session, token, owner_info, acquired)
                        )
        return grants

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        """Per server, deletes by the CAS we remember and reads of the rest, then by CAS read."""
        released = 0
        for node, group in self._by_node(names).items():
            session = yield node
            deletes: list[tuple[bytes, int, bool]] = []  # key, CAS, remembered (not read)?
            reads: list[bytes] = []
            for name in group:
                if (held := self._forget(name, owner, session)) is None:
                    reads.append(self._key("lock", name))
                else:
                    deletes.append((held[0], held[1], True))
            while deletes or reads:
                commands = [DELETE_IF % (k, cas) for k, cas, _ in deletes]
                replies = yield trip(node, commands + [READ % k for k in reads])
                done = [written(r) for r in replies[: len(deletes)]]
                released += sum(done)
                found = [
                    read_lease(k, r) for k, r in zip(reads, replies[len(deletes) :], strict=True)
                ]
                reads = [k for (k, _, mem), ok in zip(deletes, done, strict=True) if mem and not ok]
                deletes = [(s.key, s.cas, False) for s in found if s and s.owner == owner]
        return released

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        value, version, _ = yield from self._record(self._node(name), self._key("record", name))
        return value, version

    def _record(self, node: int, key: bytes) -> Steps[tuple[str | None, int, int]]:
        """A record's JSON text, version and CAS (absent: None, 0, 0)."""
        ((line, data),) = yield trip(node, [READ % key])
        if line[:2] == b"EN":
            return None, 0, 0
        try:
            record = json.loads(data if line[:2] == b"VA" and data is not None else b"")
            return str(record["d"]), int(record["v"]), flag(line, b"c")
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"unreadable record at {key!r}: {line!r} {exc}") from None

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        node, key = self._node(name), self._key("record", name)
        data = json.dumps({"v": version + 1, "d": value}, separators=(",", ":")).encode()
        command = ADD % (key, len(data), 0, data)  # version 0: create only
        if version != 0:
            _, current, cas = yield from self._record(node, key)
            if current != version:
                return None
            command = REPLACE_IF % (key, len(data), 0, cas, data)
        return version + 1 if written((yield trip(node, [command]))[0]) else None

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        node, key = self._node(name), self._key("record", name)
        _, current, cas = yield from self._record(node, key)
        if version == 0 or current != version:
            return False
        return written((yield trip(node, [DELETE_IF % (key, cas)]))[0])

    def now(self) -> Steps[datetime]:
        """The first server's clock: its whole-second ``stats`` time, ± 0.5 s."""
        before = _monotonic()
        ((_, block),) = yield trip(0, [STATS])
        self._clock.read(0, stats(block, b"time")[0], before, _monotonic(), same=True)
        return dt(self._clock.now(0))


class MemcachedBackend(StoreBackend):
    store_class = Memcached


class AsyncMemcachedBackend(AsyncStoreBackend):
    store_class = Memcached
