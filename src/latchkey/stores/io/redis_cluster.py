"""Redis Cluster through redis-py's ``RedisCluster``: the sync driver of
:class:`latchkey.stores.redis_cluster.RedisCluster`.

The cluster's layout is redis-py's ``RedisCluster``'s: it reads which master serves which
slot, and re-reads it after MOVED or a connection error. A script (all keys of one script
share a slot: the store groups them) goes to the master its ``get_node_from_key`` names,
packed in RESP here and sent over a connection of that master's own lock-free stack, as the
plain Redis driver sends (:class:`~latchkey.stores.io.redis.Connections`, connections made
with the class and settings of redis-py's client for that node). An EVALSHA through
redis-py's ``execute_command`` costs about 290,000 instructions and 300 Python calls here,
sending and reading included (command policies, slot and node lookup, the node pool's lock,
observability hooks, response callbacks): an uncontended acquire + release took 680,000
instructions through it, 245,000 this way (callgrind, docs/benchmarks.md). What redis-py's
call does beyond sending, this driver hands back to it:

- a master that answers MOVED, ASK, TRYAGAIN or CLUSTERDOWN has not run the script: it is
  sent again through ``execute_command``, which follows the redirection, updates the
  client's map (so later scripts go straight to the new master), or waits and re-reads the
  layout, as it does for its own commands;
- a connection error or timeout (the script may have run): the node's idle connections are
  closed, the client re-reads the layout (``nodes_manager.initialize``, the failed node asked
  last), as its own ``execute_command`` does, and the error becomes StoreUnavailable; the
  next call goes to the layout read since (a promoted replica, once the cluster has promoted
  one).

Re-reading the layout asks the nodes one after another, each given the whole timeout: with
the network cut, a call that failed after its timeout then waited for every node in turn
(four timeouts on three masters, before it raised). So, once the client has its first
layout, every re-read — this driver's and those redis-py's own calls start after a
connection error — runs in a background thread instead (one at a time per client), and the
call that failed raises at once; the calls meanwhile use the layout they have.

No call retries (redis-py's client is made with ``Retry(NoBackoff(), 0)``): a primitive never
retries, the core decides. A script is sent as EVALSHA and loaded on its slot's master
(SCRIPT LOAD) when that node answers NOSCRIPT. Other requests (commands, a SCAN of one node)
go through the client's ``execute_command``.

The client connects to the cluster when it is made, so it is made on first use (and again
in a forked child, which leaves its parent's sockets alone), in a thread of its own: its
constructor asks the URL's nodes in turn for the layout, each given the whole timeout, and a
call waits for it only up to the timeout (then StoreUnavailable; the next call waits for the
same making, or starts a new one if it failed).

A :class:`~latchkey.stores.redis_cluster.Batch` of scripts (a claim's slots) goes in one
pipeline per master (one round trip per node), each part's error answered as its reply: the
store decides what a failed part means (it gives the whole claim back).

Waiting: sharded pub/sub. One listener connection per master (:class:`ShardedListener`, the
plain Redis driver's :class:`~latchkey.stores.io.redis.Listener` speaking SSUBSCRIBE), made
for the master that holds the channel's slot. If the slot moves or the master fails, the
connection ends or stops hearing: its waiters wake once and poll, and the next subscribe opens
a listener on the slot's master as the client knows it then.

A borrowed cluster client (``latchkey.connect(client=RedisCluster(…))``) is followed, not
used: its startup nodes and AUTH make this driver's own cluster client and listener
connections, with latchkey's timeout, RESP2 and decoded replies (the scripts' replies are
parsed as text; the application's client may read bytes or speak RESP3), and :meth:`close`
never closes it. Its TLS settings are followed too (:func:`borrowed_tls`); its other
settings are not carried over.

TLS (``rediss+cluster://``): the cluster client connects to every node, startup nodes and
those it learns of, over TLS with the URL's options, and so does each listener connection.
A TLS node names the other nodes' TLS ports in its CLUSTER SLOTS reply.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from latchkey.stores.base import Waiter
from latchkey.stores.io import Driver, after_fork
from latchkey.stores.io.redis import (
    Connections,
    Listener,
    PushWaiter,
    RedisDriver,
    pack,
    pack_script,
    passes_on,
    tls_settings,
)
from latchkey.stores.io.redis_options import uses_tls
from latchkey.stores.redis import Command, Subscribe
from latchkey.stores.redis_cluster import Batch, Masters, OnNode

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.redis import Script
    from latchkey.stores.redis_cluster import RedisCluster

# redis-py's cluster client, its node and connection classes are untyped: used as Any
Client: Any = redis.cluster.RedisCluster
Node: Any = redis.cluster.ClusterNode
Connection: Any = redis.Connection
ERRORS: tuple[type[BaseException], ...] = (
    redis.RedisError,
    redis.exceptions.RedisClusterException,  # "no node for this slot", the layout unreadable
    OSError,
)
#: Errors a master answers instead of running a script (its slot moved or is moving, the
#: cluster is down): the script is sent again through redis-py's client, which handles them.
ELSEWHERE: tuple[type[BaseException], ...] = (
    redis.exceptions.AskError,  # and MovedError, its subclass
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)
#: A connection error or timeout on a master's connection: the layout is read again.
LOST: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
#: A newer redis-py (8.x) re-reads the layout asking the failed node last (older: any order).
_ASK_FAILED_LAST = (
    "last_failed_node_name" in inspect.signature(redis.cluster.NodesManager.initialize).parameters
)


def borrowed_tls(store: RedisCluster, client: Any) -> dict[str, Any]:
    """The ``ssl_…`` settings of an application's cluster client (sync or asyncio) that uses
    TLS (the store's scheme is then ``rediss+cluster``: see ``stores.clients``); {} for none."""
    if client is None or not uses_tls(store.url.scheme):
        return {}
    kwargs = client.nodes_manager.connection_kwargs
    return {k: v for k, v in kwargs.items() if k.startswith("ssl_") and v is not None}


def cluster_settings(store: RedisCluster, client: Any = None) -> dict[str, Any]:
    """The arguments of redis-py's cluster clients (sync and asyncio) for a store: every node
    of the URL as a startup node, AUTH, TLS (``rediss+cluster://``: to every node), redis-py's
    options of the URL, the store's timeout, RESP2, replies decoded. ``client``: a borrowed
    cluster client, whose TLS settings are followed."""
    url, timeout = store.url, store.config["timeout"]
    return {
        "startup_nodes": [Node(host or "localhost", port or 6379) for host, port in url.hosts],
        "username": url.username,
        "password": url.password,
        **tls_settings(store),
        **borrowed_tls(store, client),
        **store.config["driver"],  # redis-py's own options of the URL (client_name, ssl_…)
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "decode_responses": True,
        "protocol": 2,
    }


def node_settings(store: RedisCluster, client: Any = None) -> dict[str, Any]:
    """A listener connection's settings (its node's host and port are added); ``ssl``: made
    an ``SSLConnection`` (:func:`connection_class`)."""
    url, timeout = store.url, store.config["timeout"]
    return {
        "username": url.username,
        "password": url.password,
        **tls_settings(store),
        **borrowed_tls(store, client),
        **store.config["driver"],
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "decode_responses": True,
        "protocol": 2,
        "retry": Retry(NoBackoff(), 0),
    }


def connection_class(settings: dict[str, Any], plain: Any, tls: Any) -> Any:
    """``tls`` (an SSLConnection class) if ``settings`` say ``ssl``, else ``plain``; the
    ``ssl`` flag is taken out (a connection class does not take it)."""
    return tls if settings.pop("ssl", False) else plain


NoScript = redis.exceptions.NoScriptError


def _settle(future: Future[Any], fn: Any, *args: Any) -> None:
    """``fn(*args)``'s value or error into ``future`` (a thread's work)."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


def _moved(reply: Any) -> bool:
    """A redirection a plain node client does not follow: ``MOVED slot host:port`` or ASK."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith(("MOVED ", "ASK "))


def scan_reply(reply: Any) -> Any:
    """SCAN through the cluster client comes back as ``({node: cursor}, keys)``: the plain
    ``(cursor, keys)`` of the one node asked."""
    cursor, keys = reply
    if isinstance(cursor, dict):
        (cursor,) = cursor.values()
    return cursor, keys


class ShardedListener(Listener):
    """The shared listener on sharded pub/sub: SSUBSCRIBE, SUNSUBSCRIBE, ``smessage``."""

    SUBSCRIBE = "SSUBSCRIBE"
    UNSUBSCRIBE = "SUNSUBSCRIBE"
    ACKS = ("ssubscribe", "sunsubscribe")
    MESSAGE = "smessage"


class ClusterDriver(Driver):
    """Runs each request through a RedisCluster client; answers Subscribe with a waiter."""

    errors = ERRORS

    def __init__(self, backend: BackendBase, store: RedisCluster) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        self._client: Any = None
        self._listeners: dict[str, Listener] = {}  # node name -> its listener
        self._masters: dict[str, Connections] = {}  # node name -> its idle connections
        self._lock = threading.Lock()
        self._reading: Any = None  # the client whose layout a background thread reads
        self._making: Future[Any] | None = None  # the client being made
        after_fork(self)

    def forget_after_fork(self) -> None:
        # the parent's sockets: not ours to close
        self._client, self._listeners, self._masters = None, {}, {}
        self._lock = threading.Lock()
        self._reading, self._making = None, None

    @property
    def client(self) -> Any:
        """The cluster client, made (and connected) on first use."""
        client = self._client
        if client is None:
            client = self._made()
        return client

    def _made(self) -> Any:
        """The cluster client once made, in a thread of its own (module docstring), waited
        for up to the timeout."""
        with self._lock:
            if self._client is not None:
                return self._client
            making = self._making
            if making is None:
                making = self._making = Future()
                threading.Thread(
                    target=self._make, args=(making,), name="latchkey-cluster-client", daemon=True
                ).start()
        try:
            return making.result(self.timeout)
        except FutureTimeout:  # TimeoutError from Python 3.11 on, a class of its own before
            raise redis.TimeoutError(
                f"no node of the URL gave the cluster's layout within {self.timeout:g}s"
            ) from None

    def _make(self, making: Future[Any]) -> None:
        try:
            client = Client(
                **cluster_settings(self.store, self.backend.client),
                retry=Retry(NoBackoff(), 0),  # a primitive never retries
            )
        except BaseException as exc:
            with self._lock:
                if self._making is making:
                    self._making = None  # the next call starts again
            making.set_exception(exc)
            return
        self._reread_later(client)
        with self._lock:
            current = self._making is making
            if current:
                self._client, self._making = client, None
        if not current:  # the store was closed meanwhile
            client.close()
            making.set_exception(redis.ConnectionError("the store was closed"))
            return
        making.set_result(client)

    def _reread_later(self, client: Any) -> None:
        """Every later re-read of ``client``'s layout (its first is done: the constructor
        reads it) runs in the background, not in the call that failed (module docstring):
        the client's own ``nodes_manager.initialize``, the method its calls and this driver
        use, replaced on that one client, which this driver made and alone uses."""
        manager = client.nodes_manager
        read = manager.initialize

        def initialize(*args: Any, **kwargs: Any) -> None:
            with self._lock:
                if self._reading is client or self._client is not client:
                    return  # one at a time; none for a client closed
                self._reading = client
            threading.Thread(
                target=self._read_layout,
                args=(client, functools.partial(read, *args, **kwargs)),
                name="latchkey-cluster-layout",
                daemon=True,
            ).start()

        manager.initialize = initialize

    def _read_layout(self, client: Any, read: Any) -> None:
        """Re-read ``client``'s layout (its error is not a call's: the next call meets it,
        or a new layout); if the store was closed meanwhile, close what the reading opened."""
        try:
            with contextlib.suppress(Exception):
                read()
        finally:
            with self._lock:
                self._reading = None
                closed = self._client is not client
            if closed:
                client.close()

    #: :meth:`Driver.run` with :func:`~latchkey.stores.io.drive` written in (one call less per
    #: primitive), the plain Redis driver's; driver errors are :attr:`errors`, this driver's.
    run = RedisDriver.run

    def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is tuple:  # a Script
            return self.script(request)
        if kind is Command:
            return self.client.execute_command(*request.words)
        if kind is Batch:
            return self.batch(request.scripts)
        if kind is OnNode:
            client = self.client
            node = client.get_node(node_name=request.node)
            reply = client.execute_command(*request.words, target_nodes=node)
            return scan_reply(reply) if request.words[0] == "SCAN" else reply
        if kind is Masters:
            return [node.name for node in self.client.get_primaries()]
        if kind is Subscribe:
            return passes_on(self.subscribe(request.channel), self, request)
        raise TypeError(f"not a Redis Cluster request: {request!r}")

    def script(self, request: Script) -> Any:
        """The script on the master of its slot, over a connection of that master's stack;
        through the cluster client if that master sends it elsewhere (module docstring)."""
        client = self.client
        try:
            node = client.get_node_from_key(request[1][0])  # the slot's master in its map
        except redis.exceptions.SlotNotCoveredError:  # redis-py re-reads the layout
            return self.routed(request)
        master = self._masters.get(node.name) or self._master(client, node)
        packed = pack_script(request)
        try:
            try:
                return master.call(packed)
            except NoScript:
                master.call(pack(("SCRIPT", "LOAD", request[0].text)))
                return master.call(packed)
        except ELSEWHERE:  # not run there: redis-py follows MOVED/ASK, waits out TRYAGAIN…
            return self.routed(request)
        except LOST:
            self._lost(client, node, master)
            raise

    def _master(self, client: Any, node: Any) -> Connections:
        """The idle connections of ``node`` (made on first use), and how to make one: the
        connection class and settings of redis-py's client for that node (TLS, AUTH, client
        name, RESP2, the store's timeout)."""
        pool = client.get_redis_connection(node).connection_pool
        kwargs = pool.connection_kwargs
        with self._lock:
            master = self._masters.get(node.name)
            if master is None:
                new = functools.partial(pool.connection_class, **kwargs)
                master = Connections(new, bool(kwargs.get("health_check_interval")))
                self._masters[node.name] = master
            return master

    def _lost(self, client: Any, node: Any, master: Connections) -> None:
        """What redis-py's own call does when a node's connection fails: that node's idle
        connections closed, the cluster's layout read again (the failed node asked last), in
        the background (:meth:`_reread_later`)."""
        master.close()
        manager = client.nodes_manager
        with contextlib.suppress(*ERRORS):
            if _ASK_FAILED_LAST:
                manager.move_node_to_end_of_cached_nodes(node.name)
                manager.initialize(last_failed_node_name=node.name)
            else:
                manager.initialize()

    def routed(self, request: Script) -> Any:
        """The script through the cluster client's ``execute_command`` (routing, MOVED, ASK,
        TRYAGAIN and CLUSTERDOWN as redis-py handles them). A script missing is loaded on
        every master: the node that answered NOSCRIPT may not be the one the client's map
        names (an ASK sends the script to a slot's importing master)."""
        lua, keys, args = request
        client = self.client
        words: Sequence[Any] = ("EVALSHA", lua.sha, len(keys), *keys, *args)
        try:
            return client.execute_command(*words)
        except redis.exceptions.NoScriptError:
            client.execute_command("SCRIPT", "LOAD", lua.text, target_nodes=Client.PRIMARIES)
            return client.execute_command(*words)

    def batch(self, scripts: Sequence[Script]) -> list[Any]:
        """The scripts in one pipeline per master (one round trip per node, through the
        node's own client: redis-py's cluster pipeline asks the server ``COMMAND GETKEYS``
        for every EVALSHA, a round trip each), the masters asked at once (:meth:`_at_once`).
        A part a node answers NOSCRIPT is loaded there and sent again; one it answers MOVED
        or ASK (its slot moved) is sent again through the cluster client, which follows the
        redirection and updates its map."""
        client = self.client
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (_, keys, _) in enumerate(scripts):
            node = client.get_node_from_key(keys[0])
            nodes[node.name] = node
            by_node.setdefault(node.name, []).append(i)
        work = [(nodes[name], [scripts[i] for i in indexes]) for name, indexes in by_node.items()]
        if len(work) == 1:
            answered = [self._on_node(client, *work[0])]
        else:
            answered = self._at_once(client, work)
        replies: list[Any] = [None] * len(scripts)
        for indexes, answers in zip(by_node.values(), answered, strict=True):
            for i, reply in zip(indexes, answers, strict=True):
                replies[i] = reply
        return replies

    def _at_once(self, client: Any, work: list[tuple[Any, list[Script]]]) -> list[list[Any]]:
        """Each master's part (:meth:`_on_node`) in a thread of its own, all waited for up to
        one timeout from now: so a batch takes one round trip's time, and a master that does
        not answer holds the batch up by one timeout, not one per master (sent one after
        another, a blackholed cluster of three held a claim for three). A part not done by
        then is answered by a TimeoutError (its thread ends by its own socket timeout; what
        it may still take, the store's caller gives back, or its TTL ends)."""
        done: list[Future[list[Any]]] = []
        for node, parts in work:
            future: Future[list[Any]] = Future()
            threading.Thread(
                target=_settle,
                args=(future, self._on_node, client, node, parts),
                name="latchkey-cluster-batch",
                daemon=True,
            ).start()
            done.append(future)
        deadline = time.monotonic() + self.timeout
        answered: list[list[Any]] = []
        for future, (node, parts) in zip(done, work, strict=True):
            try:
                answered.append(future.result(max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                late = redis.TimeoutError(f"{node.name}: no answer within {self.timeout:g}s")
                answered.append([late] * len(parts))
            except ERRORS as exc:
                answered.append([exc] * len(parts))
        return answered

    def _on_node(self, client: Any, node: Any, parts: list[Script]) -> list[Any]:
        """The replies of ``parts`` (scripts of slots ``node`` serves) in one pipeline; those
        answered NOSCRIPT loaded and sent again, those answered MOVED or ASK routed."""
        node_client = client.get_redis_connection(node)
        answers = self._pipeline(node_client, parts)
        missing = [j for j, r in enumerate(answers) if isinstance(r, NoScript)]
        if missing:
            for lua in {parts[j][0] for j in missing}:
                node_client.execute_command("SCRIPT", "LOAD", lua.text)
            again = self._pipeline(node_client, [parts[j] for j in missing])
            for j, reply in zip(missing, again, strict=True):
                answers[j] = reply
        routed = zip(parts, answers, strict=True)
        return [self._part(part) if _moved(reply) else reply for part, reply in routed]

    def _part(self, request: Script) -> Any:
        try:
            return self.routed(request)
        except ERRORS as exc:
            return exc

    @staticmethod
    def _pipeline(node_client: Any, scripts: Sequence[Script]) -> list[Any]:
        """Each script's reply or error on one node; a pipeline that failed as a whole (the
        node unreachable) is that error for every part (some may have run: the store gives
        the whole batch back)."""
        pipe = node_client.pipeline(transaction=False)
        for lua, keys, args in scripts:
            pipe.execute_command("EVALSHA", lua.sha, len(keys), *keys, *args)
        try:
            return list(pipe.execute(raise_on_error=False))
        except ERRORS as exc:
            return [exc] * len(scripts)

    def subscribe(self, channel: str) -> Waiter:
        """A waiter subscribed (confirmed) to ``channel`` on the master of its slot."""
        try:
            listener = self._listener(self.client.get_node_from_key(channel))
            slot = listener.add(channel, self.timeout)
        except ERRORS as exc:
            self.backend.unavailable(exc, "subscribe")
        return PushWaiter(listener, channel, slot)

    def _listener(self, node: Any) -> Listener:
        with self._lock:
            current = self._listeners.get(node.name)
            if current is None or current.error is not None:
                if current is not None:
                    current.close()
                kwargs = node_settings(self.store, self.backend.client)
                cls = connection_class(kwargs, Connection, redis.SSLConnection)
                conn = cls(host=node.host, port=node.port, **kwargs)
                self._listeners[node.name] = current = ShardedListener(conn)
            return current

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = self._listeners, {}
            masters, self._masters = self._masters, {}
            client, self._client = self._client, None
            self._making = None  # a client made after this is closed by its maker
        for listener in listeners.values():
            listener.close()
        for master in masters.values():
            master.close()
        if client is not None:
            client.close()
