"""ZooKeeper through kazoo: the requests of :mod:`latchkey.stores.zookeeper` and its sync driver.

kazoo (the client tooz uses, well kept) runs one session per client on a thread of its own
and pipelines requests: every ``*_async`` call queues one request and returns at once with an
``IAsyncResult``, and the server answers a session's requests in the order they were sent. So
a store request here is a :class:`Batch` of ZooKeeper operations (create, get, get children,
set, delete, a multi, a child watch), all sent at once and answered together: one round trip,
however many operations. The sync driver waits for the answers with ``IAsyncResult.get``
under one deadline: the URL's ``timeout`` for the whole primitive, however many batches it
sends (a deadline per batch let a release that read the node after its quick delete failed
take two timeouts: the chaos run's slow-call rule found it); the asyncio driver
(:mod:`latchkey.stores.io.kazoo_async`) bridges the same results into the event loop.

Outcomes the store gives a meaning to (no node, node exists, bad version, not empty) come back
as the exception *instances*, in the answer list; any other kazoo error (connection loss,
session expired, the deadline passing) fails the whole request and becomes StoreUnavailable.

A request that timed out may still reach the server later (kazoo keeps it queued while it
reconnects): a lease node created that way is deleted as soon as its answer arrives
(:func:`abandon`), so no late node keeps a name busy.

Sessions: one kazoo client per backend, started on first use and reconnecting by itself
(kazoo's own loop; its reconnect delay is capped at one second so a session survives a short
outage), never used across ``fork()``: a child starts its own and leaves its parent's socket
alone (:func:`latchkey.stores.io.after_fork`; closing it would end the parent's session).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType
from kazoo.retry import KazooRetry

from latchkey._types import Grant
from latchkey.stores.base import Waiter, woken
from latchkey.stores.io import Driver, after_fork

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.zookeeper import ZooKeeper


#: Per-operation outcomes returned as values (the exception instance) instead of raised.
OUTCOMES: tuple[type[BaseException], ...] = (
    NoNodeError,
    NodeExistsError,
    BadVersionError,
    NotEmptyError,
)
#: Errors that fail a request (become StoreUnavailable).
ERRORS: tuple[type[BaseException], ...] = (KazooException, KazooTimeoutError, OSError)


# -- the operations of a Batch ------------------------------------------------------------------


class Create(NamedTuple):
    """Create a node → ``(path, ZnodeStat)`` (the path with its sequence number, if any)."""

    path: str
    data: bytes = b""
    ephemeral: bool = False
    sequence: bool = False


class Get(NamedTuple):
    """A node's data and stat → ``(bytes, ZnodeStat)``."""

    path: str


class Children(NamedTuple):
    """A node's children → ``list[str]`` (names, in no order)."""

    path: str


class SetData(NamedTuple):
    """Set a node's data if its version is ``version`` (-1: any) → its new ``ZnodeStat``
    (``mtime``: the server's clock when the write was made)."""

    path: str
    data: bytes
    version: int = -1


class Delete(NamedTuple):
    """Delete a node if its version is ``version`` (-1: any) → True."""

    path: str
    version: int = -1


class Multi(NamedTuple):
    """One ZooKeeper transaction of creates, sets and deletes: all or none → a list with
    each operation's answer (an exception instance where one failed)."""

    ops: tuple[Create | SetData | Delete, ...]


class Watch(NamedTuple):
    """A child watch on ``path`` → its children; ``wake`` is called (on kazoo's thread) with
    kazoo's event when the node is deleted. The lease nodes never have children, so this fires
    on deletion only — not when the node's data changes (an ``exists`` watch would) — or when
    kazoo drops every watch because the connection was lost (it sets none again on its own):
    :func:`deleted` tells the two apart. kazoo calls every watch on one thread, in the order
    the server sent the events: a session's events come in the order of the transactions."""

    path: str
    wake: Callable[[Any], None]


def deleted(event: Any) -> str | None:
    """The path of the node a watch saw deleted; None when the watch ended otherwise (kazoo's
    event of a lost connection, whose type is NONE; a child made under the node)."""
    return event.path if event is not None and event.type == EventType.DELETED else None


Op = Create | Get | Children | SetData | Delete | Multi | Watch


class Batch(NamedTuple):
    """Request: send every operation at once (pipelined, answered in order) → one answer per
    operation; the store's outcomes (:data:`OUTCOMES`) as exception instances."""

    ops: tuple[Op, ...]


class NewWaiter(NamedTuple):
    """Request: a waiter for ``owner``'s place in line on ``name`` → the driver's Waiter (sync)
    or AsyncWaiter, woken by :class:`Watch` callbacks (``waiter.wake``)."""

    name: str
    owner: str


# -- shared by both drivers ---------------------------------------------------------------------


def issue(client: KazooClient, op: Op) -> Any:
    """Queue one operation on kazoo; its IAsyncResult."""
    if isinstance(op, Create):
        return client.create_async(
            op.path, op.data, ephemeral=op.ephemeral, sequence=op.sequence, include_data=True
        )
    if isinstance(op, Get):
        return client.get_async(op.path)
    if isinstance(op, Children):
        return client.get_children_async(op.path)
    if isinstance(op, SetData):
        return client.set_async(op.path, op.data, op.version)
    if isinstance(op, Delete):
        return client.delete_async(op.path, op.version)
    if isinstance(op, Watch):
        return client.get_children_async(op.path, watch=op.wake)
    if isinstance(op, Multi):
        transaction = client.transaction()
        for sub in op.ops:
            if isinstance(sub, Create):
                transaction.create(sub.path, sub.data, None, sub.ephemeral, sub.sequence)
            elif isinstance(sub, SetData):
                transaction.set_data(sub.path, sub.data, sub.version)
            else:
                transaction.delete(sub.path, sub.version)
        return transaction.commit_async()
    raise TypeError(f"not a ZooKeeper operation: {op!r}")


