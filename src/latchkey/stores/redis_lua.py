"""The Redis store's Lua scripts (:mod:`latchkey.stores.redis`), one named constant each.

Kept beside the store module, not in it, only for length: the store module is its key
layout, requests, reply parsing and primitives; this one is what runs inside Redis. Each
constant is a :class:`~latchkey.stores.redis_lua_helpers.Lua` (its text and SHA1, computed
here: EVALSHA needs no round trip to learn it) with a comment block: KEYS, ARGV, what it
returns, the invariant it keeps. The helpers the scripts share (``local`` functions) and the
building of a script from them are :mod:`latchkey.stores.redis_lua_helpers`.
"""

from __future__ import annotations

from latchkey.stores.redis_lua_helpers import HELPERS, LIBRARY, PROLOGUE, script

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
# - tokens come only from `fence`: the next token is max(fence + 1, now ms), written back with
#   an expiry of the lease's TTL + FENCE_KEEP. A counter lost in a restart of a server that
#   keeps nothing on disk, or expired after its name was last used, starts again from the
#   server's clock, above every token it gave (the clock does not go back, and tokens run ahead
#   of it only by the grants beyond one a millisecond): tokens keep increasing across restarts,
#   and a name used once does not leave a key behind for ever.
# - the expiry index, the sorted set "P" .. "expiring" (no "{": no name's key can be it), has a
#   member per semaphore: the base key "P{H}" -> the soonest expiry in its `leases` zset, or no
#   member when that zset is empty. Every script that changes a zset keeps it so (`reindex`,
#   in the same script: no round trip is added), and a purge reads only the members due
#   (score <= now): it costs what it removes, not what is live. A zset that expires by itself
#   (its holders all ended unreleased) leaves its member due, for the next purge or the
#   name's next use to remove. A zset written before the index existed is not in it until a
#   script changes it (an acquire, renewal or release of that name), or expires by itself as
#   before. Redis Cluster's scripts keep no index (INDEXED false: it would be another slot).
# Times are integer milliseconds of the server clock (TIME); a holder whose expiry <= now is gone.
# A holder's record "token:acquired ms:owner_info" is what inspect sees: owner tokens stay inside.

#
# Waking one process. A process (a store object of one process, named by its line id L) whose
# waiters wait for a mutex subscribes to the channel "P{H}:lease:L"; it joins the name's
# `line` before subscribing (JOIN), and a busy attempt of it (its attempts send L) while L's
# channel has a subscriber joins again (NX: keeping its place). A release pops the first of
# the line, records it in `rung` with the time, and
# PUBLISHes on its channel only: one process is woken per release, not all (a PUBLISH that
# reaches no subscriber, the process having left or died, pops the next). Barging with a
# bound, as Go's sync.Mutex: for TURN_MS after the ring, whoever asks may still take the free
# name (the running holder takes it again at once, instead of waiting ~1 ms for the woken
# process: the throughput of a lock that is released and taken in a loop); from then on a free
# name is the woken process's turn: others are told busy (a Busy without holder) and join the
# line, and the next release wakes it again, until it takes the name or RESERVE_MS pass (it
# may be stuck: the name is free for all again, and the next release wakes the next). A turn
# whose process no longer listens on its channel is dropped at once. Each process's waiters
# take their turns in the order they came (the client's own line, latchkey._core.holds).
# `line` expires LINE_KEEP_MS after the last process joined; `rung` with its turn.

# The mutex paths of acquire, release and extend come first in their scripts, before the
# helpers: a script that returns early never builds the helpers' closures, and runs only the
# commands a hand-written lock would, plus TIME and the fence's GET and SET.

