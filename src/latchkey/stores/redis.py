"""The Redis store (``redis://``, ``rediss://``): every primitive is one Lua script, one round trip.

Key layout, for a name whose UTF-8 bytes in hex are ``H`` and the ``?prefix=`` ``P``
(default ``latchkey:``)::

    P{H}:lease   string      the mutex holder: "owner:token:acquired ms:owner_info", PX ttl;
                             also the pub/sub channel on which every release is announced
                             to semaphore waiters (limit > 1)
    P{H}:lease:L channel     a mutex waiter's: ``L`` is its store object's line id (one per
                             store object and process); a release wakes one such channel
    P{H}:line    sorted set  the processes (line ids) waiting for the mutex -> when each came
    P{H}:rung    string      "L:ms": the process a release woke, and when; for 500 ms from
                             5 ms after that, a free name is its turn (see redis_lua)
    P{H}:leases  sorted set  semaphore holders: owner token -> expiry (ms, server clock)
    P{H}:owners  hash        semaphore holders: owner token -> "token:acquired ms:owner_info"
    P{H}:fence   string      the last fencing token: the next is max(fence + 1, now ms);
                             expires 10 minutes after the lease it was drawn for
    P{H}:record  hash        {value, version} of the versioned record ``name``
    Pexpiring    sorted set  the expiry index: the base ``P{H}`` of every semaphore with holders
                             -> the soonest expiry in its zset (what ``purge_expired`` reads);
                             no ``{``, so no name's key can be it. Not on Redis Cluster.

``{H}`` is a Redis Cluster hash tag: every key of one name lives in one slot, and hex keeps
any name (``{``, ``}``, NUL, any character) safe and prefix-preserving, so ``list(prefix)`` is
``SCAN MATCH P{hex(prefix)*}:lease*``. Lease keys expire by themselves (PX / PEXPIREAT), so a
crashed holder leaves nothing behind; a fence counter lost in a restart, or expired after its
name was last used, starts again from the server's clock, so tokens keep increasing across
restarts (as long as the server's clock does not go back).

Time is the server's: scripts read ``TIME`` (allowed in Redis >= 5 with effects replication,
the default from Redis 7). Waiters are woken by ``PUBLISH`` from the release script; one
pub/sub connection per backend serves all its waiters. A release of a mutex wakes one waiting
process, the first in the name's line, on its own channel (not every process that waits: with
8 processes on one name that cost ~8 attempts per grant); the process whose waiters listen
there joins the line before subscribing (in its busy attempt's own script when the name was
busy for it a moment ago: one round trip fewer per contended acquisition). INSPECT counts
the waiting store objects: the subscribers of ``P{H}:lease``, and those in line or woken that
listen on their channel.

Here: the key layout, the requests, the reply parsing and the primitives, I/O-free. The
scripts are in :mod:`latchkey.stores.redis_lua`; the bytes move in
:mod:`latchkey.stores.io.redis` (redis-py) and :mod:`latchkey.stores.io.redis_async`
(``redis.asyncio``): connections, EVALSHA with SCRIPT LOAD after NOSCRIPT, the listener.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import secrets
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, key_prefix
from latchkey.errors import ConfigError
from latchkey.stores.base import BackendBase, Capabilities
from latchkey.stores.io import Steps
from latchkey.stores.io.redis_options import REDIS_OPTIONS, tls_misused, tls_scheme
from latchkey.stores.primitives import AsyncStoreBackend, BusyMemory, Store, StoreBackend
from latchkey.stores.redis_lua import (
    ACQUIRE,
    CLAIM,
    EXTEND,
    FORCE_RELEASE,
    INSPECT,
    JOIN,
    PASS,
    PURGE,
    PURGE_DUE,
    RECORD_DELETE,
    RECORD_SET,
    RELEASE,
    RELEASE_MANY,
)
from latchkey.stores.redis_lua_helpers import Lua

SCRIPTS = (ACQUIRE, CLAIM, RELEASE, RELEASE_MANY, EXTEND, INSPECT, FORCE_RELEASE, PURGE,
           PURGE_DUE, RECORD_SET, RECORD_DELETE, JOIN, PASS)  # fmt: skip
BATCH = 500  # names per script call in list()
PURGE_PAGE = 100  # zsets per purge script: about a millisecond of the server's time


#: Request: ``EVALSHA lua.sha len(keys) *keys *args`` → the script's reply (decoded); the
#: driver loads the script (SCRIPT LOAD) when the server answers NOSCRIPT, and sends again.
#: A plain tuple (lua, keys, args), told apart by its type: the hot path, where a NamedTuple's
#: Python-level ``__new__`` cost ~1 µs per call (the other requests are NamedTuples).
Script = tuple[Lua, Sequence[str], Sequence[str | int]]


class Command(NamedTuple):
    """Request: one plain command, its words (``("TIME",)``) → its reply, decoded."""

    words: Sequence[str | int]


class Subscribe(NamedTuple):
    """Request: a waiter subscribed to ``channel``, the server's confirmation read → the
    driver's Waiter (sync) or AsyncWaiter, woken by every PUBLISH on the channel. ``passing``:
    the script to send if it leaves woken without the lease and no waiter of this store object
    is left on the channel (the woken process's turn passes on: see PASS)."""

    channel: str
    passing: Script | None = None


#: This process's part of every line id: new in a forked child, so parent and child never
#: share a waiter's channel.
_PROCESS = [secrets.token_hex(4)]
os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, secrets.token_hex(4)))
_NUMBERS = itertools.count()
#: How long after a busy attempt joined a store object to a name's line its waiter may skip
#: the JOIN before subscribing: the attempt and the subscription of one acquire follow each
#: other at once. Should a release pop the store object in between (nobody listened yet), the
#: core's attempt after subscribing joins it again (eager and busy), as it would after a JOIN.
JOINED_FRESH = 0.1


