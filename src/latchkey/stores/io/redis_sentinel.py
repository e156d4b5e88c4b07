"""Redis behind Sentinel through redis-py's ``Sentinel.master_for``: the sync driver of
:class:`latchkey.stores.redis_cluster.RedisSentinel`.

The plain Redis driver (:class:`~latchkey.stores.io.redis.RedisDriver`: hand-packed RESP over
its own connection list, the shared pub/sub listener), with connections made by the Sentinel
pool's public connection class and settings: each new connection asks the sentinels for the
service's current master before it connects. After a failover, connections to the old master
fail (or, if it came back as a replica, answer READONLY, which redis-py turns into a
connection error and a disconnect): that call raises StoreUnavailable and the next one
connects to the master the sentinels name then.

A borrowed Sentinel (``latchkey.connect(client=redis.sentinel.Sentinel(…), service="m")``) is
followed, not used, as a borrowed ``redis.Redis`` is (see :mod:`latchkey.stores.io.redis`):
its sentinels' addresses, its ``sentinel_kwargs`` (AUTH to the sentinels), its
``min_other_sentinels`` and its master connection settings (AUTH, db, client name…) make this
driver's own Sentinel, with latchkey's settings on top: the store's timeout on every socket,
to the sentinels too (a frozen sentinel must not hold a call past it), no retries, replies
decoded, RESP2. :meth:`close` closes that Sentinel's connections, never the application's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from latchkey.stores.io.redis import RedisDriver, ours_after, settings, tls_settings
from latchkey.stores.io.redis_options import tls_options

if TYPE_CHECKING:
    from latchkey.stores.redis import Redis
    from latchkey.stores.redis_cluster import RedisSentinel

SENTINEL_PORT = 26379


def sentinel_settings(
    store: RedisSentinel,
) -> tuple[list[tuple[str, int]], dict[str, Any], dict[str, Any]]:
    """The sentinels' addresses, the arguments of a connection to a sentinel, and those of a
    connection to the master (the plain store's settings without host and port). Over TLS
    (``rediss+sentinel://``) both kinds of connection use it, with the URL's TLS options
    (``ssl_ca_certs``, ``ssl_certfile``…); the sentinels get no other redis-py option."""
    url, timeout = store.url, store.config["timeout"]
    sentinels = [(host or "localhost", port or SENTINEL_PORT) for host, port in url.hosts]
    to_sentinel: dict[str, Any] = {
        **tls_settings(store),  # rediss+sentinel://: the sentinels over TLS too, same options
        **tls_options(store.config["driver"]),
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }
    if store.config["sentinel_auth"]:  # not a URL option of its own: it would show in the URL
        to_sentinel.update(username=url.username, password=url.password)
    to_master = {k: v for k, v in settings(store).items() if k not in ("host", "port")}
    return sentinels, to_sentinel, to_master


def followed_settings(
    client: Any, store: RedisSentinel
) -> tuple[list[tuple[str, int]], dict[str, Any], dict[str, Any]]:
    """:func:`sentinel_settings` read from an application's Sentinel (sync or asyncio): its
    sentinels, its sentinel and master connection settings, latchkey's on top."""
    timeout = store.config["timeout"]
    sentinels = []
    for sentinel in client.sentinels:
        kwargs = sentinel.connection_pool.connection_kwargs
        sentinels.append((kwargs.get("host", "localhost"), kwargs.get("port", SENTINEL_PORT)))
    to_sentinel = {
        **client.sentinel_kwargs,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
    }
    # the Sentinel's own db unless connect() was given one
    to_master = {**ours_after(client.connection_kwargs, timeout), "db": store.db}
    return sentinels, to_sentinel, to_master


def sentinel_args(
    driver: Any, store: Redis
) -> tuple[RedisSentinel, list[tuple[str, int]], dict[str, Any], dict[str, Any], int]:
    """The store, the sentinels, the arguments of connections to a sentinel and to the
    master, and ``min_other_sentinels``: from the URL, or from a borrowed Sentinel."""
    sentinel_store = cast("RedisSentinel", store)
    client = driver.backend.client
    if client is None:
        return sentinel_store, *sentinel_settings(sentinel_store), 0
    return sentinel_store, *followed_settings(client, sentinel_store), client.min_other_sentinels


def sentinel_error(sentinel: Any, exc: BaseException) -> str:
    """Why one sentinel could not be asked: its address and the error's own message."""
    kwargs = sentinel.connection_pool.connection_kwargs
    return f"sentinel {kwargs.get('host')}:{kwargs.get('port')}: {exc}"


def no_master(service: str, errors: list[str]) -> MasterNotFoundError:
    """The error when no sentinel names a master for ``service``, with each one's reason."""
    return MasterNotFoundError(
        f"no sentinel named a master for {service!r}" + (": " + "; ".join(errors) if errors else "")
    )


def ask_next(sentinels: list[Any], named: Any, failed: list[Any]) -> None:
    """Reorder ``sentinels`` (in place) for the next discovery: the one that ``named`` the
    master first, those that ``failed`` (an error, or no answer before the call's deadline)
    last, so that a sentinel cut off from this client is not the one every new connection
    waits for until its timeout."""
    first = [named] if named is not None else []
    rest = [s for s in sentinels if s is not named and not any(s is f for f in failed)]
    sentinels[:] = first + rest + [f for f in failed if any(s is f for s in sentinels)]


class Sentinels(Sentinel):  # type: ignore[misc,unused-ignore]  # untyped in redis-py
    """redis-py's Sentinel, whose MasterNotFoundError says why each sentinel failed: redis-py
    (8.x) shows only each error's kind (``network:ConnectionError``) after a repr of the
    sentinel's client, which hid a certificate refused by TLS or a connection refused.

    One discovery spends at most about the timeout: redis-py asks each sentinel in turn,
    each given the whole timeout, so sentinels cut off from the client (a partition, a
    blackhole) made a new connection wait for one timeout per sentinel. Once a sentinel has
    failed and the timeout is spent, the others are not asked: the call fails
    (StoreUnavailable), and the sentinels that failed are asked last from then on
    (:func:`ask_next`)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        errors: list[str] = []
        failed: list[Any] = []
        budget = self.sentinel_kwargs.get("socket_timeout")
        started = time.monotonic()
        named = None
        try:
            for sentinel in list(self.sentinels):
                if failed and budget and time.monotonic() - started >= budget:
                    errors.append(f"the others not asked: {budget:g}s spent")
                    break
                try:
                    masters: Any = sentinel.sentinel_masters()  # service -> state
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    errors.append(sentinel_error(sentinel, exc))
                    failed.append(sentinel)
                    continue
                state = masters.get(service_name)
                if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call,unused-ignore]
                    named = sentinel
                    return state["ip"], state["port"]
        finally:
            ask_next(self.sentinels, named, failed)
        raise no_master(service_name, errors)


SENTINEL: Any = Sentinels


class MasterConnection(SentinelManagedConnection):
    """A connection that asks the sentinels for the current master whenever it connects.

    redis-py's own class does so only in ``connect()``, which its pool calls; the plain
    driver's connections (re)connect from ``send_packed_command`` through
    ``connect_check_health``, which would go to the last address (or redis-py's default
    ``localhost:6379`` for a new one)."""

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health, retry_socket_connect)


class TLSMasterConnection(MasterConnection, redis.SSLConnection):
    """:class:`MasterConnection` over TLS (``rediss+sentinel://``, or a borrowed Sentinel with
    ``ssl=True``): redis-py's ``SentinelManagedSSLConnection``, finding the master as above."""


def master_connection(to_master: dict[str, Any]) -> type:
    """The class of the connections to the master: over TLS if ``to_master`` says ``ssl``
    (redis-py's Sentinel pool drops that argument when it is given the class)."""
    return TLSMasterConnection if to_master.get("ssl") else MasterConnection


class SentinelDriver(RedisDriver):
    """The plain Redis driver on connections to the current master of a Sentinel service."""

    borrows_settings = False  # a borrowed Sentinel is read by make_client (module docstring)

    def make_client(self, store: Redis) -> redis.Redis:
        sentinel_store, sentinels, to_sentinel, to_master, others = sentinel_args(self, store)
        to_sentinel["retry"] = Retry(NoBackoff(), 0)  # each sentinel asked once per connect
        self.sentinel: Any = SENTINEL(
            sentinels, min_other_sentinels=others, sentinel_kwargs=to_sentinel, **to_master
        )
        client: Any = self.sentinel.master_for(
            sentinel_store.service,
            redis_class=redis.Redis,
            connection_class=master_connection(to_master),
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )
        return client  # type: ignore[no-any-return]

    def close(self) -> None:
        try:
            super().close()
        finally:
            for client in self.sentinel.sentinels:  # the connections that asked the sentinels
                client.close()
