"""Redis behind Sentinel through ``redis.asyncio.sentinel.Sentinel.master_for``: the asyncio
driver of :class:`latchkey.stores.redis_cluster.RedisSentinel`.

The plain asyncio Redis driver (:class:`~latchkey.stores.io.redis_async.AsyncRedisDriver`)
on connections made by the Sentinel pool's public connection class and settings: each new
connection asks the sentinels for the current master (see
:mod:`latchkey.stores.io.redis_sentinel`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import NoBackoff

from latchkey.stores.io.redis_async import ERRORS, AsyncRedisDriver
from latchkey.stores.io.redis_sentinel import ask_next, no_master, sentinel_args, sentinel_error

if TYPE_CHECKING:
    from latchkey.stores.redis import Redis


class Sentinels(Sentinel):  # type: ignore[misc,unused-ignore]  # untyped in redis-py
    """redis-py's asyncio Sentinel, whose MasterNotFoundError says why each sentinel failed
    (see :class:`latchkey.stores.io.redis_sentinel.Sentinels`). The request's deadline
    bounds a discovery here; the sentinel it cut off is asked last from then on
    (:func:`~latchkey.stores.io.redis_sentinel.ask_next`): it was asked first, and every new
    connection waited for it until the deadline, never reaching a sentinel that answers."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        errors: list[str] = []
        failed: list[Any] = []
        named = None
        try:
            for sentinel in list(self.sentinels):
                try:
                    masters: Any = await sentinel.sentinel_masters()  # service -> state
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    errors.append(sentinel_error(sentinel, exc))
                    failed.append(sentinel)
                    continue
                except BaseException:  # the deadline (a cancellation) while it was asked
                    failed.append(sentinel)
                    raise
                state = masters.get(service_name)
                if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call,unused-ignore]
                    named = sentinel
                    return state["ip"], state["port"]
        finally:
            ask_next(self.sentinels, named, failed)
        raise no_master(service_name, errors)


SENTINEL: Any = Sentinels


class MasterConnection(SentinelManagedConnection):
    """A connection that asks the sentinels for the current master whenever it connects
    (see :class:`latchkey.stores.io.redis_sentinel.MasterConnection`)."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)


class TLSMasterConnection(MasterConnection, redis.asyncio.SSLConnection):
    """:class:`MasterConnection` over TLS (see the sync driver's)."""


class AsyncSentinelDriver(AsyncRedisDriver):
    """The plain asyncio Redis driver on connections to the current master of a service."""

    borrows_settings = False  # a borrowed Sentinel is followed (see io.redis_sentinel)

    def make_client(self, store: Redis) -> redis.asyncio.Redis:
        sentinel_store, sentinels, to_sentinel, to_master, others = sentinel_args(self, store)
        to_master["socket_timeout"] = None  # one deadline per request (the plain driver's)
        to_sentinel["retry"] = Retry(NoBackoff(), 0)  # each sentinel asked once per connect
        self.sentinel: Any = SENTINEL(
            sentinels, min_other_sentinels=others, sentinel_kwargs=to_sentinel, **to_master
        )
        client: Any = self.sentinel.master_for(
            sentinel_store.service,
            redis_class=redis.asyncio.Redis,
            connection_class=TLSMasterConnection if to_master.get("ssl") else MasterConnection,
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )
        return client  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            for client in self.sentinel.sentinels:  # the connections that asked the sentinels
                with contextlib.suppress(*ERRORS):
                    await client.aclose()
