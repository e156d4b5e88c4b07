"""The Lua library the Redis store's scripts (:mod:`latchkey.stores.redis_lua`) are built from.

:data:`PROLOGUE` starts every script; :data:`HELPERS` are the ``local`` functions the scripts
share (taking a slot, a fencing token, releasing, the expiry index), kept to the key layout
and invariants the comment above the scripts in ``redis_lua`` states. :func:`script` builds a
script from its text with only the helpers its own code calls, and names it by its SHA1
(:class:`Lua`). Kept apart from the scripts only for length: the scripts and these helpers
are one program that runs inside Redis.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple


class Lua(NamedTuple):
    """A script's text and its SHA1 (what EVALSHA names it by)."""

    text: str
    sha: str


def script(text: str) -> Lua:
    """The script, with only the helpers (of :data:`HELPERS`) its own code calls, directly or
    through another helper: a Lua closure is built per call for every ``local function``, and
    the semaphore paths ran ~0.3 µs of the server's time faster per script without the ones
    they never call (bench/scriptab.py)."""
    if HELPERS in text:
        head, tail = text.split(HELPERS, 1)
        text = head + _helpers_for(head + tail) + tail
    return Lua(text, hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest())


def _helpers_for(code: str) -> str:
    """The chunks of ``HELPERS`` (each a top-level ``local`` at column 0, with what follows
    it) that ``code`` names, and those they name, in their order."""
    named = {
        re.findall(r"^local (?:function )?(\w+)", chunk)[0]: chunk
        for chunk in re.split(r"(?m)^(?=local )", HELPERS)
        if chunk.strip()
    }
    wanted: set[str] = set()
    todo = [code]
    while todo:
        text = todo.pop()
        for name in named.keys() - wanted:
            if re.search(rf"\b{name}\b", text):
                wanted.add(name)
                todo.append(named[name])
    return "".join(c for name, c in named.items() if name in wanted)


