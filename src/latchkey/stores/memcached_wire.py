"""memcached's wire format as the ``memcached://`` store uses it: the meta commands, the lease
item (JSON) and how a reply is read back into a lease. Data and parsing only; the store's
rules are in :mod:`latchkey.stores.memcached`, the framing and connections in
:mod:`latchkey.stores.io.memcached`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime, timezone
from json.encoder import encode_basestring_ascii as _quote  # a str as a JSON literal (C)
from time import monotonic as _monotonic
from typing import Any, NamedTuple

from latchkey._owner import Owner
from latchkey._types import Holder
from latchkey.stores.io.memcached import ProtocolError, Reply, flag

MONTH = 30 * 24 * 3600  # memcached reads larger TTLs as absolute Unix times
DEFAULT_PORT, MAX_KEY = 11211, 250  # memcached's port, and its key length limit (bytes)
KIND_ROOM = 24  # bytes kept free in a key for the kind ("slot12345:")
_PLAIN = re.compile(r"[!-~]+")  # printable ASCII without space: usable in a key as is
#: A server process's session: S (its start, seconds since 2020) and its instance id.
Session = tuple[int, "bytes | None"]
#: What the store remembers of a lease it took or extended, to release or extend it in one
#: trip: (key, CAS, the session of the server process whose counter gave the CAS, token,
#: owner info, acquired ms). A plain tuple: a NamedTuple costs 20 times more.
Held = tuple[bytes, int, Session, int, str, int]
_fromtimestamp, _UTC = datetime.fromtimestamp, timezone.utc  # the hot path's, looked up once

# Commands (%b: a key, prefixed, plain ASCII, ≤ 250 bytes). Read: value, TTL left (whole s)
# and CAS: ``VA <len> t<ttl> c<cas>`` + value, or ``EN`` when absent or expired.
READ = b"mg %b v t c\r\n"
# Take a slot only if absent (ME: add; an expired item counts as absent), TTL T, return the
# new CAS: ``HD c<cas>`` stored, ``NS`` taken. The mutual exclusion: memcached adds atomically.
ADD = b"ms %b %d T%d ME c\r\n%b\r\n"
# A quiet read (a miss sends nothing) then the add of the same key: an acquire, one trip.
PROBE_ADD = b"mg %b v t c q\r\n" + ADD
# Rewrite only if the CAS is the one we know: ``HD c<new cas>``; ``EX`` changed, ``NF`` gone.
REPLACE_IF = b"ms %b %d T%d C%d c\r\n%b\r\n"
# Delete only if the CAS is the one we know: the owner-checked release (never get-then-delete,
# which can delete a newer holder's lease). ``HD``; ``EX`` changed since, ``NF`` gone.
DELETE_IF = b"md %b C%d\r\n"
DELETE = b"md %b\r\n"  # force_release only: ``HD`` deleted a live item, ``NF`` absent
SET_FOREVER = b"ms %b %d T0 c\r\n%b\r\n"  # a semaphore's slot count, no TTL: ``HD c<cas>``
# A lease (JSON): name, owner token, owner info (JSON text as a string), then S (a new lease:
# its token derives from its CAS) or the token (a rewritten lease), acquired and expires (ms).
NEW_LEASE = b'{"n":%b,"o":%b,"i":%b,"s":%d,"a":%d,"e":%d}'
REWRITTEN_LEASE = b'{"n":%b,"o":%b,"i":%b,"t":%d,"a":%d,"e":%d}'
STATS = b"stats\r\n"  # ``STAT time <unix s>``, ``STAT uptime <s>``, …, ``END``


class Lease(NamedTuple):
    """A lease item as read back."""

    key: bytes
    owner: str
    token: int
    acquired: float
    expires: float
    data: dict[str, Any]
    ttl_left: int  # memcached's remaining TTL, whole seconds
    cas: int

    def holder(self) -> Holder:
        info = Owner.from_json(self.data.get("i"))
        return Holder(self.token, info, dt(self.acquired), dt(self.expires))


def new_cas(reply: Reply) -> int:
    """The CAS unique of the item a successful ``ms … c`` just wrote (never 0 with CAS on)."""
    if (cas := flag(reply[0], b"c")) <= 0:
        raise ProtocolError("memcached returned no CAS value (is it running with -C?)")
    return cas


def read_lease(key: bytes, reply: Reply | None) -> Lease | None:
    """The lease in a slot, from its read (None: absent or expired)."""
    if reply is None or reply[0][:2] == b"EN":
        return None
    line, value = reply
    try:
        data = json.loads(value if line[:2] == b"VA" and value is not None else b"")
        cas, acquired, expires = flag(line, b"c"), data["a"] / 1000, data["e"] / 1000
        token = int(data["t"]) if "t" in data else (int(data["s"]) << 32) + cas
        return Lease(key, str(data["o"]), token, acquired, expires, data, flag(line, b"t"), cas)
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"unreadable lease at {key!r}: {line!r} {exc}") from None


def json_text(text: str) -> bytes:
    return _quote(text).encode("ascii")  # ``text`` as a JSON string literal (ASCII)


def dt(seconds: float) -> datetime:
    return _fromtimestamp(seconds, _UTC)


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def ttl_arg(ttl: float, server_at_most: float) -> int:
    """memcached's expiry for a lease of ``ttl`` s: an absolute Unix time, ``ttl`` past
    ``server_at_most`` (an upper bound of the server's clock now), so it never ends early.

    Never a relative TTL: memcached adds one to its clock as its last once-a-second tick left
    it, which after a stall of the server (SIGSTOP, a VM pause) is behind by the stall, so an
    item stored as the server thaws would expire at its next tick (docs/stores/memcached.md).
    Its ``stats`` time is that clock too, whole seconds, up to 2 s behind the time it reads
    (the tick's rounding down and its age): :class:`Clocks` keeps an upper bound."""
    return math.ceil(server_at_most + ttl)


class Clocks:
    """Each server's clock as this store knows it, from ``stats`` times (whole seconds, read
    between the local monotonic ``before`` and ``after``): minus the local monotonic clock,
    as an estimate (± 0.5 s: displayed times) and as an upper bound (``stats`` lags the time
    it reads by up to 2 s, never leads: expiry times, :func:`ttl_arg`)."""

    def __init__(self, servers: int) -> None:
        self.mid, self.upper = [0.0] * servers, [0.0] * servers

    def read(self, node: int, time: int, before: float, after: float, same: bool) -> None:
        """``same``: the server process read before. A read served as a stalled server thaws
        sees its clock as the stall left it (behind): within one server process the bounds
        only move forward, the side on which expiry times err long, never short."""
        mid, upper = time + 0.5 - (before + after) / 2, time + 2.0 - before
        self.mid[node] = max(mid, self.mid[node]) if same else mid
        self.upper[node] = max(upper, self.upper[node]) if same else upper

    def now(self, node: int) -> float:
        return self.mid[node] + _monotonic()

    def at_most(self, node: int) -> float:
        return self.upper[node] + _monotonic()


def encode_name(name: str, room: int) -> bytes:
    """The name's part of its keys: itself when plain and short, else ``#`` + SHA-256 hex."""
    raw = name.encode("utf-8")
    if _PLAIN.fullmatch(name) and name[0] != "#" and len(raw) <= room:
        return raw
    return b"#" + hashlib.sha256(raw).hexdigest().encode("ascii")