def abandon(client: KazooClient, ops: Sequence[Op], results: Sequence[Any]) -> None:
    """A request failed or timed out: delete every ephemeral node it created or may still
    create (when its answer comes), so that nobody waits behind a node its owner never
    learnt it had."""

    def undo(result: Any) -> None:
        with contextlib.suppress(Exception):
            if result.successful():
                client.delete_async(result.value[0])

    for op, result in zip(ops, results, strict=False):
        if type(op) is Create and op.ephemeral:
            result.rawlink(undo)


#: kazoo's own log ("Connection dropped: …" at every reconnect attempt), under latchkey's
#: name: an application that configures logging sees it; a bare script or the CLI does not
#: get it on stderr through Python's last-resort handler (the store reports the error).
KAZOO_LOG = logging.getLogger("latchkey.kazoo")
KAZOO_LOG.addHandler(logging.NullHandler())


def settings(store: ZooKeeper) -> dict[str, Any]:
    """The KazooClient arguments of a store (the same for both drivers)."""
    return {
        "hosts": store.hosts,
        "timeout": store.session_timeout,
        # kazoo's own reconnect loop (not a primitive's retry): forever, at most 1 s apart,
        # so that a session outlives a short outage of its server.
        "connection_retry": KazooRetry(
            max_tries=-1, delay=0.05, backoff=2, max_jitter=0.05, max_delay=1.0
        ),
        "command_retry": KazooRetry(max_tries=0),
        "logger": KAZOO_LOG,
    }


class Session:
    """One backend's kazoo client: made and started on first use, reconnecting by itself;
    a forked child makes its own (:func:`~latchkey.stores.io.after_fork`)."""

    def __init__(self, store: ZooKeeper) -> None:
        self.store = store
        self.client: KazooClient | None = None
        self.live: Any = None
        self.lock = threading.Lock()
        after_fork(self)

    def forget_after_fork(self) -> None:
        self.client = None  # the parent's session: neither used nor closed here
        self.lock = threading.Lock()

    def started(self) -> tuple[KazooClient, Any]:
        """The client, started (connecting, maybe not connected yet), and the event kazoo
        sets once it is connected."""
        with self.lock:
            if self.client is None:  # started once: start_async again would wait for the
                client = KazooClient(**settings(self.store))  # reconnect loop to end
                self.client, self.live = client, client.start_async()
            return self.client, self.live

    def detach(self) -> KazooClient | None:
        with self.lock:
            client, self.client = self.client, None
        return client


# -- the sync driver ---------------------------------------------------------------------------


class KazooDriver(Driver):
    """Answers each Batch by queuing its operations on kazoo and waiting for the answers."""

    errors = ERRORS

    def __init__(self, backend: BackendBase, store: ZooKeeper) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        self.session = Session(store)

    def client(self, deadline: float) -> KazooClient:
        """A started client; the first time, wait for its connection until ``deadline``."""
        client, live = self.session.started()
        if not client.connected and not live.wait(max(0.0, deadline - time.monotonic())):
            raise KazooTimeoutError(f"no ZooKeeper session within {self.timeout:g}s")
        return client

    def answerer(self) -> Callable[[Any], Any]:
        """A primitive — one batch or several — runs within one timeout in all."""
        deadline = time.monotonic() + self.timeout
        return lambda request: self.answer(request, deadline)

    def answer(self, request: Any, deadline: float | None = None) -> Any:
        if type(request) is Batch:
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            elif time.monotonic() >= deadline:
                raise KazooTimeoutError(f"no time left within the timeout ({self.timeout:g}s)")
            client = self.client(deadline)
            results = [issue(client, op) for op in request.ops]
            answers: list[Any] = []
            try:
                for result in results:
                    try:
                        answers.append(result.get(timeout=max(0.0, deadline - time.monotonic())))
                    except OUTCOMES as exc:
                        answers.append(exc)
            except BaseException:
                abandon(client, request.ops, results)
                raise
            return answers
        if type(request) is NewWaiter:
            return LineWaiter(self, request.name, request.owner)
        raise TypeError(f"not a ZooKeeper request: {request!r}")

    def close(self) -> None:
        client = self.session.detach()
        if client is not None:
            with contextlib.suppress(*ERRORS):
                client.stop()
            client.close()


class LineWaiter(Waiter):
    """One blocked acquire's place in line: woken (on kazoo's thread) when a node ahead of
    its own is deleted; on close it leaves the line (deletes its node) unless the wait ended
    with the lease granted to that node."""

    def __init__(self, driver: KazooDriver, name: str, owner: str) -> None:
        self.driver, self.name, self.owner = driver, name, owner
        self.event = threading.Event()
        self.granted = False
        self.finished = False  # finish() is not called when the wait ends by an error

    def wake(self, _event: Any = None) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return woken(self.event, timeout)

    def finish(self, result: Any) -> None:
        self.granted = isinstance(result, Grant)
        self.finished = True

    def close(self) -> None:
        steps = self.driver.store.leave_line(
            self.name, self.owner, self.granted, delete=self.finished
        )
        with contextlib.suppress(Exception):  # best effort: the node lapses after its TTL
            self.driver.run(steps, "leave the line")