PROLOGUE = """
if redis.replicate_commands then redis.replicate_commands() end
local TURN_MS, RESERVE_MS = 50, 500  -- a woken process's turn: see redis_lua
"""
HELPERS = """
local INDEXED = true
local function next_token(base, now, ttl)
  local fence = base .. ':fence'
  local token = math.max(tonumber(redis.call('GET', fence) or '0') + 1, now)
  redis.call('SET', fence, token, 'PX', ttl + 600000)
  return token
end
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
local function keep_until_last(base)  -- returns the last expiry, nil for an empty zset
  local last = redis.call('ZRANGE', base .. ':leases', -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', base .. ':leases', last[2])
    redis.call('PEXPIREAT', base .. ':owners', last[2])
  end
  return last[2]
end
local function index_of(base) return string.match(base, '^[^{]*') .. 'expiring' end
local function reindex(base)  -- the base's index member: its zset's soonest expiry, or none
  if not INDEXED then return end
  local first = redis.call('ZRANGE', base .. ':leases', 0, 0, 'WITHSCORES')
  if first[2] then
    redis.call('ZADD', index_of(base), first[2], base)
  else
    redis.call('ZREM', index_of(base), base)
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
-- The line of waiting processes (see "Waking one process" above the scripts).
local LINE_KEEP_MS = 3600000
local RING_TRIES = 64  -- processes that left are popped until one listens: ~2 µs each
local function subscribed(channel) return redis.call('PUBSUB', 'NUMSUB', channel)[2] > 0 end
local function enter(base, lid, now)  -- the process joins the name's line, or keeps its place
  redis.call('ZADD', base .. ':line', 'NX', now, lid)
  redis.call('PEXPIRE', base .. ':line', LINE_KEEP_MS)
end
local function join(base, lid, now, eager)  -- enter, if it waits (listens on its channel)
  if lid and lid ~= '' and (eager or subscribed(base .. ':lease:' .. lid)) then  -- or is
    enter(base, lid, now)  -- about to (eager: "+L", see ACQUIRE)
  end
end
local function turn_of(base, lid, now)  -- nil: free for the caller; else ms of another's turn
  local r = redis.call('GET', base .. ':rung')
  if not r then return nil end
  local sep = string.find(r, ':', 1, true)
  local rung = string.sub(r, 1, sep - 1)
  if rung == lid then  -- the woken process takes its turn, and its other waiters (if any:
    redis.call('DEL', base .. ':rung')  -- it still listens) join the end of the line
    join(base, lid, now)
    return nil
  end
  local age = now - tonumber(string.sub(r, sep + 1))
  if age < TURN_MS then return nil end  -- the running may take it again, for now
  if not subscribed(base .. ':lease:' .. rung) then  -- it stopped waiting: no turn to keep
    redis.call('DEL', base .. ':rung')
    return nil
  end
  return math.max(1, TURN_MS + RESERVE_MS - age)
end
local function turn_due(base, lid, now)  -- when the caller's turn comes due, if it is woken
  local r = lid and redis.call('GET', base .. ':rung')  -- and it is not due yet; else nil
  if not r or string.sub(r, 1, #lid + 1) ~= lid .. ':' then return nil end
  local due = tonumber(string.sub(r, #lid + 2)) + TURN_MS
  return due > now and due or nil
end
local function waiting(base)  -- store objects waiting for the name: those on its own channel
  local n = redis.call('PUBSUB', 'NUMSUB', base .. ':lease')[2]  -- (semaphores), and those
  local ids = redis.call('ZRANGE', base .. ':line', 0, 999)  -- in line or woken that listen
  local r = redis.call('GET', base .. ':rung')
  if r then ids[#ids + 1] = string.match(r, '^[^:]*') end
  local seen = {}
  for _, lid in ipairs(ids) do
    if not seen[lid] and subscribed(base .. ':lease:' .. lid) then n = n + 1 end
    seen[lid] = true
  end
  return n
end
local function ring(base)  -- the name was freed: wake the first waiting process, only it
  local rung, line = base .. ':rung', base .. ':line'
  if redis.call('EXISTS', rung, line) == 0 then return end
  local now = now_ms()
  for _ = 1, RING_TRIES do
    local r = redis.call('GET', rung)
    local lid
    if r then  -- woken already: again once its turn is due, not before
      local sep = string.find(r, ':', 1, true)
      if now - tonumber(string.sub(r, sep + 1)) < TURN_MS then return end
      lid = string.sub(r, 1, sep - 1)
    else
      lid = redis.call('ZPOPMIN', line)[1]
      if not lid then return end
      redis.call('SET', rung, lid .. ':' .. now, 'PX', TURN_MS + RESERVE_MS)
    end
    if redis.call('PUBLISH', base .. ':lease:' .. lid, '1') > 0 then return end
    redis.call('DEL', rung)  -- nobody listens there any more (it left, or died): the next
  end
end
-- a grant is the string "token:expires ms", or "token:expires ms:ms left" for the owner's own
-- live lease found again (as it is: not renewed); busy is a table (see ACQUIRE)
local function take(base, owner, info, now, ttl, limit, lid, eager)
  local holder, rec = mutex_holder(base)
  if holder == owner then
    local left = redis.call('PTTL', base .. ':lease')
    return token_of(rec) .. ':' .. (now + left) .. ':' .. left
  end
  if limit == 1 then
    if holder or live_members(base, now) > 0 then
      join(base, lid, now, eager)
      local out = busy(base, now)
      local due = turn_due(base, lid, now)
      if due and due < out[3] then out[5] = due end  -- try again then, not at the lease's end
      return out
    end
    local turn = turn_of(base, lid, now)
    if turn then  -- free, but a woken process's turn: busy for the others, without a holder
      join(base, lid, now, eager)
      return {1, '', now + turn, now, now + turn}
    end
    local token = next_token(base, now, ttl)
    redis.call('SET', base .. ':lease', owner .. ':' .. token .. ':' .. now .. ':' .. info,
               'PX', ttl)
    return token .. ':' .. (now + ttl)
  end
  local leases, owners = base .. ':leases', base .. ':owners'
  local gone = drop_expired(base, now)
  local expires = now + ttl
  local others = redis.call('ZCARD', leases)
  local mine = others > 0 and redis.call('HGET', owners, owner)  -- same members as the zset
  if mine then  -- live: drop_expired just removed the expired ones
    if gone > 0 then reindex(base) end
    local ends = tonumber(redis.call('ZSCORE', leases, owner))
    return token_of(mine) .. ':' .. ends .. ':' .. (ends - now)
  end
  if others + (holder and 1 or 0) >= limit then
    if gone > 0 then reindex(base) end
    return busy(base, now)
  end
  local token = next_token(base, now, ttl)
  redis.call('ZADD', leases, expires, owner)
  redis.call('HSET', owners, owner, token .. ':' .. now .. ':' .. info)
  if others == 0 then  -- the one member: the zset's last and soonest expiry, known already
    redis.call('PEXPIREAT', leases, expires)
    redis.call('PEXPIREAT', owners, expires)
    if INDEXED then redis.call('ZADD', index_of(base), expires, base) end
  else
    keep_until_last(base)
    reindex(base)
  end
  return token .. ':' .. expires
end
local function release_slot(base, owner)  -- the owner's semaphore slot, if any
  local expires = redis.call('ZSCORE', base .. ':leases', owner)
  if not expires then return 0 end
  redis.call('ZREM', base .. ':leases', owner)
  redis.call('HDEL', base .. ':owners', owner)
  if keep_until_last(base) then
    reindex(base)
  elseif INDEXED then  -- the last holder left: the zset is gone, and its index member
    redis.call('ZREM', index_of(base), base)
  end
  if tonumber(expires) <= now_ms() then return 0 end
  redis.call('PUBLISH', base .. ':lease', '1')
  ring(base)
  return 1
end
local function release(base, owner)
  if mutex_holder(base) == owner then
    redis.call('DEL', base .. ':lease')
    redis.call('PUBLISH', base .. ':lease', '1')
    ring(base)
    return 1
  end
  return release_slot(base, owner)
end
"""

LIBRARY = PROLOGUE + HELPERS
