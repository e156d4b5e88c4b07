"""The ZooKeeper store's nodes as data: what a lease node holds, how its name and data read,
which nodes hold a slot, and a waiter's place in line (:mod:`latchkey.stores.zookeeper` has
the rules; this module the node format they read and write)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from latchkey._owner import Owner
from latchkey._types import Busy, Holder
from latchkey.stores.io.kazoo import deleted

_CHILD = re.compile(r"^([0-9a-f]{32})-([0-9]{10})$")
SEGMENT = re.compile(r"^[A-Za-z0-9_:.\-]{1,100}$")


def dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def ttl_ms(ttl: float) -> int:
    return max(1, math.ceil(ttl * 1000))


def failed(answer: Any) -> bool:
    return isinstance(answer, BaseException)


def encode(ttl: float, limit: int, info: str) -> bytes:
    """A lease node's data."""
    return json.dumps({"t": ttl_ms(ttl), "n": limit, "i": info}).encode()


@dataclass(frozen=True)
class Node:
    """A lease node as read: its child name, owner, sequence number, data and stat."""

    child: str
    owner: str
    seq: int
    ttl: int
    limit: int
    info: str
    stat: Any  # kazoo's ZnodeStat

    @property
    def expires(self) -> int:
        """When it runs out, in ms of the server's clock."""
        return int(self.stat.mtime) + self.ttl

    def holder(self) -> Holder:
        return Holder(
            self.stat.czxid, Owner.from_json(self.info), dt(self.stat.ctime), dt(self.expires)
        )


def parse_child(child: str) -> tuple[str, int] | None:
    """``<owner>-<seq>`` → (owner, seq); None for a node latchkey did not make."""
    found = _CHILD.match(child)
    return None if found is None else (found.group(1), int(found.group(2)))


def read_node(child: str, answer: Any) -> Node | None:
    """A Get's answer → Node; None if it is gone or not latchkey's."""
    parsed = parse_child(child)
    if parsed is None or failed(answer):
        return None
    data, stat = answer
    try:
        fields = json.loads(data)
        return Node(child, *parsed, int(fields["t"]), int(fields["n"]), str(fields["i"]), stat)
    except (ValueError, KeyError, TypeError):
        return None


def in_order(children: Any) -> list[str]:
    """latchkey's children of a name, in sequence order (a failed read: none)."""
    if failed(children):
        return []
    return sorted((c for c in children if parse_child(c)), key=lambda c: c[-10:])


def holders(nodes: Iterable[Node], now: int) -> list[Node]:
    """The live nodes that hold a slot: fewer than their limit live nodes before them."""
    live = [n for n in nodes if n.expires > now]
    return [n for rank, n in enumerate(live) if rank < n.limit]


def waiting_processes(nodes: Iterable[Node], held: Iterable[Node], now: int) -> int:
    """How many processes wait in line: the owners of the live nodes that hold no slot, told
    apart by the owner record each node carries (host, pid, process start), so the threads,
    coroutines and stores of one process count once; a node without one (not written by
    latchkey's Owner) counts by its session. A try that does not wait deletes its node in
    its next round trip, so it shows for that long at most."""
    holding = {n.child for n in held}
    processes: set[object] = set()
    for node in nodes:
        if node.expires > now and node.child not in holding:
            owner = Owner.from_json(node.info)
            key = (owner.host, owner.pid, owner.started) if owner.pid else node.stat.ephemeralOwner
            processes.add(key)
    return len(processes)


class Held(NamedTuple):
    """A lease this store object holds: its node, and the node's last write if this object
    made it (``stat``: its mtime and version; ``sent``: the local monotonic time that write
    was sent; ``ttl``: the node's t, ms)."""

    path: str
    limit: int
    info: str
    stat: Any = None
    sent: float = 0.0
    ttl: int = 0

    def live_until(self) -> float:
        """The local monotonic time until which the node is live for sure, had nobody else
        written it: the server's clock reads at most its ``mtime`` plus the local time since
        the write was sent, 1 % faster, plus 2 ms (-inf: its last write is not known)."""
        if self.stat is None:
            return -math.inf
        return self.sent + (self.ttl - 2) / 1010


@dataclass
class InLine:
    """A waiter's place: its node and its waiter (whose ``wake`` the watches call)."""

    path: str
    waiter: Any
    info: str
    stat: Any = None
    """The node's stat as of its last write (create or refresh: ``mtime``, the server's time
    of that write; ``czxid``, the token), and the local monotonic time that write was sent."""
    refreshed: float = 0.0
    watched: list[str] = field(default_factory=list)
    """The live nodes ahead that kept it waiting at its last full look, and that answer."""
    busy: Busy | None = None
    expiries: list[int] = field(default_factory=list)
    """When the watched nodes run out, as last read (ms, server clock; an extend only
    moves them later)."""
    wakes: int = 0
    """Watch notices so far, and how many there had been at the last look."""
    looked: int = 0
    whole: bool = False
    """The watched nodes are every node ahead that may be live: the last look read the whole
    line ahead, and each live node in it is watched."""
    gone: set[str] = field(default_factory=set)
    """The paths of watched nodes whose deletion a watch event told (nothing revives a node)."""
    heard: float = 0.0
    """When the request that set the watches was sent (local monotonic): the session lives at
    least ``session_timeout`` past it."""

    def latest(self) -> int:
        """The latest the server's clock can read now (ms): the node's last write plus the
        local time since it was sent, 1 % faster, plus 2 ms."""
        return int(self.stat.mtime) + int((time.monotonic() - self.refreshed) * 1010) + 2

    def wake(self, event: Any = None) -> None:
        """A watch fired (on kazoo's thread), or found its node gone already (``event`` None,
        on the caller's thread)."""
        path = deleted(event)
        if path is not None:
            self.gone.add(path)
        self.wakes += 1
        self.waiter.wake()
