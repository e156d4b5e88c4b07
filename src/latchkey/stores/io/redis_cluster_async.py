"""Redis Cluster through ``redis.asyncio.cluster.RedisCluster``: the asyncio driver of
:class:`latchkey.stores.redis_cluster.RedisCluster`.

The twin of :mod:`latchkey.stores.io.redis_cluster`: the same requests, through the asyncio
cluster client's public ``execute_command`` (routing by slot, MOVED/ASK, no retries), each
under one deadline of the store's timeout, at most ``POOL_SIZE`` in flight, first come first
served (the client's own per-node pools fail at once when full instead of queueing: 1,000
waiters retrying together met MaxConnectionsError). The client reads the cluster's layout on
first use (``initialize()``). Waiting: one sharded pub/sub listener per master
(:class:`ShardedListener`: the plain asyncio driver's listener speaking SSUBSCRIBE), read by
one task; a waiting coroutine holds no connection. TLS (``rediss+cluster://``) as in the
sync driver, to every node and listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from latchkey.stores.base import AsyncWaiter
from latchkey.stores.io.aio import AsyncDriver
from latchkey.stores.io.redis_async import POOL_SIZE, Listener, PushWaiter, passes_on
from latchkey.stores.io.redis_cluster import ERRORS as SYNC_ERRORS
from latchkey.stores.io.redis_cluster import (
    cluster_settings,
    connection_class,
    node_settings,
    scan_reply,
)
from latchkey.stores.redis import Command, Subscribe
from latchkey.stores.redis_cluster import Batch, Masters, OnNode

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase
    from latchkey.stores.redis import Script
    from latchkey.stores.redis_cluster import RedisCluster

if sys.version_info >= (3, 11):
    from latchkey.stores.io.deadlines import Deadline as _deadline  # asyncio.timeout, cheaper
else:  # redis-py itself depends on async-timeout before Python 3.11.3
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

Client: Any = redis.asyncio.cluster.RedisCluster  # untyped in parts: used as Any
#: TLS options of the URL that the asyncio cluster client does not take as arguments (its
#: sync twin does): given to its nodes' connection settings once it is made, as redis-py
#: itself adds settings there later (its maintenance notifications).
NOT_TAKEN = ("ssl_password", "ssl_ca_path")
# asyncio.TimeoutError is TimeoutError (an OSError) from Python 3.11 on, a class of its own before
ERRORS: tuple[type[BaseException], ...] = (*SYNC_ERRORS, asyncio.TimeoutError)


class ShardedListener(Listener):
    """The shared asyncio listener on sharded pub/sub: SSUBSCRIBE, SUNSUBSCRIBE, ``smessage``."""

    SUBSCRIBE = "SSUBSCRIBE"
    UNSUBSCRIBE = "SUNSUBSCRIBE"
    ACKS = ("ssubscribe", "sunsubscribe")
    MESSAGE = "smessage"


class AsyncClusterDriver(AsyncDriver):
    """Runs each request through an asyncio RedisCluster client; Subscribe gives a waiter."""

    errors = ERRORS

    def __init__(self, backend: BackendBase, store: RedisCluster) -> None:
        super().__init__(backend, store)
        self.timeout = backend.timeout
        settings = cluster_settings(store, backend.client)  # the sync client's, asyncio's nodes
        node = redis.asyncio.cluster.ClusterNode
        settings["startup_nodes"] = [node(n.host, n.port) for n in settings["startup_nodes"]]
        untaken = {k: settings.pop(k) for k in NOT_TAKEN if k in settings}
        never = Retry(NoBackoff(), 0)  # a primitive never retries: the core decides
        self.client: Any = Client(**settings, retry=never)
        if untaken:  # to every node's connections, those of the nodes it will learn of too
            self.client.get_connection_kwargs().update(untaken)
            for start in self.client.startup_nodes:
                start.connection_kwargs.update(untaken)
        # A listener waits for news as long as it takes.
        self.listener_settings = {
            **node_settings(store, backend.client),
            "socket_timeout": None,
            "retry": never,
        }
        self.listener_class = connection_class(
            self.listener_settings, redis.asyncio.Connection, redis.asyncio.SSLConnection
        )
        self._turns = asyncio.Semaphore(POOL_SIZE)  # requests in flight; first come first served
        self._listeners: dict[str, Listener] = {}
        self._listener_lock = asyncio.Lock()
        self.closed = False

    async def answer(self, request: Any) -> Any:
        kind = type(request)
        if kind is Subscribe:
            return passes_on(await self.subscribe(request.channel), self, request)
        async with self._turns, _deadline(self.timeout):
            if self.closed:
                raise redis.ConnectionError("the store was closed")
            try:
                client = await self.client.initialize()
                if kind is Batch:
                    return await self.batch(client, request.scripts)
                if kind is tuple:  # a Script
                    return await self.script(client, request)
                if kind is Command:
                    return await client.execute_command(*request.words)
                if kind is OnNode:
                    node = client.get_node(node_name=request.node)
                    reply = await client.execute_command(*request.words, target_nodes=node)
                    return scan_reply(reply) if request.words[0] == "SCAN" else reply
                if kind is Masters:
                    return [node.name for node in client.get_primaries()]
            finally:
                if self.closed:  # closed while this request ran (a give-back, say): the
                    await self._close_client()  # layout it read again is closed too
        raise TypeError(f"not a Redis Cluster request: {request!r}")

    async def script(self, client: Any, request: Script) -> Any:
        lua, keys, args = request
        words: Sequence[Any] = ("EVALSHA", lua.sha, len(keys), *keys, *args)
        try:
            return await client.execute_command(*words)
        except redis.exceptions.NoScriptError:
            node = client.get_node_from_key(keys[0])
            await client.execute_command("SCRIPT", "LOAD", lua.text, target_nodes=node)
            return await client.execute_command(*words)

    async def batch(self, client: Any, scripts: Sequence[Script]) -> list[Any]:
        """The scripts in one pipeline; those answered NOSCRIPT loaded and sent again."""
        replies = await self._pipeline(client, scripts)
        missing = [
            i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)
        ]
        if missing:
            loaded: set[tuple[str, str]] = set()
            for i in missing:
                lua, keys, _ = scripts[i]
                node = client.get_node_from_key(keys[0])
                if (node.name, lua.sha) not in loaded:
                    await client.execute_command("SCRIPT", "LOAD", lua.text, target_nodes=node)
                    loaded.add((node.name, lua.sha))
            again = await self._pipeline(client, [scripts[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    @staticmethod
    async def _pipeline(client: Any, scripts: Sequence[Script]) -> list[Any]:
        """Each script's reply or error (see the sync driver's)."""
        pipe = client.pipeline(transaction=False)
        for lua, keys, args in scripts:
            pipe.execute_command("EVALSHA", lua.sha, len(keys), *keys, *args)
        try:
            return list(await pipe.execute(raise_on_error=False))
        except ERRORS as exc:
            return [exc] * len(scripts)

    async def subscribe(self, channel: str) -> AsyncWaiter:
        """A waiter subscribed (confirmed) to ``channel`` on the master of its slot."""
        try:
            async with _deadline(self.timeout):
                client = await self.client.initialize()
                listener = await self._listener(client.get_node_from_key(channel))
            event = await listener.add(channel)
        except ERRORS as exc:
            self.backend.unavailable(exc, "subscribe")
        return PushWaiter(listener, channel, event)

    async def _listener(self, node: Any) -> Listener:
        async with self._listener_lock:
            current = self._listeners.get(node.name)
            if current is None or current.error is not None:
                if current is not None:
                    await current.close()
                self._listeners.pop(node.name, None)
                conn = self.listener_class(host=node.host, port=node.port, **self.listener_settings)
                current = ShardedListener(conn, self.timeout)
                await current.start()
                self._listeners[node.name] = current
            return current

    async def aclose(self) -> None:
        self.closed = True
        async with self._listener_lock:
            listeners, self._listeners = self._listeners, {}
        for listener in listeners.values():
            await listener.close()
        await self._close_client()

    async def _close_client(self) -> None:
        with contextlib.suppress(*ERRORS):
            await self.client.aclose()
        # A client whose first layout read was cut short (the request's deadline) counts as
        # never initialized, and its aclose() leaves the seeds' connections open.
        manager = self.client.nodes_manager
        for nodes in ("nodes_cache", "startup_nodes"):
            with contextlib.suppress(*ERRORS):
                await manager.aclose(nodes)
