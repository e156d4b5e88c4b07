"""The Redis store on a Redis Cluster (``redis+cluster://``) and behind Sentinel
(``redis+sentinel://``): the same key layout and Lua scripts as :mod:`latchkey.stores.redis`.

**Cluster.** Every key of one name carries the hash tag ``{hex(name)}``, so one name lives in
one slot and each single-name primitive is one script on the slot's master, as on one server.
What differs is what spans names:

- a batch claim (and ``release_many``) is split by slot: one CLAIM script per slot, sent
  together (:class:`Batch`: the driver pipelines them, one round trip per master, the masters
  asked at once, the whole batch under one timeout). If any slot's part fails, the claim
  raises, and the core gives every name of the batch back in the background (owner-checked
  ``release_many``, as after any failed claim: :mod:`latchkey._core.claim`), so a failed
  claim leaves nothing held that its caller does not know about and costs it one timeout
  (given back here, in the foreground, a cut network cost a second one);
- ``list`` and ``purge_expired`` SCAN every master (:class:`Masters`, :class:`OnNode`) and
  inspect or purge the names found, one script per slot and chunk. The plain store's expiry
  index (one sorted set per prefix) would live in one slot, and a script may touch only the
  keys of its name's slot: the cluster's scripts keep none (``INDEXED`` false), so a purge
  here still walks every key of every master (``SCAN … TYPE zset`` filters in the server);
- wake-ups use sharded pub/sub: the release scripts ``SPUBLISH`` on the name's channel
  (``P{H}:lease``, in the name's slot), and waiters ``SSUBSCRIBE`` on the master that holds the
  slot (Redis >= 7.0). A plain PUBLISH would reach every node of the cluster over its bus.
- ``now()`` is the TIME of one node (the scripts read their own node's clock: nodes' clocks
  should agree, as NTP keeps them, since a name's slot may move to another master).

**Sentinel.** One master at a time, found through the sentinels by the driver (redis-py's
``Sentinel.master_for``): the plain Redis store's primitives, scripts and pub/sub unchanged.
The URL's path is the service name (``redis+sentinel://h:26379,h:26380/mymaster?db=0``).

Both stores keep everything else of :class:`~latchkey.stores.redis.Redis`: keys, tokens (the
fence counter), records, owner checks. Redis replication is asynchronous: see the store page
(docs/stores/redis.md) for what a failover can lose.
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from latchkey._types import Grant, LockInfo
from latchkey._url import Option, boolean, key_prefix
from latchkey.errors import ConfigError
from latchkey.stores.base import BackendBase
from latchkey.stores.io import Steps
from latchkey.stores.io.redis_options import CLUSTER_OPTIONS
from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend
from latchkey.stores.redis import (
    BATCH,
    PURGE_PAGE,
    SCRIPTS,
    Command,
    Redis,
    Script,
    _check_tls,
    _dt,
    _info,
    _infos,
    _ttl_ms,
)
from latchkey.stores.redis_lua import (
    ACQUIRE,
    CLAIM,
    EXTEND,
    FORCE_RELEASE,
    INSPECT,
    PASS,
    PURGE,
    PURGE_DUE,
    RELEASE,
    RELEASE_MANY,
)
from latchkey.stores.redis_lua_helpers import Lua

SLOTS = 16384


def _sharded(lua: Lua) -> Lua:
    """The script for a cluster: every PUBLISH made an SPUBLISH (sharded pub/sub, Redis >=
    7.0), so a release is announced on the name's slot's shard only, where its waiters
    subscribed, and subscribers counted with SHARDNUMSUB; and no expiry index kept (``INDEXED``
    false: the index is a key of another slot than the name's)."""
    text = lua.text.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
    text = text.replace("redis.call('PUBSUB', 'NUMSUB'", "redis.call('PUBSUB', 'SHARDNUMSUB'")
    text = text.replace("local INDEXED = true\n", "local INDEXED = false\n")
    return Lua(text, hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest())


# The scripts of the cluster: RELEASE, RELEASE_MANY and FORCE_RELEASE announce on the name's
# channel with SPUBLISH, INSPECT counts its waiters with SHARDNUMSUB, and none keeps the
# expiry index; KEYS, ARGV and replies as in redis_lua.
S_ACQUIRE = _sharded(ACQUIRE)
S_CLAIM = _sharded(CLAIM)
S_EXTEND = _sharded(EXTEND)
S_RELEASE = _sharded(RELEASE)
S_RELEASE_MANY = _sharded(RELEASE_MANY)
S_FORCE_RELEASE = _sharded(FORCE_RELEASE)
S_INSPECT = _sharded(INSPECT)
S_PURGE = _sharded(PURGE)
S_PASS = _sharded(PASS)
CLUSTER_SCRIPTS = tuple(_sharded(lua) for lua in SCRIPTS if lua is not PURGE_DUE)


class Batch(NamedTuple):
    """Request: several scripts (each of one slot) → their replies in order; a part that
    failed is answered by its exception (an instance, not raised), the others still run."""

    scripts: Sequence[Script]


class Masters(NamedTuple):
    """Request: the names (``host:port``) of the cluster's masters, as the client knows them."""


class OnNode(NamedTuple):
    """Request: one plain command on the node named ``node`` → its reply."""

    node: str
    words: Sequence[str | int]


def _db_number(text: str) -> int:
    if not text.isdigit():
        raise ValueError("must be a database number (0, 1, …)")
    return int(text)


def _first_error(replies: Sequence[object]) -> BaseException | None:
    return next((r for r in replies if isinstance(r, BaseException)), None)


class RedisCluster(Redis):
    """The Redis store on a Redis Cluster: one slot per name, batches split by slot."""

    scheme = "redis+cluster"
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key (letters, digits, _:.-)"),
    }
    driver_options = CLUSTER_OPTIONS
    acquire_lua, extend_lua, pass_lua = S_ACQUIRE, S_EXTEND, S_PASS
    sync_driver = "latchkey.stores.io.redis_cluster:ClusterDriver"
    async_driver = "latchkey.stores.io.redis_cluster_async:AsyncClusterDriver"

    def __init__(self, backend: BackendBase) -> None:
        Store.__init__(self, backend)
        url = self.url
        if not url.hosts:
            raise ConfigError(f"{url.scheme} store: give at least one node as host:port")
        if url.path.strip("/") not in ("", "0"):
            raise ConfigError(f"{url.scheme} store: a cluster has only db 0, not {url.path!r}")
        self.db = 0
        self.prefix: str = self.config["prefix"]
        _check_tls(self)

    def slot(self, name: str) -> int:
        """The cluster slot of every key of ``name``: CRC16 (XMODEM, as Redis Cluster's) of
        its hash tag, hex(name)."""
        return binascii.crc_hqx(name.encode().hex().encode(), 0) % SLOTS  # CRC16/XMODEM

    def by_slot(self, names: Sequence[str], size: int = 0) -> list[list[str]]:
        """``names`` in groups of one slot each (first-seen order), at most ``size`` a group."""
        groups: dict[int, list[str]] = {}
        for name in names:
            groups.setdefault(self.slot(name), []).append(name)
        if not size:
            return list(groups.values())
        return [g[i : i + size] for g in groups.values() for i in range(0, len(g), size)]

    def names(self, prefix: str) -> Steps[list[str]]:
        """Names starting with ``prefix`` that have a lease key, on every master."""
        pattern = f"{self.prefix}{{{prefix.encode().hex()}*}}:lease*"
        names = set[str | None]()
        for node in (yield Masters()):
            cursor: str | int = "0"
            while True:
                cursor, found = yield OnNode(
                    node, ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                )
                names.update(map(self.name_of, found))
                if int(cursor) == 0:
                    break
        return sorted(n for n in names if n is not None and n.startswith(prefix))

    def _each_slot(
        self, lua: Lua, names: Sequence[str], args: Sequence[str | int]
    ) -> Steps[list[tuple[list[str], Any]]]:
        """One ``lua`` script per slot group of ``names``; the replies, or the first error."""
        groups = self.by_slot(names, BATCH)
        replies = yield Batch([(lua, [self.base(n) for n in g], args) for g in groups])
        failed = _first_error(replies)
        if failed is not None:
            raise failed
        return list(zip(groups, replies, strict=True))

    # -- the primitives that announce releases (SPUBLISH) or span slots ----------------------

    def release(self, name: str, owner: str) -> Steps[bool]:
        return int((yield (S_RELEASE, (self.base(name),), (owner,)))) == 1

    def force_release(self, name: str) -> Steps[bool]:
        return int((yield (S_FORCE_RELEASE, (self.base(name),), ()))) == 1

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        reply = yield (S_INSPECT, (self.base(name),), ())
        return _info(name, reply[1], reply[2])

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        if not names:
            return 0
        parts = yield from self._each_slot(S_RELEASE_MANY, names, (owner,))
        return sum(int(reply) for _, reply in parts)

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        names = yield from self.names(prefix)
        out = list[LockInfo]()
        for group, reply in (yield from self._each_slot(S_INSPECT, names, ())):
            out += _infos(group, reply)
        return sorted(out, key=lambda info: info.name)

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """Expired entries of the semaphore zsets found by ``SCAN … TYPE zset`` on every
        master (a cluster keeps no expiry index: see the module docstring)."""
        pattern, count = f"{self.prefix}{{*}}:leases", 0
        for node in (yield Masters()):
            cursor: str | int = "0"
            while True:
                cursor, found = yield OnNode(
                    node, ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000, "TYPE", "zset")
                )
                names = [n for n in map(self.name_of, found) if n is not None]
                for start in range(0, len(names), PURGE_PAGE):
                    page = names[start : start + PURGE_PAGE]
                    count += sum(int(r) for _, r in (yield from self._each_slot(S_PURGE, page, ())))
                if int(cursor) == 0:
                    break
        return count

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        if not names:
            return {}
        groups = self.by_slot(names)
        args = (owner, owner_info, _ttl_ms(ttl))
        replies = yield Batch([(S_CLAIM, [self.base(n) for n in g], args) for g in groups])
        failed = _first_error(replies)
        if failed is not None:  # the core gives every part back (a failed part may have run)
            raise failed
        grants: dict[str, Grant] = {}
        for group, reply in zip(groups, replies, strict=True):
            expires = _dt(reply[0])
            tokens = zip(group, reply[1:], strict=True)
            grants.update((n, Grant(int(t), expires)) for n, t in tokens if int(t))
        return grants

    def init(self) -> Steps[None]:
        """Load the scripts on every master now (also loaded on first use, after NOSCRIPT)."""
        for node in (yield Masters()):
            for lua in CLUSTER_SCRIPTS:
                yield OnNode(node, ("SCRIPT", "LOAD", lua.text))


