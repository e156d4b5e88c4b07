"""The Redis store (``redis://``, ``rediss://``): every primitive is one Lua script, one round trip.

Key layout, for a name whose UTF-8 bytes in hex are ``H`` and the ``?prefix=`` ``P``
(default ``latchkey:``)::

    P{H}:lease   string      the mutex holder: "owner:token:acquired ms:owner_info", PX ttl;
                             also the pub/sub channel on which every release is announced
    P{H}:leases  sorted set  semaphore holders: owner token -> expiry (ms, server clock)
    P{H}:owners  hash        semaphore holders: owner token -> "token:acquired ms:owner_info"
    P{H}:fence   string      INCR counter of fencing tokens; never expires, never deleted
    P{H}:record  hash        {value, version} of the versioned record ``name``

``{H}`` is a Redis Cluster hash tag: every key of one name lives in one slot, and hex keeps
any name (``{``, ``}``, NUL, any character) safe and prefix-preserving, so ``list(prefix)`` is
``SCAN MATCH P{hex(prefix)*}:lease*``. Lease keys expire by themselves (PX / PEXPIREAT), so a
crashed holder leaves nothing behind; the fence counter stays, so tokens keep increasing while
the server keeps its data.

Time is the server's: scripts read ``TIME`` (allowed in Redis >= 5 with effects replication,
the default from Redis 7). Waiters are woken by ``PUBLISH`` from the release script; one
pub/sub connection per backend serves all its waiters (see :class:`_Listener`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any, ClassVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import Option, StoreURL, choice, key_prefix
from latchkey.errors import ConfigError
from latchkey.stores.base import Backend, Capabilities, Waiter

# -- Lua ---------------------------------------------------------------------------------------
# Every script gets, per name, one KEYS entry: the name's base key "P{H}". It touches only the
# keys "P{H}:lease", ":leases", ":owners", ":fence", which share that hash tag and so the
# declared key's cluster slot (Redis Cluster accepts undeclared keys of the declared slot).
# One key instead of four makes EVALSHA as cheap to send as a raw SET NX PX.
#
# Two shapes of lease share a name. A mutex holder (limit 1, the common case) is one string key
# with PX, as cheap as a raw SET NX PX lock. Semaphore holders (limit > 1) are members of a
# sorted set scored by expiry, with their details in a hash. Both count as holders of the name
# for every acquire, so mixing limits on one name never over-grants. Invariants:
# - the `lease` string exists  <=>  a live mutex holder ("owner:token:acquired ms:owner_info");
# - the `leases` zset and `owners` hash have the same members, and both expire (PEXPIREAT) with
#   their last member, so the zset exists  <=>  it has a live member;
# - tokens come only from INCR on `fence`, which never expires and is never deleted.
# Times are integer milliseconds of the server clock (TIME); a holder whose expiry <= now is gone.
# A holder's record "token:acquired ms:owner_info" is what inspect sees: owner tokens stay inside.
_LUA_PROLOGUE = """
if redis.replicate_commands then redis.replicate_commands() end
"""
_LUA_HELPERS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function mutex_holder(base)
  local v = redis.call('GET', base .. ':lease')
  if not v then return nil, nil end
  local sep = string.find(v, ':', 1, true)
  return string.sub(v, 1, sep - 1), string.sub(v, sep + 1)
end
local function token_of(rec) return tonumber(string.match(rec, '^(%d+):')) end
local function live_members(base, now)  -- not EXISTS: a key outlives its last score by 1 ms
  return redis.call('ZCOUNT', base .. ':leases', '(' .. now, '+inf')
end
local function drop_expired(base, now)
  local leases, owners = base .. ':leases', base .. ':owners'
  local gone = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  for i = 1, #gone do redis.call('HDEL', owners, gone[i]) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', leases, '-inf', now) end
  return #gone
end
local function keep_until_last(base)
  local last = redis.call('ZRANGE', base .. ':leases', -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', base .. ':leases', last[2])
    redis.call('PEXPIREAT', base .. ':owners', last[2])
  end
end
local function holders(base, now)
  local out = {}
  local _, rec = mutex_holder(base)
  if rec then
    out[1] = rec
    out[2] = now + redis.call('PTTL', base .. ':lease')
  end
  local live = redis.call('ZRANGEBYSCORE', base .. ':leases', '(' .. now, '+inf', 'WITHSCORES')
  for i = 1, #live, 2 do
    out[#out + 1] = redis.call('HGET', base .. ':owners', live[i]) or ''
    out[#out + 1] = live[i + 1]
  end
  return out
end
local function busy(base, now)
  local h = holders(base, now)
  local best = 1
  for i = 3, #h, 2 do
    if tonumber(h[i + 1]) < tonumber(h[best + 1]) then best = i end
  end
  return {#h / 2, h[best], tonumber(h[best + 1]), now}
end
-- a grant is the string "token:expires ms", or "token:expires ms:ms left" for the owner's own
-- live lease found again (as it is: not renewed); busy is a table (see ACQUIRE)
local function take(base, owner, info, now, ttl, limit)
  local holder, rec = mutex_holder(base)
  if holder == owner then
    local left = redis.call('PTTL', base .. ':lease')
    return token_of(rec) .. ':' .. (now + left) .. ':' .. left
  end
  if limit == 1 then
    if holder or live_members(base, now) > 0 then return busy(base, now) end
    local token = redis.call('INCR', base .. ':fence')
    redis.call('SET', base .. ':lease', owner .. ':' .. token .. ':' .. now .. ':' .. info,
               'PX', ttl)
    return token .. ':' .. (now + ttl)
  end
  local leases, owners = base .. ':leases', base .. ':owners'
  drop_expired(base, now)
  local expires = now + ttl
  local mine = redis.call('HGET', owners, owner)
  if mine then  -- live: drop_expired just removed the expired ones
    local ends = tonumber(redis.call('ZSCORE', leases, owner))
    return token_of(mine) .. ':' .. ends .. ':' .. (ends - now)
  end
  local live = redis.call('ZCARD', leases) + (holder and 1 or 0)
  if live >= limit then return busy(base, now) end
  local token = redis.call('INCR', base .. ':fence')
  redis.call('ZADD', leases, expires, owner)
  redis.call('HSET', owners, owner, token .. ':' .. now .. ':' .. info)
  keep_until_last(base)
  return token .. ':' .. expires
end
local function release(base, owner)
  if mutex_holder(base) == owner then
    redis.call('DEL', base .. ':lease')
    redis.call('PUBLISH', base .. ':lease', '1')
    return 1
  end
  local expires = redis.call('ZSCORE', base .. ':leases', owner)
  if not expires then return 0 end
  redis.call('ZREM', base .. ':leases', owner)
  redis.call('HDEL', base .. ':owners', owner)
  keep_until_last(base)
  if tonumber(expires) <= now_ms() then return 0 end
  redis.call('PUBLISH', base .. ':lease', '1')
  return 1
end
"""

