"""The ZooKeeper store's line: who holds a name and who waits (mixed into
:class:`latchkey.stores.zookeeper.ZooKeeper`, whose docstring has the rules;
:mod:`latchkey.stores.zookeeper_nodes` has the node format).

A decision needs the server's time, and ZooKeeper has no clock read. Two ways to know it,
and a third that needs no time:

- *At a write* (exact): the ``mtime`` of the caller's own create or refresh in the same
  request. Every read that follows on the session sees every transaction before that write,
  so a node read as expired at that time had expired. An acquire decides so, and a waiter
  whose node is old or who suspects a node ahead ran out.
- *At a read* (bounds; a woken waiter): the server's time is at least ``lo``, the latest
  ``mtime`` the session has seen (its node's last write, the nodes it just read), and at most
  ``hi``, that write's ``mtime`` plus the local time since it was sent (1 % faster, 2 ms
  more). A node ahead that ran out by ``lo`` stays out (never revived), one that lasts past
  ``hi`` is live; a node in between may have run out, and only then does the waiter decide
  again at a write.
- *By the watches* (no request; a woken waiter that knows its whole line): a waiter that read
  the whole line ahead at its last look (or when it joined the line, in the same request as
  its node's create) and watches every node in it that may be live counts the deletions its
  watches tell; with fewer than ``limit`` left, it holds the lease (:meth:`Line._handed_over`
  says why that is sound). So a lock's hand-off — the holder just ahead deleted by its
  release, its watch fired — costs the woken waiter nothing; else one read: list the line.

A waiter granted by a read or by the watches takes the lease as its node stands: its ``mtime``
is from the waiter's last write, less than a third of the TTL ago (a waiter rewrites its node
when it is older), so the lease has at least two thirds of its TTL left, and
``Grant.remaining`` says how much (the core's deadline counts from there; the renewer extends
it every third of that).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from latchkey._types import Busy, Grant
from latchkey.stores.io import Steps
from latchkey.stores.io.kazoo import Batch, Children, Create, Delete, Get, NewWaiter, SetData, Watch
from latchkey.stores.zookeeper_nodes import (
    Held,
    InLine,
    Node,
    encode,
    failed,
    in_order,
    read_node,
    ttl_ms,
)

#: Busy answers kept for a wait_in_line that may follow (the newest; dict order).
SEEN = 256
#: A waiter's node is young while it was written less than this part of its TTL ago: then its
#: polls answer busy from an estimate, and a woken waiter decides by a read.
YOUNG = 1 / 3


class Line:
    """The primitives of waiting in line, and the decision every acquire ends with."""

    _line: dict[tuple[str, str], InLine]
    _held: dict[tuple[str, str], Held]
    _seen: dict[tuple[str, str], tuple[list[str], Busy, list[int], bool]]  # kept by _decide
    session_timeout: float

    if TYPE_CHECKING:  # the store's own (ZooKeeper)

        def parent(self, name: str) -> str: ...

        def _ensure(self) -> Steps[None]: ...

        def _grant(self, name: str, owner: str, path: str, stat: Any, ttl: float, limit: int,
                   info: str, left: float | None = None, sent: float | None = None,
                   ) -> Grant: ...  # fmt: skip

    def _decide(
        self,
        name: str,
        owner: str,
        info: str,
        path: str,
        stat: Any,
        children: Any,
        ttl: float,
        limit: int,
        entry: InLine | None = None,
        sent: float | None = None,
    ) -> Steps[Grant | Busy]:
        """:meth:`_judge` at the time of the caller's own write in this request (``stat``,
        sent at ``sent``, or the entry's): never in doubt."""
        decided = yield from self._judge(
            name, owner, info, path, stat, children, ttl, limit, entry, sent=sent
        )  # fmt: skip
        assert decided is not None  # lo == hi: no node in between
        return decided

    def _judge(
        self,
        name: str,
        owner: str,
        info: str,
        path: str,
        stat: Any,
        children: Any,
        ttl: float,
        limit: int,
        entry: InLine | None = None,
        by_read: bool = False,
        sent: float | None = None,
    ) -> Steps[Grant | Busy | None]:
        """Granted if fewer than ``limit`` live nodes are ahead of ``path``; else busy: the
        caller's node leaves (or, in line, watches the nodes ahead). Live at ``stat.mtime``
        (the caller's write in this request), or ``by_read`` (a waiter's look: ``stat`` is
        its node's last write) at the server's time within bounds: None when a node ahead
        may have run out in between, or the caller's own node."""
        parent, seq = self.parent(name), int(path[-10:])
        ahead = [c for c in in_order(children) if int(c[-10:]) < seq]
        estimate = entry.latest() if by_read and entry is not None else int(stat.mtime)
        nodes, read_all = yield from self._ahead(parent, ahead, limit, estimate)
        lo = max([int(stat.mtime), *(int(n.stat.mtime) for n in nodes)])
        hi = max(lo, entry.latest() if by_read and entry is not None else lo)
        live = [n for n in nodes if n.expires > lo]  # live for sure if after hi
        stale = tuple(Delete(f"{parent}/{n.child}", n.stat.version) for n in nodes
                      if n.expires <= lo)  # fmt: skip
        if len(live) < limit:
            left = None
            if by_read and entry is not None:
                left = ttl - (time.monotonic() - entry.refreshed)
                if hi >= int(stat.mtime) + ttl_ms(ttl) or left <= 0:
                    return None  # its own node may have run out
            if stale:
                yield Batch(stale)
            sent = entry.refreshed if entry is not None else sent
            return self._grant(name, owner, path, stat, ttl, limit, info, left, sent)
        if sum(n.expires > hi for n in live) < limit:
            return None  # a node ahead may have run out (only by a read: lo < hi)
        watched = live[-1:] if limit == 1 else live  # the deletions that may free a slot
        whole = read_all and len(watched) == len(live)  # see InLine.whole
        if entry is None:
            yield Batch((Delete(path), *stale))
        else:
            entry.whole = False
            ops = tuple(Watch(f"{parent}/{n.child}", entry.wake) for n in watched)
            entry.heard = time.monotonic()
            answers = yield Batch((*stale, *ops))
            if any(map(failed, answers[len(stale) :])):
                entry.wake()  # gone already: the waiter reads the line
            entry.whole = whole
        soonest = min(live[:limit], key=lambda n: n.expires)
        busy = Busy(len(live), soonest.holder(), max(0, soonest.expires - hi) / 1000)
        seen = ([n.child for n in watched], busy, [n.expires for n in watched], whole)
        if entry is not None:
            entry.watched, entry.busy, entry.expiries = seen[:3]
        else:  # for wait_in_line, which the core calls next when it waits
            self._seen[(name, owner)] = seen
            while len(self._seen) > SEEN:
                self._seen.pop(next(iter(self._seen)))
        return busy

    def _handed_over(self, name: str, owner: str, ttl: float, limit: int, entry: InLine,
                     ) -> Grant | None:  # fmt: skip
        """A hand-off told by the watches alone, without a request: the lease if fewer than
        ``limit`` of the nodes that may be live ahead are left, else None (read the line).

        - No other node can be ahead: the last look read the whole line ahead and watches
          every node in it that may be live (``entry.whole``), and nodes only join at the end.
        - Those it counts out are gone: a deletion event is final (nothing revives a node; a
          watch found gone already when set is not counted: the waiter reads the line).
        - Its own node is there: the event came on its session (kazoo has one at a time; the
          loss of a session drops every watch, and fails every request not yet answered), so
          the session was alive at that deletion, and with it the node — which latchkey
          deletes only through its owner, once it ran out (not yet: checked below), or by
          ``force_release``, which deletes a line front to back: the node ahead first, so
          the waiter held the lease when its own node went.

        The lease is the node as it stands, bounded as one granted by a read (:meth:`_judge`),
        and by the session: that lives ``session_timeout`` past the request that set the
        watches (``entry.heard``); past a third of it, the waiter reads instead."""
        if not entry.whole:
            return None
        parent = self.parent(name)
        left = [c for c in entry.watched if f"{parent}/{c}" not in entry.gone]
        if len(left) >= limit:
            return None
        now = time.monotonic()
        own = ttl - (now - entry.refreshed)
        session = self.session_timeout - (now - entry.heard)
        if entry.latest() >= int(entry.stat.mtime) + ttl_ms(ttl) or own <= 0:
            return None  # its own node may have run out
        if session < self.session_timeout * (1 - YOUNG):
            return None  # the session's end is not far enough: a request pushes it back
        return self._grant(name, owner, entry.path, entry.stat, ttl, limit, entry.info,
                           min(own, session), entry.refreshed)  # fmt: skip

    def _ahead(
        self, parent: str, ahead: list[str], limit: int, now: int
    ) -> Steps[tuple[list[Node], bool]]:
        """The nodes ahead that decide: the first and the last ``limit`` of them (the holders
        and the nearest), and all of them only if fewer than ``limit`` of those are live;
        and whether every node ahead was read."""
        if not ahead:
            return [], True
        picks = sorted(
            {*range(min(limit, len(ahead))), *range(max(0, len(ahead) - limit), len(ahead))}
        )
        got = yield Batch(tuple(Get(f"{parent}/{ahead[i]}") for i in picks))
        read = {i: read_node(ahead[i], a) for i, a in zip(picks, got, strict=True)}
        live = sum(1 for n in read.values() if n is not None and n.expires > now)
        rest = [i for i in range(len(ahead)) if i not in read]
        if rest and live < limit:
            got = yield Batch(tuple(Get(f"{parent}/{ahead[i]}") for i in rest))
            read.update((i, read_node(ahead[i], a)) for i, a in zip(rest, got, strict=True))
        return [n for _, n in sorted(read.items()) if n is not None], len(read) == len(ahead)

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        if not owner:
            return None  # a plain subscription: the core polls
        yield from self._ensure()
        parent = self.parent(name)
        mine = Create(f"{parent}/{owner}-", encode(ttl, limit, owner_info), True, True)
        waiter = yield NewWaiter(name, owner)
        # The nodes that kept the caller's attempt waiting are ahead of its new node too:
        # watched from the start, they spare its first look a listing of the whole line. If
        # they were all that may be live ahead of it then (``whole``), the line as it stands
        # right after the new node, read in the same request, tells whether they still are:
        # then a release is handed over by its watch event alone (_handed_over).
        watched, busy, expiries, whole = self._seen.pop((name, owner), ([], None, [], False))
        entry = InLine("", waiter, owner_info, None, 0.0, watched, busy, expiries)
        watches = tuple(Watch(f"{parent}/{c}", entry.wake) for c in watched)
        listing = (Children(parent),) if whole else ()
        sent = time.monotonic()
        created, *answers = yield Batch((mine, *listing, *watches))
        if failed(created):  # the name's node was purged meanwhile: make it (a create that
            sent = time.monotonic()  # fails is a logged transaction too: not sent each time)
            _, created, *answers = yield Batch((Create(parent), mine, *listing, *watches))
        if failed(created):
            return None
        if any(map(failed, answers[len(listing) :])):
            entry.wake()  # gone already
        (entry.path, entry.stat), entry.refreshed, entry.heard = created, sent, sent
        if whole:
            line, child = in_order(answers[0]), entry.path.rsplit("/", 1)[1]
            ahead = {c for c in line if int(c[-10:]) < int(child[-10:])}
            entry.whole = child in line and ahead <= set(watched)
        self._line[(name, owner)] = entry
        return waiter

    def _attempt_in_line(
        self, name: str, owner: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        """An attempt of a waiter. While its node is young (written less than a third of its
        TTL ago, by the local clock): if no watch fired since its last look, it answers busy
        from what it last read, without a request, as long as the nodes it waits behind are
        live by the server's time estimated from its node's last write and the local time
        since (1 % slower, 2 ms less: an estimate only ever answers busy, never grants); if
        one fired, it holds the lease if the watches' events alone tell it
        (:meth:`_handed_over`), else it lists the line and decides by that read. Otherwise —
        its node is old, a node ahead may have run out, its node is gone — it refreshes its
        node and decides at that write (:meth:`_refresh`)."""
        entry = self._line[(name, owner)]
        elapsed = time.monotonic() - entry.refreshed
        woken, entry.looked = entry.wakes != entry.looked, entry.wakes
        if elapsed < ttl * YOUNG:
            if entry.busy is not None and not woken:
                estimate = int(entry.stat.mtime) + int(elapsed * 990) - 2
                alive = [e for e in entry.expiries if e > estimate]
                if alive and len(alive) >= min(limit, len(entry.expiries)):  # busy, as seen
                    left = (min(alive) - estimate) / 1000
                    return Busy(entry.busy.holders, entry.busy.holder, max(0.0, left))
            else:
                handed = self._handed_over(name, owner, ttl, limit, entry)
                if handed is not None:
                    return handed
                (children,) = yield Batch((Children(self.parent(name)),))
                if not failed(children) and entry.path.rsplit("/", 1)[1] in children:
                    looked = yield from self._judge(
                        name, owner, entry.info, entry.path, entry.stat, children, ttl, limit,
                        entry, by_read=True,
                    )  # fmt: skip
                    if looked is not None:
                        return looked
        return (yield from self._refresh(name, owner, ttl, limit, entry))

    def _refresh(
        self, name: str, owner: str, ttl: float, limit: int, entry: InLine
    ) -> Steps[Grant | Busy]:
        """Rewrite the waiter's node (its lease would start now), list the line and decide at
        the write's ``mtime``; a node that was deleted or had run out joins the line again at
        its end (it may have been skipped: never revived)."""
        parent, data = self.parent(name), encode(ttl, limit, entry.info)
        entry.whole = False  # its node may change: its next look sets the watches again
        sent = time.monotonic()
        old, new, children = yield Batch(
            (Get(entry.path), SetData(entry.path, data), Children(parent))
        )
        node = read_node(entry.path.rsplit("/", 1)[1], old)
        if node is None or failed(new) or node.expires <= new.mtime:
            again = Create(f"{parent}/{owner}-", data, ephemeral=True, sequence=True)
            gone = () if failed(new) else (Delete(entry.path),)
            *_, created, children = yield Batch((*gone, Create(parent), again, Children(parent)))
            if failed(created):
                return Busy(0)
            entry.path, new = created
        entry.stat, entry.refreshed, entry.busy = new, sent, None
        return (yield from self._decide(
            name, owner, entry.info, entry.path, new, children, ttl, limit, entry
        ))  # fmt: skip

    def leave_line(
        self, name: str, owner: str, granted: bool, delete: bool = True
    ) -> Steps[None]:
        """A wait ended: forget the place; delete its node unless it now holds the lease.
        ``delete=False``: the wait ended by an error, and the core gives the owner's node
        back itself (an owner-checked release, in the background after StoreUnavailable):
        a delete here would keep the caller up to one more timeout from its error, against
        a store that has just failed (the chaos run's slow-call rule found acquires taking
        wait + 2 timeouts)."""
        entry = self._line.pop((name, owner), None)
        if entry is not None and not granted:
            self._held.pop((name, owner), None)
            if delete:
                yield Batch((Delete(entry.path),))