def _dt(ms: int | float | str) -> datetime:
    return datetime.fromtimestamp(int(float(ms)) / 1000, tz=timezone.utc)


def _ttl_ms(ttl: float) -> int:
    return max(1, math.ceil(ttl * 1000))


def _grant(reply: str) -> Grant:
    """``token:expires ms``, or ``token:expires ms:ms left`` for a lease found again."""
    token, _, rest = reply.partition(":")
    expires, _, left = rest.partition(":")
    return Grant(int(token), _dt(expires), int(left) / 1000 if left else None)


def _holder(record: str, expires: int | float | str) -> Holder:
    """A holder's record ``token:acquired ms:owner_info`` and its expiry → Holder."""
    token, acquired, info = [*record.split(":", 2), "", ""][:3]
    return Holder(
        token=int(token) if token.isdigit() else None,
        owner=Owner.from_json(info),
        acquired_at=_dt(acquired) if acquired.isdigit() else None,
        expires_at=_dt(expires),
    )


def _info(name: str, flat: Sequence[Any], waiting: int | str) -> LockInfo | None:
    """INSPECT's ``{rec, expires ms, rec, expires ms, ...}`` and subscriber count of one name
    → LockInfo."""
    holders = [_holder(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    if not holders:
        return None
    holders.sort(key=lambda h: h.token or 0)  # tokens grow with acquisition order
    return LockInfo(name, tuple(holders), int(waiting))


def _infos(names: Sequence[str], reply: Sequence[Any]) -> list[LockInfo]:
    """INSPECT's reply for ``names`` → the LockInfo of each name that is held."""
    return list(filter(None, map(_info, names, reply[1::2], reply[2::2])))


def _check_tls(store: Store) -> None:
    """A TLS option (``ssl_ca_certs``…) in a URL without TLS (``redis://``,
    ``redis+sentinel://``, ``redis+cluster://``): ConfigError naming the TLS scheme."""
    scheme = store.url.scheme
    misused = tls_misused(scheme, store.config["driver"])
    if misused is not None:
        raise ConfigError(
            f"{scheme} store: option {misused} is for TLS: use {tls_scheme(scheme)}://"
        )


class Redis(Store):
    """Leases, claims and records in Redis, one Lua script per primitive."""

    scheme = "redis"
    capabilities = Capabilities(durable=False, push=True, survives_eviction=False)
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key (letters, digits, _:.-)"),
    }
    #: redis-py's own options (client_name, socket_keepalive, ssl_ca_certs…): passed through.
    driver_options = REDIS_OPTIONS
    sync_driver = "latchkey.stores.io.redis:RedisDriver"
    async_driver = "latchkey.stores.io.redis_async:AsyncRedisDriver"
    #: The scripts that may change a semaphore's zset, and so its expiry index member: the
    #: cluster's own copies keep no index (:mod:`latchkey.stores.redis_cluster`).
    acquire_lua, extend_lua = ACQUIRE, EXTEND
    #: The script that passes a woken process's turn on (it rings: SPUBLISH on a cluster).
    pass_lua = PASS

    def __init__(self, backend: BackendBase) -> None:
        super().__init__(backend)
        url = self.url
        if len(url.hosts) > 1:
            raise ConfigError(f"{url.scheme} store: one host only (got {len(url.hosts)})")
        db = url.path.strip("/") or "0"
        if not db.isdigit():
            raise ConfigError(
                f"{url.scheme} store: the URL path must be a db number, not {url.path!r}"
            )
        self.db = int(db)
        self.prefix: str = self.config["prefix"]
        _check_tls(self)

    @functools.cached_property
    def busy_names(self) -> BusyMemory:
        """Names a mutex attempt of this store object found busy lately: its next attempt at
        one joins the line if busy (``+L``: it is most likely about to wait). Made on first
        use: the Sentinel and Cluster stores have an ``__init__`` of their own."""
        return BusyMemory()

    @functools.cached_property
    def joined(self) -> BusyMemory:
        """Names such an attempt put this store object in line for a moment ago: the waiter
        that follows skips its JOIN."""
        return BusyMemory(seconds=JOINED_FRESH)

    @functools.cached_property
    def _number(self) -> str:
        return f".{next(_NUMBERS)}"

    @property
    def line_id(self) -> str:
        """This store object's name in the lines of waiting processes, and the last part of
        its waiters' channels: ``<process>.<store object>`` (hex and digits, no ``:``)."""
        return _PROCESS[0] + self._number

    # -- key layout (see the module docstring) -----------------------------------------------

    def base(self, name: str) -> str:
        """``P{hex of the name's UTF-8}``: the one KEYS entry of every script for ``name``."""
        return f"{self.prefix}{{{name.encode().hex()}}}"

    def keys(self, name: str) -> list[str]:
        """The lease string (also the channel its releases are published on), leases zset,
        owners hash and fence counter of ``name``: one cluster slot."""
        base = self.base(name)
        return [f"{base}:lease", f"{base}:leases", f"{base}:owners", f"{base}:fence"]

    def record_key(self, name: str) -> str:
        return f"{self.base(name)}:record"

    def index_key(self) -> str:
        """The expiry index of the semaphore zsets: ``Pexpiring`` (the scripts derive it from
        a base key the same way: the base up to its ``{``)."""
        return f"{self.prefix}expiring"

    def name_of(self, key: str) -> str | None:
        """The name behind a ``lease``/``leases`` key found by SCAN; None for a foreign key."""
        inner = key[len(self.prefix) :]
        hex_name, sep, kind = inner[1:].partition("}:")
        if not (inner.startswith("{") and sep and kind in ("lease", "leases")):
            return None
        try:
            return bytes.fromhex(hex_name).decode()
        except ValueError:
            return None

    def names(self, prefix: str) -> Steps[list[str]]:
        """Names starting with ``prefix`` that have a lease key, in name order (hex keeps
        prefixes and order), by SCAN MATCH of their lease keys."""
        pattern = f"{self.prefix}{{{prefix.encode().hex()}*}}:lease*"
        cursor, names = "0", set[str | None]()
        while True:
            cursor, found = yield Command(("SCAN", cursor, "MATCH", pattern, "COUNT", 1000))
            names.update(map(self.name_of, found))
            if cursor == "0":
                return sorted(n for n in names if n is not None and n.startswith(prefix))

    # -- leases ----------------------------------------------------------------------------

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Grant | Busy]:
        line_id = _PROCESS[0] + self._number
        eager = limit == 1 and self.busy_names.recent(name)
        args = (owner, owner_info, _ttl_ms(ttl), "+" + line_id if eager else line_id)
        reply = yield (self.acquire_lua, (self.base(name),), args if limit == 1 else (*args, limit))
        if isinstance(reply, str):
            return _grant(reply)  # no limit above: the script's default, 1
        if limit == 1:
            self.busy_names.mark(name)
            if eager:  # the script put this store object in the name's line
                self.joined.mark(name)
        expires, now = int(reply[2]), int(reply[3])
        if len(reply) > 4:  # this process was woken: try again when its turn is due
            retry = max(0, int(reply[4]) - now) / 1000
            if not reply[1]:  # free, but the turn of another process a release woke
                return Busy(1, None, retry)
            return Busy(int(reply[0]), _holder(reply[1], expires), retry)
        return Busy(int(reply[0]), _holder(reply[1], expires), max(0, expires - now) / 1000)

    def release(self, name: str, owner: str) -> Steps[bool]:
        return int((yield (RELEASE, (self.base(name),), (owner,)))) == 1

    def extend(self, name: str, owner: str, ttl: float) -> Steps[Grant | None]:
        reply = yield (self.extend_lua, (self.base(name),), (owner, _ttl_ms(ttl)))
        return None if reply is None else _grant(reply)

    def inspect(self, name: str) -> Steps[LockInfo | None]:
        reply = yield (INSPECT, (self.base(name),), ())
        return _info(name, reply[1], reply[2])

    def list(self, prefix: str) -> Steps[list[LockInfo]]:
        names, out = (yield from self.names(prefix)), list[LockInfo]()
        for start in range(0, len(names), BATCH):
            chunk = names[start : start + BATCH]
            out += _infos(chunk, (yield (INSPECT, [self.base(n) for n in chunk], ())))
        return out

    def force_release(self, name: str) -> Steps[bool]:
        return int((yield (FORCE_RELEASE, (self.base(name),), ()))) == 1

    def purge_expired(self, limit: int | None) -> Steps[int]:
        """Expired entries of semaphore zsets that live holders keep alive: everything else
        expires by itself (PX / PEXPIREAT). Only the zsets whose soonest expiry is due are
        read, from the expiry index (``Pexpiring``), a hundred per script (a script blocks the
        server): a purge costs what it removes, however many leases are live. Stops once
        ``limit`` entries are removed, or none is due."""
        index, count = self.index_key(), 0
        while True:
            removed, tidied = yield (PURGE_DUE, (index,), (PURGE_PAGE,))
            count += int(removed)
            if int(tidied) < PURGE_PAGE or (limit is not None and count >= limit):
                return count

    # -- batch claims, versioned records -------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> Steps[dict[str, Grant]]:
        if not names:
            return {}
        keys = [self.base(n) for n in names]
        reply = yield (CLAIM, keys, (owner, owner_info, _ttl_ms(ttl)))
        expires = _dt(reply[0])
        return {n: Grant(int(t), expires) for n, t in zip(names, reply[1:], strict=True) if int(t)}

    def release_many(self, names: Sequence[str], owner: str) -> Steps[int]:
        if not names:
            return 0
        return int((yield (RELEASE_MANY, [self.base(n) for n in names], (owner,))))

    def record_get(self, name: str) -> Steps[tuple[str | None, int]]:
        value, version = yield Command(("HMGET", self.record_key(name), "value", "version"))
        return (None, 0) if version is None else (str(value), int(version))

    def record_set(self, name: str, value: str, version: int) -> Steps[int | None]:
        new = int((yield (RECORD_SET, (self.record_key(name),), (value, version))))
        return None if new < 0 else new

    def record_delete(self, name: str, version: int) -> Steps[bool]:
        return int((yield (RECORD_DELETE, (self.record_key(name),), (version,)))) == 1

    # -- waiting, clock, scripts ---------------------------------------------------------------

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        """A mutex waiter listens on this store object's own channel of the name (a release
        wakes the first process in line there); a semaphore's on the name's channel."""
        if limit != 1 or not owner:
            return (yield Subscribe(f"{self.base(name)}:lease"))
        base, line_id = self.base(name), self.line_id
        if not self.joined.recent(name):  # (else a busy attempt joined it just now)
            yield (JOIN, (base,), (line_id,))  # first: nothing to undo if it fails
        return (yield Subscribe(self.waiters_channel(name), (self.pass_lua, (base,), (line_id,))))

    def waiters_channel(self, name: str) -> str:
        """The channel on which this store object's mutex waiters of ``name`` are woken."""
        return f"{self.base(name)}:lease:{self.line_id}"

    def now(self) -> Steps[datetime]:
        seconds, micros = yield Command(("TIME",))
        return datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, tz=timezone.utc)

    def init(self) -> Steps[None]:
        """Load the scripts now (they are also loaded on first use, after NOSCRIPT)."""
        for lua in SCRIPTS:
            yield Command(("SCRIPT", "LOAD", lua.text))


class RedisBackend(StoreBackend):
    store_class = Redis


class AsyncRedisBackend(AsyncStoreBackend):
    store_class = Redis