_LUA = _LUA_PROLOGUE + _LUA_HELPERS

# The mutex paths of acquire, release and extend come first in their scripts, before the
# helpers: a script that returns early never builds the helpers' closures, and runs only the
# commands a hand-written lock would, plus TIME and the fencing INCR.

# Take a slot of one name. An owner that already holds a live lease gets it back as it is.
# KEYS: the name's base key.  ARGV: owner, owner_info, ttl ms, limit (absent: 1).
# Returns the string "token:expires ms" ("token:expires ms:ms left" for the owner's own live
#         lease), or, when `limit` live holders exist, the table
#         {live count, soonest holder's "token:acquired:info", its expiry ms, now ms}.
# Fast path: a mutex on a name with no key of either shape (one EXISTS for both) is free. Any
# holder, or a zset its expired semaphore holders left (it outlives its last score by 1 ms),
# sends the call on to `take`, which counts live holders exactly.
ACQUIRE = (
    _LUA_PROLOGUE
    + """
local lease = KEYS[1] .. ':lease'
if not ARGV[4] and redis.call('EXISTS', lease, KEYS[1] .. ':leases') == 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local token = redis.call('INCR', KEYS[1] .. ':fence')
  redis.call('SET', lease, ARGV[1] .. ':' .. token .. ':' .. now .. ':' .. ARGV[2], 'PX', ARGV[3])
  return token .. ':' .. (now + ARGV[3])
end
"""
    + _LUA_HELPERS
    + """
return take(KEYS[1], ARGV[1], ARGV[2], now_ms(), tonumber(ARGV[3]), tonumber(ARGV[4] or '1'))
"""
)

