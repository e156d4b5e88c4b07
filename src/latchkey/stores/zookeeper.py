"""``zookeeper://host:2181[,host:2181…][/chroot]``: leases as ephemeral sequential znodes.

Layout, under ``<chroot>/<prefix>`` (``?prefix=``, default ``latchkey``), for a name whose
UTF-8 bytes in hex are ``H``::

    locks/H/<owner>-<seq>   one ephemeral sequential node per holder or waiter; its data
                            {"t": ttl ms, "n": limit, "i": owner info}; its czxid is the
                            fencing token
    locks                   also the clock: a write to it returns the server's time (mtime)
    records/H               a versioned record: JSON text; record version = znode version + 1

The rules (see docs/stores/zookeeper.md for what they mean to a holder):

- A node is *live* while the server's time is before ``mtime + t``: ``mtime`` is set by the
  server on the write that created or last refreshed it. A node whose owner's session ends is
  deleted by ZooKeeper; one whose time ran out is ignored by everyone, and deleted (with a
  version check) by the next acquirer, ``purge_expired`` or its owner.
- A node holds a slot if fewer than its ``n`` live nodes come before it (sequence order): the
  holders are the ``n`` lowest live nodes. Nodes only join at the end, so a node's holders can
  only leave: once granted, a node stays granted while it is live.
- The time a decision is made against ("now") is the ``mtime`` of the caller's own write in the
  same request (its create or refresh): every read that follows on the session sees at least
  every transaction before that write, so a node read as expired at that time had expired. A
  woken waiter decides by its watches' deletion events when it watches every node ahead that
  may be live, else by a read, within bounds of the server's time, and writes only when a
  node may have run out in between (:mod:`~latchkey.stores.zookeeper_line`).
- Extend (and a waiter's refresh) rewrite the node and compare the new ``mtime`` with the old
  ``mtime + t``: a node that had already run out is not revived — it is deleted, and extend
  answers None (a waiter joins the line again at the end).
- Fencing token: the node's ``czxid``, the ensemble-wide transaction id of its creation:
  strictly increasing, durable. Holders of one name are granted in node order.
- A lease also ends with its owner's session, which the server expires ``session_timeout``
  after it last heard from the client: every grant's ``remaining`` is at most that, so the
  holder's own deadline never outlives the session (DESIGN §2.8).

Waiting (:class:`~latchkey.stores.zookeeper_line.Line`): ``wait_in_line`` puts the caller's
node in line and sets a child watch (fires on deletion only) on the live node just ahead of it
(mutex), or on the live nodes ahead it read (semaphores), so a release wakes the next waiter,
not a herd; an attempt looks again only when a watch fired or time ran, and a lock's waiter
with only the holder ahead takes the lease from that holder's deletion event, with no request.
Every request is one :class:`~latchkey.stores.io.kazoo.Batch`: pipelined, one round trip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from latchkey._types import Busy, Grant, LockInfo
from latchkey._url import Option, duration, key_prefix
from latchkey.errors import ConfigError
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps
from latchkey.stores.io.kazoo import Batch, Children, Create, Delete, Get, Multi, SetData
from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend
from latchkey.stores.zookeeper_line import Line
from latchkey.stores.zookeeper_nodes import (
    SEGMENT,
    Held,
    InLine,
    Node,
    dt,
    encode,
    failed,
    holders,
    in_order,
    read_node,
    ttl_ms,
    waiting_processes,
)


def _info(name: str, nodes: list[Node], now: int) -> LockInfo | None:
    """A name's holders, and how many processes wait in line for it (the other live nodes'
    owners: :func:`~latchkey.stores.zookeeper_nodes.waiting_processes`); None if not held."""
    found = holders(nodes, now)
    if not found:
        return None
    return LockInfo(name, tuple(n.holder() for n in found), waiting_processes(nodes, found, now))


class ZooKeeper(Line, Store):
    """Leases, claims and records in ZooKeeper; every request one pipelined batch."""

    scheme = "zookeeper"
    capabilities = Capabilities(push=True)
    options = {
        "prefix": Option(key_prefix, "latchkey", "node under the chroot holding latchkey's"),
        "session_timeout": Option(duration, 10.0, "ZooKeeper session timeout"),
    }
    sync_driver = "latchkey.stores.io.kazoo:KazooDriver"
    async_driver = "latchkey.stores.io.kazoo_async:AsyncKazooDriver"
    local_busy = False  # a waiter's attempts refresh its node: none may be skipped

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        url = self.url
        if not url.hosts:
            raise ConfigError(f"{url.scheme} store: the URL names no host")
        chroot = [s for s in url.path.split("/") if s]
        prefix: str = self.config["prefix"]
        for segment in [*chroot, prefix]:
            if not SEGMENT.match(segment) or segment in (".", ".."):
                raise ConfigError(
                    f"{url.scheme} store: path segment {segment!r} must be 1-100 letters, "
                    "digits and _ : . -"
                )
        if chroot[:1] == ["zookeeper"]:
            raise ConfigError(f"{url.scheme} store: /zookeeper is ZooKeeper's own")
        self.hosts = ",".join(f"{host}:{port or 2181}" for host, port in url.hosts)
        self.session_timeout: float = self.config["session_timeout"]
        self.root = "/" + "/".join([*chroot, prefix])
        self.locks = f"{self.root}/locks"
        self.records = f"{self.root}/records"
        self._ready = False
        self._line: dict[tuple[str, str], InLine] = {}
        self._held: dict[tuple[str, str], Held] = {}
        self._seen: dict[tuple[str, str], tuple[list[str], Busy, list[int], bool]] = {}

    # -- layout ------------------------------------------------------------------------------

    def parent(self, name: str) -> str:
        return f"{self.locks}/{name.encode().hex()}"

    def _ensure(self) -> Steps[None]:
        """Create the root, ``locks`` and ``records`` (first use; NodeExists is fine)."""
        if not self._ready:
            parts = self.root.strip("/").split("/")
            paths = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
            yield Batch(tuple(Create(p) for p in [*paths, self.locks, self.records]))
            self._ready = True

    def _grant(self, name: str, owner: str, path: str, stat: Any, ttl: float, limit: int,
               info: str, left: float | None = None, sent: float | None = None,
               ) -> Grant:  # fmt: skip
        """The lease of the node ``path`` (``stat``: its last write, sent at ``sent`` by
        this object); ``left``: what is left of it, if it was written before this request
        (a waiter's node)."""
        known = (stat, sent, ttl_ms(ttl)) if sent is not None else ()
        self._held[(name, owner)] = Held(path, limit, info, *known)
        sure = min(ttl if left is None else left, self.session_timeout)
        return Grant(stat.czxid, dt(stat.mtime + ttl_ms(ttl)), sure)

    # -- leases ------------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        if (name, owner) in self._line:
            return (yield from self._attempt_in_line(name, owner, ttl, limit))
        yield from self._ensure()
        parent, data = self.parent(name), encode(ttl, limit, owner_info)
        mine = Create(f"{parent}/{owner}-", data, ephemeral=True, sequence=True)
        sent = time.monotonic()
        created, children = yield Batch((mine, Children(parent)))
        if failed(created):  # the name's first lease (or its node was purged): make it
            self._ready = False
            yield from self._ensure()
            sent = time.monotonic()
            _, created, children = yield Batch((Create(parent), mine, Children(parent)))
            if failed(created):
                return Busy(0)  # purged again in between: the core retries at once
        path, stat = created
        again = [c for c in in_order(children) if c.startswith(owner) and c != path[-43:]]
        if again:  # this owner holds the name already: its lease as it is
            return (yield from self._found_again(name, owner, path, stat, again[0]))
        return (yield from self._decide(
            name, owner, owner_info, path, stat, children, ttl, limit, sent=sent
        ))  # fmt: skip

    def _found_again(
        self, name: str, owner: str, path: str, stat: Any, child: str
    ) -> Steps[Grant | Busy]:
        old = f"{self.parent(name)}/{child}"
        _, got = yield Batch((Delete(path), Get(old)))
        node = read_node(child, got)
        if node is None or node.expires <= stat.mtime:
            if node is not None:
                yield Batch((Delete(old, node.stat.version),))
            return Busy(0)
        self._held[(name, owner)] = Held(old, node.limit, node.info)
        left = (node.expires - stat.mtime) / 1000
        return Grant(node.stat.czxid, dt(node.expires), min(left, self.session_timeout))

    def _paths(self, names: Sequence[str], owner: str) -> Steps[list[str | None]]:
        """The node of ``owner`` on each name: known since its grant, else looked up (one
        round trip for all the names not known)."""
        found = {n: h.path for n in names if (h := self._held.get((n, owner))) is not None}
        missing = [n for n in names if n not in found]
        if missing:
            kids = yield Batch(tuple(Children(self.parent(n)) for n in missing))
            for name, children in zip(missing, kids, strict=True):
                mine = [c for c in in_order(children) if c.startswith(owner)]
                if mine:
                    found[name] = f"{self.parent(name)}/{mine[0]}"
        return [found.get(n) for n in names]

    def release(self, name: str, owner: str) -> Steps[bool]:
        return (yield from self.release_many([name], owner)) == 1

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        """Delete the owner's nodes; count those that were live. A node this object wrote
        last and that is live for sure by the local clock (:meth:`Held.live_until`) goes by
        a versioned delete alone, as kazoo's own lock releases: live if its answer came
        while it was sure (else not known to be: counted out). Any other node — or one that
        another object rewrote since (the delete failed) — is read, then deleted in a multi
        that reads the clock (a write to the name's node), and live if it had not run out
        by then."""
        paths = yield from self._paths(names, owner)
        sure: list[tuple[str, str, Held]] = []
        doubt: list[tuple[str, str]] = []
        now = time.monotonic()
        for name, path in zip(names, paths, strict=True):
            held = self._held.pop((name, owner), None)
            if path is None:
                continue
            if held is not None and now < held.live_until():
                sure.append((name, path, held))
            else:
                doubt.append((name, path))
        live = 0
        if sure:
            deleted = yield Batch(tuple(Delete(path, h.stat.version) for _, path, h in sure))
            done = time.monotonic()
            for (name, path, held), answer in zip(sure, deleted, strict=True):
                if failed(answer):  # rewritten by another object (or gone): read it
                    doubt.append((name, path))
                else:
                    live += done < held.live_until()
        if doubt:
            ops = [op for name, path in doubt for op in (
                Get(path), Multi((Delete(path), SetData(self.parent(name), b""))),
            )]  # fmt: skip
            answers = yield Batch(tuple(ops))
            for i, (_, path) in enumerate(doubt):
                old, multi = answers[2 * i], answers[2 * i + 1]
                if failed(multi) or failed(multi[0]):
                    continue
                node = read_node(path.rsplit("/", 1)[1], old)
                live += node is not None and node.expires > multi[1].mtime
        return live

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        held = self._held.get((name, owner))
        if held is None:
            (path,) = yield from self._paths([name], owner)
            if path is None:
                return None
            (got,) = yield Batch((Get(path),))
            node = read_node(path.rsplit("/", 1)[1], got)
            if node is None:
                return None
            held = Held(path, node.limit, node.info)
        path, limit, info = held.path, held.limit, held.info
        sent = time.monotonic()
        old, new = yield Batch((Get(path), SetData(path, encode(ttl, limit, info))))
        node = read_node(path.rsplit("/", 1)[1], old)
        if node is None or failed(new) or node.expires <= new.mtime:
            self._held.pop((name, owner), None)
            if not failed(new):  # it had run out: not revived, gone
                yield Batch((Delete(path, new.version),))
            return None
        return self._grant(name, owner, path, new, ttl, limit, info, sent=sent)

    def _read(self, names: Sequence[str]) -> Steps[tuple[dict[str, list[Node]], int]]:
        """The nodes of each name (in order) and the server's clock, in three round trips."""
        yield from self._ensure()
        parents = [self.parent(n) for n in names]
        *kids, clock = yield Batch((*map(Children, parents), SetData(self.locks, b"")))
        ordered = [in_order(k) for k in kids]
        paths = [f"{p}/{c}" for p, cs in zip(parents, ordered, strict=True) for c in cs]
        got = iter((yield Batch(tuple(map(Get, paths)))) if paths else [])
        nodes = {n: [x for x in (read_node(c, next(got)) for c in cs) if x is not None]
                 for n, cs in zip(names, ordered, strict=True)}  # fmt: skip
        return nodes, int(clock.mtime)

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        nodes, now = yield from self._read([name])
        return _info(name, nodes[name], now)

    def _names(self, prefix: str) -> Steps[list[str]]:
        yield from self._ensure()
        (children,) = yield Batch((Children(self.locks),))
        start, names = prefix.encode().hex(), []
        for child in [] if failed(children) else sorted(children):
            if child.startswith(start):
                try:
                    names.append(bytes.fromhex(child).decode())
                except ValueError:
                    continue
        return names

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        names = yield from self._names(prefix)
        nodes, now = yield from self._read(names)
        return [info for n in names if (info := _info(n, nodes[n], now)) is not None]

    def force_release(self, name: str) -> Steps[bool]:
        """Delete every node of the name, front to back (``Line._handed_over`` counts on it)."""
        nodes, now = yield from self._read([name])
        if nodes[name]:
            yield Batch(tuple(Delete(f"{self.parent(name)}/{n.child}") for n in nodes[name]))
        return bool(holders(nodes[name], now))

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """Delete the nodes that ran out (version-checked: a refreshed one stays) and the
        names left with no node (tokens are global zxids: nothing to keep)."""
        names = yield from self._names("")
        nodes, now = yield from self._read(names)
        ops: list[Any] = []
        for name in names:
            stale = [n for n in nodes[name] if n.expires <= now]
            ops += [Delete(f"{self.parent(name)}/{n.child}", n.stat.version) for n in stale]
            if len(stale) == len(nodes[name]):
                ops.append(Delete(self.parent(name)))  # NotEmpty if someone just joined
        answers = (yield Batch(tuple(ops))) if ops else []
        return sum(1 for op, a in zip(ops, answers, strict=True) if a is True and op.version != -1)

    # -- batch claims: three round trips whatever the number of names ------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        if not names:
            return {}
        yield from self._ensure()
        data, ops = encode(ttl, 1, owner_info), list[Any]()
        for name in names:
            parent = self.parent(name)
            node = Create(f"{parent}/{owner}-", data, ephemeral=True, sequence=True)
            ops += [Create(parent), node, Children(parent)]
        sent = time.monotonic()
        answers = yield Batch(tuple(ops))
        mine: dict[str, tuple[str, Any]] = {}
        ahead: list[tuple[str, str]] = []
        for i, name in enumerate(names):
            created, children = answers[3 * i + 1], answers[3 * i + 2]
            if failed(created):
                continue
            mine[name] = created
            seq = int(created[0][-10:])
            ahead += [(name, c) for c in in_order(children) if int(c[-10:]) < seq]
        got = (yield Batch(tuple(Get(f"{self.parent(n)}/{c}") for n, c in ahead))) if ahead else []
        blocked: set[str] = set()
        for (name, child), answer in zip(ahead, got, strict=True):
            found = read_node(child, answer)
            if found is not None and found.expires > mine[name][1].mtime:
                blocked.add(name)
        grants = {}
        for name, (path, stat) in mine.items():
            if name not in blocked:
                grants[name] = self._grant(name, owner, path, stat, ttl, 1, owner_info, sent=sent)
        busy = tuple(Delete(mine[n][0]) for n in blocked)
        if busy:
            yield Batch(busy)
        return grants

    # -- versioned records: the znode's version -------------------------------------------------

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        yield from self._ensure()
        (got,) = yield Batch((Get(f"{self.records}/{name.encode().hex()}"),))
        return (None, 0) if failed(got) else (got[0].decode(), int(got[1].version) + 1)

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        yield from self._ensure()
        path, data = f"{self.records}/{name.encode().hex()}", value.encode()
        op = Create(path, data) if version == 0 else SetData(path, data, version - 1)
        (got,) = yield Batch((op,))
        return None if failed(got) else version + 1

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        if version == 0:
            return False
        yield from self._ensure()
        (got,) = yield Batch((Delete(f"{self.records}/{name.encode().hex()}", version - 1),))
        return got is True

    # -- clock -------------------------------------------------------------------------------

    def now(self) -> Steps[datetime]:
        """The server's clock: the mtime of a write to ``locks`` (ZooKeeper has no clock
        read; one round trip)."""
        yield from self._ensure()
        (stat,) = yield Batch((SetData(self.locks, b""),))
        return dt(int(stat.mtime))

    def init(self) -> Steps[None]:
        self._ready = False
        yield from self._ensure()


class ZooKeeperBackend(StoreBackend):
    store_class = ZooKeeper


class AsyncZooKeeperBackend(AsyncStoreBackend):
    store_class = ZooKeeper