class RedisSentinel(Redis):
    """The Redis store on the master a Redis Sentinel names; follows it across failovers."""

    scheme = "redis+sentinel"
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key (letters, digits, _:.-)"),
        "db": Option(_db_number, 0, "database number on the master"),
        "sentinel_auth": Option(
            boolean, False, "send the URL's user and password to the sentinels too"
        ),
    }
    sync_driver = "latchkey.stores.io.redis_sentinel:SentinelDriver"
    async_driver = "latchkey.stores.io.redis_sentinel_async:AsyncSentinelDriver"

    def __init__(self, backend: BackendBase) -> None:
        Store.__init__(self, backend)
        url = self.url
        if not url.hosts:
            raise ConfigError(f"{url.scheme} store: give at least one sentinel as host:port")
        service = url.path.strip("/")
        if not service or "/" in service:
            raise ConfigError(
                f"{url.scheme} store: the URL path must be the service name (/mymaster), "
                f"not {url.path!r}"
            )
        self.service = service
        self.db = self.config["db"]
        self.prefix: str = self.config["prefix"]
        _check_tls(self)


class RedisClusterBackend(StoreBackend):
    store_class = RedisCluster


class AsyncRedisClusterBackend(AsyncStoreBackend):
    store_class = RedisCluster


class RedisSentinelBackend(StoreBackend):
    store_class = RedisSentinel


class AsyncRedisSentinelBackend(AsyncStoreBackend):
    store_class = RedisSentinel


__all__ = ["Command", "RedisCluster", "RedisSentinel"]