# Take every free name of a batch (limit 1 each) with one expiry for all.
# KEYS: base keys of the names.  ARGV: owner, owner_info, ttl ms.
# Returns {expires ms, token or 0 (busy) per name, in KEYS order}.
CLAIM = (
    _LUA
    + """
local now = now_ms()
local ttl = tonumber(ARGV[3])
local out = {now + ttl}
for i = 1, #KEYS do
  local r = take(KEYS[i], ARGV[1], ARGV[2], now, ttl, 1)
  out[i + 1] = type(r) == 'string' and tonumber(string.match(r, '^(%d+):')) or 0
end
return out
"""
)

# End the owner's lease on a name and announce it on the channel "P{H}:lease".
# KEYS: the name's base key.  ARGV: owner.
# Returns 1 if the owner's lease was live, else 0. Never touches another owner's lease.
# Fast path: the owner's mutex lease (the lease string starts with "owner:").
RELEASE = (
    _LUA_PROLOGUE
    + """
local lease = KEYS[1] .. ':lease'
local v = redis.call('GET', lease)
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
  redis.call('DEL', lease)
  redis.call('PUBLISH', lease, '1')
  return 1
end
"""
    + _LUA_HELPERS
    + """
return release(KEYS[1], ARGV[1])
"""
)

# RELEASE for many names. KEYS: base keys of the names.  ARGV: owner.
# Returns how many of the owner's leases were live.
RELEASE_MANY = (
    _LUA
    + """
local count = 0
for i = 1, #KEYS do count = count + release(KEYS[i], ARGV[1]) end
return count
"""
)

# Move the owner's live lease to end ttl from now; the token is unchanged.
# KEYS: the name's base key.  ARGV: owner, ttl ms.
# Returns "token:expires ms", or nil if the owner holds no live lease.
EXTEND = (
    _LUA
    + """
local now = now_ms()
local ttl = tonumber(ARGV[2])
local lease = KEYS[1] .. ':lease'
local v = redis.call('GET', lease)
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
  redis.call('PEXPIRE', lease, ttl)
  return string.match(v, '^(%d+):', #ARGV[1] + 2) .. ':' .. (now + ttl)
end
local expires = redis.call('ZSCORE', KEYS[1] .. ':leases', ARGV[1])
local rec = redis.call('HGET', KEYS[1] .. ':owners', ARGV[1])
if not expires or not rec or tonumber(expires) <= now then return nil end
redis.call('ZADD', KEYS[1] .. ':leases', now + ttl, ARGV[1])
keep_until_last(KEYS[1])
return token_of(rec) .. ':' .. (now + ttl)
"""
)

# Live holders of names, read-only. KEYS: base keys of the names.
# Returns {now ms, {rec, expires ms, rec, expires ms, ...} per name}.
INSPECT = (
    _LUA
    + """
local now = now_ms()
local out = {now}
for i = 1, #KEYS do out[i + 1] = holders(KEYS[i], now) end
return out
"""
)

# Drop every lease on one name, whoever holds it; the fence counter stays.
# KEYS: the name's base key.  Returns 1 if a live lease was dropped, else 0.
FORCE_RELEASE = (
    _LUA
    + """
local lease = KEYS[1] .. ':lease'
local live = redis.call('EXISTS', lease) + live_members(KEYS[1], now_ms())
redis.call('DEL', lease, KEYS[1] .. ':leases', KEYS[1] .. ':owners')
if live > 0 then
  redis.call('PUBLISH', lease, '1')
  return 1
end
return 0
"""
)