# Take a slot of one name. An owner that already holds a live lease gets it back as it is.
# KEYS: the name's base key.  ARGV: owner, owner_info, ttl ms, line id (or absent), limit
#       (absent: 1). A line id "+L" (a mutex attempt at a name found busy a moment ago: its
#       process is about to wait) joins L to the line when busy, even before it subscribes,
#       so the JOIN round trip before its SUBSCRIBE is skipped.
# Returns the string "token:expires ms" ("token:expires ms:ms left" for the owner's own live
#         lease), or, when `limit` live holders exist, the table
#         {live count, soonest holder's "token:acquired:info", its expiry ms, now ms}, with a
#         5th, when to try again (ms), for a woken process whose turn comes due before that
#         expiry (the holder barged; the release that ends its turn may ring nobody);
#         {1, '', end of the turn ms, now ms, the same} for a free mutex that is a woken
#         process's turn.
# Fast path: a mutex on a name with no key of either shape and no process woken (one EXISTS
# for the three) is free. Any holder, or a zset its expired semaphore holders left (it
# outlives its last score by 1 ms), or a woken process, sends the call on to `take`, which
# counts live holders exactly and keeps the turns.
ACQUIRE = script(
    PROLOGUE
    + """
local lease, rung, lid, eager = KEYS[1] .. ':lease', KEYS[1] .. ':rung', ARGV[4], false
if lid and string.byte(lid) == 43 then lid, eager = string.sub(lid, 2), true end  -- "+L"
local n = not ARGV[5] and redis.call('EXISTS', lease, KEYS[1] .. ':leases', rung)
local t = (n == 0 or n == 1) and redis.call('TIME')
local now = t and tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local free = n == 0
if n == 1 then  -- one key: free if it is `rung` and another's turn is not due yet (the
  local r = redis.call('GET', rung)  -- caller's own turn is taken in `take`)
  if r then
    local sep = string.find(r, ':', 1, true)
    free = string.sub(r, 1, sep - 1) ~= lid and now - tonumber(string.sub(r, sep + 1)) < TURN_MS
  end
end
if free then
  local fence = KEYS[1] .. ':fence'  -- next_token(), inline (see the invariants above)
  local token = math.max(tonumber(redis.call('GET', fence) or '0') + 1, now)
  redis.call('SET', fence, token, 'PX', ARGV[3] + 600000)
  redis.call('SET', lease, ARGV[1] .. ':' .. token .. ':' .. now .. ':' .. ARGV[2], 'PX', ARGV[3])
  return token .. ':' .. (now + ARGV[3])
end
"""
    + HELPERS
    + """
return take(KEYS[1], ARGV[1], ARGV[2], now_ms(), tonumber(ARGV[3]), tonumber(ARGV[5] or '1'),
            lid, eager)
"""
)

# Take every free name of a batch (limit 1 each) with one expiry for all.
# KEYS: base keys of the names.  ARGV: owner, owner_info, ttl ms.
# Returns {expires ms, token or 0 (busy) per name, in KEYS order}.
CLAIM = script(
    LIBRARY
    + """
local now = now_ms()
local ttl = tonumber(ARGV[3])
local out = {now + ttl}
for i = 1, #KEYS do
  local r = take(KEYS[i], ARGV[1], ARGV[2], now, ttl, 1, nil)
  out[i + 1] = type(r) == 'string' and tonumber(string.match(r, '^(%d+):')) or 0
end
return out
"""
)

# End the owner's lease on a name and announce it on the channel "P{H}:lease".
# KEYS: the name's base key.  ARGV: owner.
# Returns 1 if the owner's lease was live, else 0. Never touches another owner's lease.
# Fast path: the owner's mutex lease (the lease string starts with "owner:").
RELEASE = script(
    PROLOGUE
    + """
local lease = KEYS[1] .. ':lease'
local v = redis.call('GET', lease)
local mine = v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ':'
if mine then
  redis.call('DEL', lease)
  redis.call('PUBLISH', lease, '1')
  local n = redis.call('EXISTS', KEYS[1] .. ':rung', KEYS[1] .. ':line')
  if n == 0 then return 1 end  -- no process waits in line
  local r = n == 1 and redis.call('GET', KEYS[1] .. ':rung')
  if r then  -- one woken, none in line: ring it again only once its turn is due (see ring)
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    if now - tonumber(string.match(r, ':(%d+)$')) < TURN_MS then return 1 end
  end
end
"""
    + HELPERS
    + """
if mine then  -- a process waits in line: wake it
  ring(KEYS[1])
  return 1
end
return release_slot(KEYS[1], ARGV[1])  -- not the owner's mutex: the GET above said so
"""
)

# RELEASE for many names. KEYS: base keys of the names.  ARGV: owner.
# Returns how many of the owner's leases were live.
RELEASE_MANY = script(
    LIBRARY
    + """
local count = 0
for i = 1, #KEYS do count = count + release(KEYS[i], ARGV[1]) end
return count
"""
)

# Move the owner's live lease to end ttl from now; the token is unchanged.
# KEYS: the name's base key.  ARGV: owner, ttl ms.
# Returns "token:expires ms", or nil if the owner holds no live lease.
EXTEND = script(
    LIBRARY
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
reindex(KEYS[1])
return token_of(rec) .. ':' .. (now + ttl)
"""
)

# Live holders of names and how many store objects wait for each (`waiting`), read-only.
# KEYS: base keys of the names.
# Returns {now ms, then per name: {rec, expires ms, rec, expires ms, ...}, subscribers}.
INSPECT = script(
    LIBRARY
    + """
local now = now_ms()
local out = {now}
for i = 1, #KEYS do
  out[2 * i] = holders(KEYS[i], now)
  out[2 * i + 1] = waiting(KEYS[i])
end
return out
"""
)

# Drop every lease on one name, whoever holds it; the fence counter stays.
# KEYS: the name's base key.  Returns 1 if a live lease was dropped, else 0.
FORCE_RELEASE = script(
    LIBRARY
    + """
local lease = KEYS[1] .. ':lease'
local live = redis.call('EXISTS', lease) + live_members(KEYS[1], now_ms())
redis.call('DEL', lease, KEYS[1] .. ':leases', KEYS[1] .. ':owners')
reindex(KEYS[1])
if live > 0 then
  redis.call('PUBLISH', lease, '1')
  ring(KEYS[1])
  return 1
end
return 0
"""
)

# Remove expired semaphore holders that live ones keep in the zset (mutex leases and zsets
# whose holders all expired are already gone by PX / PEXPIREAT), on zsets found by SCAN: Redis
# Cluster's purge (it keeps no expiry index).
# KEYS: base keys of the names.  Returns how many entries were removed.
PURGE = script(
    LIBRARY
    + """
local now = now_ms()
local count = 0
for i = 1, #KEYS do
  count = count + drop_expired(KEYS[i], now)
  reindex(KEYS[i])
end
return count
"""
)

# The same through the expiry index: the zsets whose soonest expiry is due, at most ARGV[1] of
# them, are tidied and get their new soonest expiry (> now) or leave the index; so every
# member read is work done, and a call that reads fewer than ARGV[1] has left none due.
# KEYS: the index "P" .. "expiring".  ARGV: how many zsets at most.
# Returns {entries removed, zsets tidied}.
PURGE_DUE = script(
    LIBRARY
    + """
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local count = 0
for i = 1, #due do
  count = count + drop_expired(due[i], now)
  reindex(due[i])
end
return {count, #due}
"""
)

# A process about to subscribe a waiter to its channel of the name joins the name's line (or
# keeps its place), so that a release rings it even if no attempt of it reaches the store (its
# waiters are answered busy by their own process while a lease of it is held there). Sent
# before the SUBSCRIBE, so that nothing is left to undo if it fails: a release in between
# finds nobody on the channel and pops it, and the core's attempt after subscribing (which
# joins again, if busy) sees that release.
# KEYS: the name's base key.  ARGV: line id.  Returns nothing.
JOIN = script(
    LIBRARY
    + """
enter(KEYS[1], ARGV[1], now_ms())
"""
)

# A woken process's last waiter left without the name (its wait ran out, or was cancelled):
# if the turn is still its own, it ends, and if the name is free the next in line is woken in
# its place (else nobody would be until the next release, or the others' next polls).
# KEYS: the name's base key.  ARGV: line id.  Returns 1 if another was woken, else 0.
PASS = script(
    LIBRARY
    + """
local r = redis.call('GET', KEYS[1] .. ':rung')
if not r or string.sub(r, 1, #ARGV[1] + 1) ~= ARGV[1] .. ':' then return 0 end
redis.call('DEL', KEYS[1] .. ':rung')
if redis.call('EXISTS', KEYS[1] .. ':lease') == 1 or live_members(KEYS[1], now_ms()) > 0 then
  return 0
end
ring(KEYS[1])
return 1
"""
)

# Write a record if its version is still the expected one (0: absent).
# KEYS: record hash.  ARGV: value, expected version.  Returns the new version, or -1.
RECORD_SET = script(
    """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current ~= tonumber(ARGV[2]) then return -1 end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'version', current + 1)
return current + 1
"""
)

# Delete a record if its version is still the expected one (never "deletes" an absent one).
# KEYS: record hash.  ARGV: expected version.  Returns 1 if deleted, else 0.
RECORD_DELETE = script(
    """
local current = redis.call('HGET', KEYS[1], 'version')
if not current or tonumber(current) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
)