# Remove expired semaphore holders that live ones keep in the zset (mutex leases and zsets
# whose holders all expired are already gone by PX / PEXPIREAT).
# KEYS: base keys of the names.  Returns how many entries were removed.
PURGE = (
    _LUA
    + """
local now = now_ms()
local count = 0
for i = 1, #KEYS do count = count + drop_expired(KEYS[i], now) end
return count
"""
)

# Write a record if its version is still the expected one (0: absent).
# KEYS: record hash.  ARGV: value, expected version.  Returns the new version, or -1.
RECORD_SET = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current ~= tonumber(ARGV[2]) then return -1 end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'version', current + 1)
return current + 1
"""

# Delete a record if its version is still the expected one (never "deletes" an absent one).
# KEYS: record hash.  ARGV: expected version.  Returns 1 if deleted, else 0.
RECORD_DELETE = """
local current = redis.call('HGET', KEYS[1], 'version')
if not current or tonumber(current) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
_BATCH = 500  # names per script call in list() and purge_expired()


def _dt(ms: int | float | str) -> datetime:
    return datetime.fromtimestamp(int(float(ms)) / 1000, tz=timezone.utc)


def _grant(reply: str) -> Grant:
    """``token:expires ms``, or ``token:expires ms:ms left`` for a lease found again."""
    token, _, rest = reply.partition(":")
    expires, _, left = rest.partition(":")
    return Grant(int(token), _dt(expires), int(left) / 1000 if left else None)


def _ttl_ms(ttl: float) -> int:
    return max(1, math.ceil(ttl * 1000))


def _holder(record: str, expires: int | float | str) -> Holder:
    token, acquired, info = [*record.split(":", 2), "", ""][:3]
    return Holder(
        token=int(token) if token.isdigit() else None,
        owner=Owner.from_json(info),
        acquired_at=_dt(acquired) if acquired.isdigit() else None,
        expires_at=_dt(expires),
    )


def _info(name: str, flat: Sequence[Any]) -> LockInfo | None:
    holders = [_holder(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    if not holders:
        return None
    holders.sort(key=lambda h: h.token or 0)  # tokens grow with acquisition order
    return LockInfo(name, tuple(holders))


def connection_settings(url: StoreURL, config: dict[str, Any]) -> dict[str, Any]:
    """The redis-py client arguments for ``url`` (sync and asyncio clients take the same):
    one host, the db number from the path, AUTH, TLS, the store's timeout on every socket
    operation, RESP2 (from Redis 5 on; pub/sub replies are plain arrays)."""
    if len(url.hosts) > 1:
        raise ConfigError(f"{url.scheme} store: one host only (got {len(url.hosts)})")
    db_text = url.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigError(f"{url.scheme} store: the URL path must be a db number, not {url.path!r}")
    ssl: dict[str, Any] = {}
    if url.scheme == "rediss":
        ssl = {"ssl": True, "ssl_cert_reqs": config["ssl_cert_reqs"]}
        if config["ssl_ca_certs"]:
            ssl["ssl_ca_certs"] = config["ssl_ca_certs"]
    return {
        "host": url.host or "localhost",
        "port": url.port or 6379,
        "db": int(db_text),
        "username": url.username,
        "password": url.password,
        "socket_timeout": config["timeout"],
        "socket_connect_timeout": config["timeout"],
        "decode_responses": True,
        "protocol": 2,
        **ssl,
    }


class KeyLayout:
    """The key layout of the module docstring, for a backend with a ``prefix``: shared by
    the sync and the asyncio backends."""

    prefix: str

    def _base(self, name: str) -> str:
        """``P{hex of the name's UTF-8}``: the KEYS entry of every script for ``name``."""
        return f"{self.prefix}{{{name.encode('utf-8').hex()}}}"

    def _keys(self, name: str) -> list[str]:
        """The lease string, leases zset, owners hash and fence counter of ``name``, all in
        one cluster slot (the first is also the channel its releases are published on)."""
        base = self._base(name)
        return [f"{base}:lease", f"{base}:leases", f"{base}:owners", f"{base}:fence"]

    def _name_of(self, key: str) -> str | None:
        """The name behind a ``lease``/``leases`` key found by SCAN; None for a foreign key."""
        inner = key[len(self.prefix) :]
        hex_name, sep, kind = inner[1:].partition("}:")
        if not (inner.startswith("{") and sep and kind in ("lease", "leases")):
            return None
        try:
            return bytes.fromhex(hex_name).decode("utf-8")
        except ValueError:
            return None

    def _record_key(self, name: str) -> str:
        return f"{self._base(name)}:record"

    def _scan_pattern(self, prefix: str) -> str:
        """The SCAN MATCH pattern of the lease keys of names starting with ``prefix``."""
        return f"{self.prefix}{{{prefix.encode('utf-8').hex()}*}}:lease*"

    def _names(self, keys: Iterable[str], prefix: str) -> list[str]:
        """The names behind lease keys found by SCAN, in name order (hex is prefix- and
        order-preserving)."""
        names = {self._name_of(key) for key in keys}
        return sorted(n for n in names if n is not None and n.startswith(prefix))


class RedisBackend(KeyLayout, Backend):
    """Leases, claims and records in Redis, one Lua script per primitive."""

    scheme: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(
        durable=False, push=True, survives_eviction=False
    )
    options = {
        "prefix": Option(key_prefix, "latchkey:", "prefix of every key (letters, digits, _:.-)"),
        "ssl_cert_reqs": Option(
            choice("required", "optional", "none"), "required", "rediss://: verify the server"
        ),
        "ssl_ca_certs": Option(str, None, "rediss://: CA bundle file"),
    }

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        self.prefix = self.config["prefix"]
        self.client = redis.Redis(
            **connection_settings(url, self.config),
            retry=Retry(NoBackoff(), 0),  # a primitive never retries: the core decides
        )
        self._connections = _Connections(self.client.connection_pool)
        register = functools.partial(_Script, self.client, self._connections)
        self._acquire = register(ACQUIRE)
        self._claim = register(CLAIM)
        self._release = register(RELEASE)
        self._release_many = register(RELEASE_MANY)
        self._extend = register(EXTEND)
        self._inspect = register(INSPECT)
        self._force_release = register(FORCE_RELEASE)
        self._purge = register(PURGE)
        self._record_set = register(RECORD_SET)
        self._record_delete = register(RECORD_DELETE)
        self._listener: _Listener | None = None
        self._listener_lock = threading.Lock()

    def _scan_names(self, prefix: str) -> list[str]:
        """Names with a lease key, in name order."""
        pattern = self._scan_pattern(prefix)
        return self._names(self.client.scan_iter(match=pattern, count=1000), prefix)

    # -- leases ----------------------------------------------------------------------------
    # acquire, release and extend catch errors inline: cheaper than translate() on hot paths.

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        args: list[str | int] = [owner, owner_info, _ttl_ms(ttl)]
        if limit != 1:  # the script's default: one ARGV less on the hot path
            args.append(limit)
        try:
            reply = self._acquire([self._base(name)], args)
        except _ERRORS as exc:
            self.unavailable(exc, "acquire")
        if isinstance(reply, str):
            return _grant(reply)
        expires, now = int(reply[2]), int(reply[3])
        return Busy(int(reply[0]), _holder(reply[1], expires), max(0, expires - now) / 1000)

    def release(self, name: str, owner: str) -> bool:
        try:
            return int(self._release([self._base(name)], [owner])) == 1
        except _ERRORS as exc:
            self.unavailable(exc, "release")

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        try:
            reply = self._extend([self._base(name)], [owner, _ttl_ms(ttl)])
        except _ERRORS as exc:
            self.unavailable(exc, "extend")
        return None if reply is None else _grant(reply)

    def inspect(self, name: str) -> LockInfo | None:
        with self.translate("inspect", _ERRORS):
            reply = self._inspect([self._base(name)])
        return _info(name, reply[1])

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        with self.translate("list", _ERRORS):
            names = self._scan_names(prefix)
        for start in range(0, len(names), _BATCH):
            chunk = names[start : start + _BATCH]
            with self.translate("list", _ERRORS):
                reply = self._inspect([self._base(n) for n in chunk])
            for n, flat in zip(chunk, reply[1:], strict=True):
                if (info := _info(n, flat)) is not None:
                    yield info

    def force_release(self, name: str) -> bool:
        with self.translate("force_release", _ERRORS):
            return int(self._force_release([self._base(name)])) == 1

    def purge_expired(self) -> int:
        count = 0
        with self.translate("purge_expired", _ERRORS):
            names = self._scan_names("")
            for start in range(0, len(names), _BATCH):
                count += int(self._purge([self._base(n) for n in names[start : start + _BATCH]]))
        return count

    # -- batch claims ----------------------------------------------------------------------

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        if not names:
            return {}
        with self.translate("claim", _ERRORS):
            reply = self._claim([self._base(n) for n in names], [owner, owner_info, _ttl_ms(ttl)])
        expires = _dt(reply[0])
        tokens = [int(t) for t in reply[1:]]
        return {n: Grant(t, expires) for n, t in zip(names, tokens, strict=True) if t > 0}

    def release_many(self, names: Sequence[str], owner: str) -> int:
        if not names:
            return 0
        with self.translate("release_many", _ERRORS):
            return int(self._release_many([self._base(n) for n in names], [owner]))

    # -- versioned records -----------------------------------------------------------------

    def record_get(self, name: str) -> tuple[str | None, int]:
        with self.translate("record_get", _ERRORS):
            value, version = self.client.hmget(self._record_key(name), ["value", "version"])
        return (None, 0) if version is None else (str(value), int(version))

    def record_set(self, name: str, value: str, version: int) -> int | None:
        with self.translate("record_set", _ERRORS):
            new = int(self._record_set([self._record_key(name)], [value, version]))
        return None if new < 0 else new

    def record_delete(self, name: str, version: int) -> bool:
        with self.translate("record_delete", _ERRORS):
            return int(self._record_delete([self._record_key(name)], [version])) == 1

    # -- waiting, health, lifecycle --------------------------------------------------------

    def subscribe(self, name: str) -> Waiter:
        """A waiter already subscribed (confirmed by the server) to ``name``'s channel."""
        channel = self._keys(name)[0]
        with self.translate("subscribe", _ERRORS):
            listener = self._get_listener()
            slot = listener.add(channel, self.timeout)
        return _PushWaiter(listener, channel, slot)

    def _get_listener(self) -> _Listener:
        with self._listener_lock:
            current = self._listener
            if current is None or current.error is not None or current.pid != os.getpid():
                if current is not None:
                    current.close()  # in a forked child this only closes the inherited fd
                pool = self.client.connection_pool
                conn = pool.connection_class(**pool.connection_kwargs)
                self._listener = current = _Listener(conn)
            return current

    def now(self) -> datetime:
        with self.translate("now", _ERRORS):
            seconds, micros = self.client.time()
        return datetime.fromtimestamp(seconds + micros / 1e6, tz=timezone.utc)

    def init(self) -> None:
        """Load the scripts now (they are also loaded on first use, after NOSCRIPT)."""
        with self.translate("init", _ERRORS):
            for script in (
                self._acquire,
                self._claim,
                self._release,
                self._release_many,
                self._extend,
                self._inspect,
                self._force_release,
                self._purge,
                self._record_set,
                self._record_delete,
            ):
                self.client.script_load(script.text)

    def close(self) -> None:
        with self._listener_lock:
            if self._listener is not None:
                self._listener.close()
            self._listener = None
        self._connections.close()
        self.client.close()


class _Connections:
    """The connections scripts go over: redis-py connections, used without the client.

    redis-py's client spends about as long per command as the loopback round trip itself
    (retry wrapper, the pool's lock and bookkeeping, observability hooks, response callbacks;
    ~40 µs here). A script call needs none of it: take an idle connection (a LIFO, lock-free
    under the GIL), send the pre-packed command, read the reply with the connection's own
    parser, put the connection back. Connections are made from the client pool's settings
    (host, db, AUTH, TLS, timeouts, RESP2), so they behave as the client's would.

    Like redis-py's pool, a pooled connection is checked before use with redis-py's public
    ``can_read()``: if the server closed it while it sat idle (restart, ``CLIENT KILL``,
    ``timeout``), it is reconnected instead of failing the call. One put back less than a
    millisecond ago is not checked: a server that restarted within that millisecond costs one
    StoreUnavailable instead of a silent reconnect (as in the memcached store). A connection
    that failed is disconnected and dropped (the next call makes a new one); after ``fork()``
    the child starts with none.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._new: Callable[[], Any] = functools.partial(
            pool.connection_class, **pool.connection_kwargs
        )
        # (connection, when it was put back): one back for under CHECK_AFTER seconds is used
        # again unchecked (the check costs ~9 % of an uncontended pair when run every time).
        self.idle: list[tuple[Any, float]] = []
        _ALL_CONNECTIONS.add(self)

    def call(self, packed: bytes) -> Any:
        try:
            conn, since = self.idle.pop()
        except IndexError:
            conn = self._new()
        else:
            if _monotonic() - since > CHECK_AFTER and _stale(conn):
                conn.disconnect()  # closed by the server, or bytes nobody asked for
        try:
            conn.send_packed_command((packed,), check_health=False)
            return conn.read_response()
        except redis.ResponseError:  # an error reply, read in full: the connection is fine
            raise
        except BaseException:
            conn.disconnect()
            conn = None
            raise
        finally:
            if conn is not None:
                self.idle.append((conn, _monotonic()))

    def forget(self) -> None:
        """Drop the idle connections without touching their sockets (after fork)."""
        self.idle = []

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            conn.disconnect()


#: An idle connection older than this is checked before it is used again (seconds).
CHECK_AFTER = 0.001
_monotonic = time.monotonic


def _stale(conn: Any) -> bool:
    """Before an idle connection is used again: is there something to read on it (EOF, stray
    bytes)? redis-py's own public check (``can_read``), which also sees through TLS records
    that carry no data (a TLS 1.3 session ticket); it connects a connection that has no
    socket yet (or any more)."""
    try:
        return bool(conn.can_read())
    except (redis.ConnectionError, OSError):
        return True


_ALL_CONNECTIONS: weakref.WeakSet[_Connections] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for connections in list(_ALL_CONNECTIONS):
        connections.forget()


os.register_at_fork(after_in_child=_forget_after_fork)


def _bulk(value: str | int) -> bytes:
    data = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%s\r\n" % (len(data), data)


class PackedScript:
    """A Lua script's text, its SHA1 (computed here, no round trip) and its EVALSHA command
    packed here in RESP, so that the client's per-command machinery is skipped on every call:
    shared by the sync and the asyncio backends."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()
        self._head = b"$7\r\nEVALSHA\r\n" + _bulk(self.sha)

    def pack(self, keys: Sequence[str], args: Sequence[str | int]) -> bytes:
        """``EVALSHA sha len(keys) *keys *args`` in RESP."""
        return b"".join(
            [
                b"*%d\r\n" % (3 + len(keys) + len(args)),
                self._head,
                _bulk(len(keys)),
                *[_bulk(k) for k in keys],
                *[_bulk(a) for a in args],
            ]
        )


class _Script(PackedScript):
    """A script run with EVALSHA over :class:`_Connections`, loaded with SCRIPT LOAD only when
    the server answers NOSCRIPT (first use, restart, SCRIPT FLUSH)."""

    def __init__(self, client: redis.Redis, connections: _Connections, text: str) -> None:
        super().__init__(text)
        self.client = client
        self.connections = connections

    def __call__(self, keys: Sequence[str], args: Sequence[str | int] = ()) -> Any:
        packed = self.pack(keys, args)
        try:
            return self.connections.call(packed)
        except redis.exceptions.NoScriptError:
            self.client.script_load(self.text)
            return self.connections.call(packed)


class _Slot:
    """One waiter's mailbox: set when a release of its name was announced."""

    __slots__ = ("woke",)

    def __init__(self) -> None:
        self.woke = False


class _Listener:
    """One pub/sub connection shared by every waiter of a backend, with no thread of its own.

    Whoever waits reads: the first waiting thread becomes the reader and blocks on the socket
    itself, so the usual hand-off (one waiter) costs no thread switch; it sets the mailboxes
    of the other waiters (who sleep on a condition) as messages come, and when its own wait
    ends another waiter takes over reading. Messages that arrive while nobody waits stay in
    the socket until the next wait.

    Replies to SUBSCRIBE/UNSUBSCRIBE come back in order, so each command gets a sequence
    number and ``add`` returns only once the reply to its own SUBSCRIBE was read: from then
    on the server delivers every PUBLISH on the channel. A channel is unsubscribed when its
    last waiter leaves. If the connection fails, every waiter wakes once (its next acquire
    reports the error or succeeds), later waits just sleep, and the backend opens a new
    listener for the next subscribe.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.channels: dict[str, set[_Slot]] = {}
        self.subscribed_at: dict[str, int] = {}  # channel -> sequence number of its SUBSCRIBE
        self.sent = 0
        self.acked = 0
        self.reading = False
        self.error: BaseException | None = None
        self.closed = False
        conn.connect()

    def _pump(self, done: Callable[[], bool], timeout: float) -> bool:
        """Read the socket, or wait for the reader, until ``done()`` or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.error is not None:
                    return done()
                if self.reading:
                    self.cond.wait(remaining)
                    continue
                self.reading = True
                self.cond.release()
                try:
                    self._read_until(done, deadline)
                finally:
                    self.cond.acquire()
                    self.reading = False
                    self.cond.notify_all()  # a follower takes over reading
            return True

    def _read_until(self, done: Callable[[], bool], deadline: float) -> None:
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.conn.can_read(timeout=remaining):
                    return
                self._dispatch(self.conn.read_response())
        except Exception as exc:  # the connection is gone: fall back to polling
            with self.cond:
                self.error = exc
                for slots in self.channels.values():
                    for slot in slots:
                        slot.woke = True
                self.cond.notify_all()

    def _dispatch(self, reply: Any) -> None:
        kind = reply[0]
        with self.cond:
            if kind in ("subscribe", "unsubscribe"):
                self.acked += 1
            elif kind == "message":
                for slot in self.channels.get(reply[1], ()):
                    slot.woke = True
            self.cond.notify_all()

    def add(self, channel: str, timeout: float) -> _Slot:
        slot = _Slot()
        with self.cond:
            if self.error is not None:
                raise self.error
            if channel not in self.channels:
                self.channels[channel] = set()
                self.sent += 1
                self.subscribed_at[channel] = self.sent
                self.conn.send_command("SUBSCRIBE", channel, check_health=False)
            self.channels[channel].add(slot)
            seq = self.subscribed_at[channel]
        if not self._pump(lambda: self.acked >= seq, timeout):
            self.remove(channel, slot)
            if self.error is not None:
                raise self.error
            raise redis.TimeoutError(f"no reply to SUBSCRIBE within {timeout:g}s")
        return slot

    def wait(self, slot: _Slot, timeout: float) -> bool:
        if self.error is not None and not slot.woke:
            time.sleep(max(0.0, timeout))  # the connection failed: poll
            return False
        self._pump(lambda: slot.woke, max(0.0, timeout))
        with self.cond:
            woke, slot.woke = slot.woke, False
        return woke and self.error is None

    def remove(self, channel: str, slot: _Slot) -> None:
        with self.cond:
            slots = self.channels.get(channel)
            if slots is None:
                return
            slots.discard(slot)
            if slots or self.error is not None or self.closed:
                return
            del self.channels[channel]
            del self.subscribed_at[channel]
            self.sent += 1
            try:
                self.conn.send_command("UNSUBSCRIBE", channel, check_health=False)
            except _ERRORS as exc:
                self.error = exc

    def close(self) -> None:
        self.closed = True
        self.conn.disconnect()


class _PushWaiter(Waiter):
    """Woken by a PUBLISH from a release script; polls (plain sleep) if the listener failed."""

    def __init__(self, listener: _Listener, channel: str, slot: _Slot) -> None:
        self._listener = listener
        self._channel = channel
        self._slot = slot

    def wait(self, timeout: float) -> bool:
        return self._listener.wait(self._slot, timeout)

    def close(self) -> None:
        self._listener.remove(self._channel, self._slot)
