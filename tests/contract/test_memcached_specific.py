"""What only the memcached store has to show: key layout, round trips, its failure modes.

The shared semantics are tested by the rest of tests/contract on every store. Tests that stop
a server start their own disposable ones, so the shared server stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable, Unsupported
from latchkey._types import Busy, Grant
from latchkey.stores import open_async_backend, open_backend
from latchkey.stores.io import memcached as memcached_io
from latchkey.stores.io import memcached_async
from latchkey.stores.io.memcached import Connection as _Connection
from latchkey.stores.memcached import (
    EPOCH,
    AsyncMemcachedBackend,
    Memcached,
    MemcachedBackend,
)
from latchkey.stores.memcached_wire import Clocks
from latchkey.stores.memcached_wire import ttl_arg as _ttl_arg
from tests.conftest import ServerPool
from tests.helpers import HOSTILE_NAMES, eventually
from tests.servers import RunningServer, ServerUnavailable
from tests.servers.memcached import start_memcached

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and "memcached" not in _selected:
    pytest.skip("the memcached row is not selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'
A, B = "a" * 32, "b" * 32


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"memcached: server required in CI but unavailable: {reason}")
    pytest.skip(f"memcached: not run: {reason}")


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def base(server_pool: ServerPool) -> str:
    try:
        return server_pool.base_url("memcached")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise


@pytest.fixture
def backend(base: str, prefix: str) -> Iterator[MemcachedBackend]:
    b = open_backend(f"{base}?prefix={prefix}")
    assert isinstance(b, MemcachedBackend)
    yield b
    b.close()


@pytest.fixture
def own_servers(tmp_path: Path) -> Iterator[list[RunningServer]]:
    """Two private servers that a test may stop and restart."""
    started: list[RunningServer] = []
    try:
        for i in range(2):
            started.append(start_memcached(tmp_path / f"mc{i}"))
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Backends and stores a test opens, closed even when the test fails."""
    opened: list[Any] = []
    yield opened
    for thing in opened:
        thing.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("?")[0])


def raw(port: int, command: bytes) -> bytes:
    """One command's reply (a line, and the value block of a ``VA``), over a plain socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(command)
        reply = b""
        while not reply.endswith(b"\r\n") or (reply.startswith(b"VA") and reply.count(b"\r\n") < 2):
            reply += s.recv(65536)
    return reply


def raw_get(port: int, key: bytes) -> bytes | None:
    """The value memcached holds at ``key``, read with a plain socket."""
    reply = raw(port, b"mg " + key + b" v\r\n")
    return None if reply.startswith(b"EN") else reply.split(b"\r\n")[1]


def raw_stats(port: int) -> dict[bytes, bytes]:
    """The server's ``stats``, read with a plain socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"stats\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            reply += s.recv(65536)
    return dict(line.split()[1:3] for line in reply.split(b"\r\n") if line.startswith(b"STAT"))


def raw_started(port: int) -> int:
    """The server's start (``stats`` time - uptime), in seconds since latchkey's EPOCH."""
    stats = raw_stats(port)
    return int(stats[b"time"]) - int(stats[b"uptime"]) - EPOCH


class Counting:
    """Counts round trips: each batch of commands written to a server starts one (a
    connection's ``trip``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trips = 0
        trip = _Connection.trip

        def counted(conn: _Connection, data: bytes, count: int, probe: bool) -> Any:
            self.trips += 1
            return trip(conn, data, count, probe)

        monkeypatch.setattr(_Connection, "trip", counted)


# -- URL and options ---------------------------------------------------------------------------


def test_url_with_several_servers_and_default_port() -> None:
    b = open_backend("memcached://10.0.0.1:11311,10.0.0.2,[::1]:5000?prefix=app:&timeout=2s")
    assert isinstance(b, MemcachedBackend)
    servers = [f"{host}:{port}" for host, port in b.store.servers]
    assert sorted(servers) == ["10.0.0.1:11311", "10.0.0.2:11211", "::1:5000"]
    assert b.store.prefix == b"app:" and b.timeout == 2.0


@pytest.mark.parametrize(
    "url",
    [
        "memcached://",
        "memcached://h:1?prefix=has space",
        "memcached://h:1?prefix=" + "p" * 101,
        "memcached://user:secret@h:1",
        "memcached://h:1/somepath",
        "memcached://h:1?table=x",
    ],
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        open_backend(url)
    assert "secret" not in str(caught.value)


def test_no_connection_is_made_before_first_use() -> None:
    b = open_backend("memcached://127.0.0.1:1?timeout=1s")  # nothing listens on port 1
    assert isinstance(b, MemcachedBackend)


def test_listing_is_unsupported_and_purge_has_nothing_to_do(backend: MemcachedBackend) -> None:
    assert backend.capabilities.listing is False
    with pytest.raises(Unsupported):
        list(backend.list())
    assert backend.purge_expired() == 0


# -- keys --------------------------------------------------------------------------------------


def test_plain_names_are_readable_keys(backend: MemcachedBackend, base: str, prefix: str) -> None:
    grant = backend.acquire("job:42", A, INFO, 30)
    assert isinstance(grant, Grant)
    value = raw_get(_port(base), f"{prefix}lock:job:42".encode())
    assert value is not None and b'"n":"job:42"' in value


def test_the_token_is_the_items_cas_above_the_servers_start(
    backend: MemcachedBackend, base: str, prefix: str
) -> None:
    """No counter item: the token is (server start since 2020) << 32 + the lease's CAS."""
    grant = backend.acquire("job", A, INFO, 30)
    assert isinstance(grant, Grant) and grant.token is not None
    reply = raw(_port(base), f"mg {prefix}lock:job c\r\n".encode())
    cas = int(reply.split()[1][1:])
    assert grant.token == (raw_started(_port(base)) << 32) + cas
    assert raw_get(_port(base), f"{prefix}fence:job".encode()) is None
    assert 0 < grant.token < 2**63


def test_tokens_increase_across_release_expiry_and_slots(backend: MemcachedBackend) -> None:
    tokens = []
    for _ in range(3):
        grant = backend.acquire("n", A, INFO, 30)
        assert isinstance(grant, Grant) and grant.token is not None
        tokens.append(grant.token)
        backend.release("n", A)
    for owner in (A, B):
        grant = backend.acquire("sem", owner, INFO, 30, limit=2)
        assert isinstance(grant, Grant) and grant.token is not None
        tokens.append(grant.token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_extend_keeps_the_token_that_inspect_shows(backend: MemcachedBackend) -> None:
    """Extend rewrites the item, so its CAS changes; the token moves into the value."""
    grant = backend.acquire("n", A, INFO, 30)
    assert isinstance(grant, Grant)
    for _ in range(2):
        extended = backend.extend("n", A, 60)
        assert extended is not None and extended.token == grant.token
        info = backend.inspect("n")
        assert info is not None and info.holders[0].token == grant.token
    backend.store._held.clear()  # the read path derives the same token
    extended = backend.extend("n", A, 60)
    assert extended is not None and extended.token == grant.token
    assert backend.release("n", A) is True


def test_a_server_without_cas_is_a_clear_error(tmp_path: Path, closing: list[Any]) -> None:
    """memcached -C gives every item CAS 0: no owner check and token 0. Refuse it."""
    try:
        server = start_memcached(tmp_path / "nocas", "-C")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
        raise
    try:
        b = open_backend(f"{server.url}?timeout=1s")
        closing.append(b)
        with pytest.raises(ConfigError, match="CAS disabled"):
            b.acquire("n", A, INFO, 30)
        with pytest.raises(ConfigError, match="-C"):
            b.inspect("n")
    finally:
        server.stop()


@pytest.mark.parametrize("name", [*HOSTILE_NAMES, "#looks-hashed", "with space", "x" * 230])
def test_other_names_are_hashed_and_still_inspectable(
    backend: MemcachedBackend, base: str, prefix: str, name: str
) -> None:
    assert isinstance(backend.acquire(name, A, INFO, 30), Grant)
    plain = name.isascii() and name.isprintable() and " " not in name and len(name) < 200
    part = (
        name
        if plain and not name.startswith("#")
        else "#" + hashlib.sha256(name.encode()).hexdigest()
    )
    assert raw_get(_port(base), f"{prefix}lock:{part}".encode()) is not None
    info = backend.inspect(name)
    assert info is not None and info.name == name and info.owner.pid == 1
    assert isinstance(backend.acquire(name, B, INFO, 30), Busy)
    assert backend.release(name, A) is True
    assert backend.inspect(name) is None


def test_a_hashed_name_never_collides_with_a_plain_one(backend: MemcachedBackend) -> None:
    hashed = "needs hashing"
    digest = "#" + hashlib.sha256(hashed.encode()).hexdigest()
    assert isinstance(backend.acquire(hashed, A, INFO, 30), Grant)
    assert isinstance(backend.acquire(digest, B, INFO, 30), Grant)  # "#…" names are hashed too


# -- owner checks: never get-then-delete -----------------------------------------------------


def test_a_non_owner_cannot_release_or_extend(backend: MemcachedBackend) -> None:
    backend.acquire("n", A, INFO, 30)
    assert backend.release("n", B) is False
    assert backend.extend("n", B, 60) is None
    info = backend.inspect("n")
    assert info is not None and info.holders[0].owner.pid == 1


def test_a_remembered_cas_never_releases_a_newer_holder(backend: MemcachedBackend) -> None:
    """One-trip release deletes only the item with the CAS our acquire got: after a takeover
    it refuses (EX), reads once, and leaves the new holder alone."""
    assert isinstance(backend.acquire("n", A, INFO, 30), Grant)
    assert backend.force_release("n")  # as if the lease had expired…
    assert isinstance(backend.acquire("n", B, INFO, 30), Grant)  # …and B took the name
    assert backend.release("n", A) is False
    assert backend.extend("n", A, 60) is None
    info = backend.inspect("n")
    assert info is not None and backend.release("n", B) is True


def test_release_racing_a_takeover_leaves_the_new_holder_alone(
    backend: MemcachedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sherlock bug: read "it is mine", the lease expires and B takes the name, then a
    plain delete removes B's lease. The CAS-checked delete must refuse instead. (The read
    path: a backend that does not remember the lease's CAS.)"""
    backend.acquire("n", A, INFO, 30)
    backend.store._held.clear()
    original = Memcached._mine

    def mine_then_takeover(self: Memcached, node: int, name: str, owner: str) -> Any:
        found = yield from original(self, node, name, owner)
        assert backend.force_release(name)  # as if the lease had expired… (another connection)
        assert isinstance(backend.acquire(name, B, INFO, 30), Grant)  # …and B took the name
        return found

    monkeypatch.setattr(Memcached, "_mine", mine_then_takeover)
    assert backend.release("n", A) is False
    monkeypatch.undo()
    info = backend.inspect("n")
    assert info is not None and backend.release("n", B) is True


def test_extend_racing_a_takeover_does_not_overwrite(
    backend: MemcachedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.acquire("n", A, INFO, 30)
    backend.store._held.clear()
    original = Memcached._mine

    def mine_then_takeover(self: Memcached, node: int, name: str, owner: str) -> Any:
        found = yield from original(self, node, name, owner)
        backend.force_release(name)
        backend.acquire(name, B, INFO, 30)
        return found

    monkeypatch.setattr(Memcached, "_mine", mine_then_takeover)
    assert backend.extend("n", A, 60) is None
    monkeypatch.undo()
    assert backend.release("n", B) is True


def test_a_lapsed_lease_is_not_ours_to_release(backend: MemcachedBackend) -> None:
    """Once memcached lets the item go (expired counts as absent, collected or not), the
    remembered CAS finds nothing: release is False and a new holder can take the name."""
    assert isinstance(backend.acquire("n", A, INFO, 0.2), Grant)  # T = 2 s: gone within 2 s
    eventually(lambda: backend.inspect("n") is None, timeout=5, what="lease lapsed")
    assert backend.release("n", A) is False
    assert backend.extend("n", A, 30) is None
    assert isinstance(backend.acquire("n", B, INFO, 30), Grant)


def test_a_forked_child_neither_shares_sockets_nor_remembered_leases(
    backend: MemcachedBackend,
) -> None:
    assert isinstance(backend.acquire("n", A, INFO, 30), Grant)
    (server,) = backend.io.servers
    (parent_conn,) = server.idle
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 1
        try:
            ok = backend.release("n", A) is True  # read first: the child remembers nothing
            (child_conn,) = server.idle
            ok = ok and child_conn is not parent_conn and not backend.store._held
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.idle == [parent_conn]
    assert backend.inspect("n") is None  # the child released it; our connection still works
    assert backend.release("n", A) is False


# -- TTLs ------------------------------------------------------------------------------------


def test_expiry_is_an_absolute_time_rounded_up_from_the_clocks_upper_bound() -> None:
    now = 1_700_000_000.3  # an upper bound of the server's clock
    assert [_ttl_arg(t, now) - 1_700_000_000 for t in (0.2, 0.7, 1.0, 59.9, 60)] == [
        1, 1, 2, 61, 61,
    ]  # fmt: skip
    assert _ttl_arg(40 * 86400, now) == 1_700_000_000 + 40 * 86400 + 1


def test_the_clock_bound_is_never_below_the_server_clock_and_never_moves_back() -> None:
    """``stats`` time trails the server's clock by up to 2 s; a read served as a stalled
    server thaws trails it by the stall, and within one server process it is not taken."""
    clocks = Clocks(1)
    clocks.read(0, 1000, before=50.0, after=50.2, same=False)
    assert clocks.upper[0] == 1000 + 2.0 - 50.0 and clocks.mid[0] == 1000 + 0.5 - 50.1
    clocks.read(0, 1003, before=60.0, after=60.1, same=True)  # 7 s behind: a stale read
    assert clocks.upper[0] == 1000 + 2.0 - 50.0
    clocks.read(0, 1003, before=60.0, after=60.1, same=False)  # a new server process
    assert clocks.upper[0] == 1003 + 2.0 - 60.0


def test_a_lease_never_ends_before_its_ttl(backend: MemcachedBackend) -> None:
    """memcached's clock ticks in whole seconds: a bare TTL of 1 s may last 0.01 s."""
    for phase in (0.0, 0.5):
        time.sleep(phase)
        name = f"short:{phase}"
        sent = time.monotonic()
        backend.acquire(name, A, INFO, 1.0)
        time.sleep(max(0.0, sent + 0.97 - time.monotonic()))
        assert backend.inspect(name) is not None
        assert backend.release(name, A) is True


def test_busy_reports_memcached_remaining_ttl(backend: MemcachedBackend) -> None:
    backend.acquire("n", A, INFO, 5)
    busy = backend.acquire("n", B, INFO, 5)
    assert isinstance(busy, Busy) and busy.holders == 1 and busy.holder is not None
    # The item lasts from the lease's end (5 s) to 2 s + 1 s of rounding past it.
    assert busy.retry_after is not None and 5 <= busy.retry_after <= 8


def test_store_clock_is_memcached_clock_within_a_second(
    backend: MemcachedBackend, base: str
) -> None:
    """The store clock is the server's ``stats`` time (whole seconds) plus half a second, read
    between two plain reads of that time. It is not compared with this machine's clock:
    memcached's clock ticks once a second on its monotonic clock from a start rounded down, so
    it may trail the wall clock by up to three seconds (and more after a clock step), which is
    memcached's own view of time and the one its expiry follows (CI failed on that once)."""
    port = _port(base)
    before = int(raw_stats(port)[b"time"])
    now = backend.now().timestamp()
    after = int(raw_stats(port)[b"time"])
    assert before <= now <= after + 1.0


# -- round trips -----------------------------------------------------------------------------


def test_round_trips_per_operation(
    backend: MemcachedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.inspect("warm-up")  # opens the connection and reads the clock once
    count = Counting(monkeypatch)

    def trips(call: Any) -> int:
        before = count.trips
        call()
        return count.trips - before

    assert trips(lambda: backend.acquire("n", A, INFO, 30)) == 1
    assert trips(lambda: backend.acquire("n", B, INFO, 30)) == 1  # busy, holder included
    assert trips(lambda: backend.extend("n", A, 30)) == 1
    assert trips(lambda: backend.inspect("n")) == 1
    assert trips(lambda: backend.release("n", A)) == 1
    assert trips(lambda: backend.release("n", A)) == 1  # not remembered: a read finds nothing
    assert trips(lambda: backend.force_release("n")) == 1
    names = [f"row:{i}" for i in range(200)]
    assert trips(lambda: backend.claim(names, A, INFO, 30)) == 1
    assert trips(lambda: backend.release_many(names, A)) == 1
    assert trips(lambda: backend.acquire("sem", A, INFO, 30, limit=5)) == 2
    assert trips(lambda: backend.release("sem", A)) == 1
    # A lease this backend did not take (another process's, same owner token): read first.
    backend.acquire("n", A, INFO, 30)
    backend.claim(names, A, INFO, 30)
    backend.store._held.clear()
    assert trips(lambda: backend.extend("n", A, 30)) == 2  # …and remembers the new CAS
    assert trips(lambda: backend.release("n", A)) == 1
    backend.acquire("n", A, INFO, 30)
    backend.store._held.clear()
    assert trips(lambda: backend.release("n", A)) == 2
    assert trips(lambda: backend.release_many(names, A)) == 2


def test_claim_skips_busy_names(backend: MemcachedBackend) -> None:
    backend.acquire("row:2", B, INFO, 30)
    grants = backend.claim(["row:1", "row:2", "row:3"], A, INFO, 30)
    assert sorted(grants) == ["row:1", "row:3"]
    assert backend.release_many(["row:1", "row:2", "row:3"], A) == 2
    assert backend.inspect("row:2") is not None


# -- reading replies: the hot path takes a reply as is only when it is exactly the one expected


class Trickle:
    """A socket whose ``recv`` returns at most ``size`` bytes: every reply split across reads."""

    def __init__(self, sock: socket.socket, size: int) -> None:
        self.sock, self.size = sock, size

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, size: int) -> bytes:
        return self.sock.recv(min(size, self.size))

    def close(self) -> None:
        self.sock.close()


def _pooled(backend: MemcachedBackend) -> _Connection:
    backend.inspect("warm-up")  # opens the connection
    (server,) = backend.io.servers
    (conn,) = server.idle
    return conn


@pytest.mark.parametrize("size", [1, 2, 5])
def test_replies_split_across_reads_are_parsed(backend: MemcachedBackend, size: int) -> None:
    """A reply in several TCP reads (one byte each, say) is never taken as a short reply."""
    conn = _pooled(backend)
    conn.sock = Trickle(conn.sock, size)  # type: ignore[assignment]
    grant = backend.acquire("n", A, INFO, 30)  # the add's "HD c<cas>" in pieces
    assert isinstance(grant, Grant) and grant.token is not None
    busy = backend.acquire("n", B, INFO, 30)  # the probe's value, then "NS", in pieces
    assert isinstance(busy, Busy) and busy.holder is not None and busy.holder.owner.pid == 1
    assert busy.holder.token == grant.token
    extended = backend.extend("n", A, 30)
    assert extended is not None and extended.token == grant.token
    assert backend.release("n", B) is False
    assert backend.release("n", A) is True  # "HD" in pieces
    assert backend.release("n", A) is False
    assert backend.inspect("n") is None
    assert (backend.io.servers[0].idle or [None])[0] is conn


def test_a_lease_longer_than_the_first_read_is_read_in_full(backend: MemcachedBackend) -> None:
    """The first recv of a reply asks for a few hundred bytes: a holder's lease with a large
    owner info (metadata) comes in several reads, on a real socket."""
    info = '{"host":"h","pid":1,"metadata":{"note":"%s"}}' % ("x" * 20_000)
    grant = backend.acquire("n", A, info, 30)
    assert isinstance(grant, Grant)
    busy = backend.acquire("n", B, INFO, 30)
    assert isinstance(busy, Busy) and busy.holder is not None
    assert busy.holder.owner.metadata == {"note": "x" * 20_000}
    assert busy.holder.token == grant.token
    assert backend.release("n", A) is True


class Chatty(Trickle):
    """A socket that receives ``extra`` after the next reply, as if the server had sent a
    reply nobody asked for."""

    def __init__(self, sock: socket.socket, extra: bytes) -> None:
        super().__init__(sock, 65536)
        self.extra = extra

    def recv(self, size: int) -> bytes:
        data, self.extra = self.sock.recv(size) + self.extra, b""
        return data


@pytest.mark.parametrize("extra", [b"HD\r\n", b"HD c1\r\n", b"EN\r\n", b"H"])
def test_a_reply_nobody_asked_for_is_never_taken_for_the_next_one(
    backend: MemcachedBackend, extra: bytes
) -> None:
    """Bytes after the expected reply are not this request's answer, nor the next's: the
    next request on that connection fails (StoreUnavailable, the connection dropped) instead
    of reading them as its own reply, and the one after works on a fresh connection."""
    conn = _pooled(backend)
    conn.sock = Chatty(conn.sock, extra)  # type: ignore[assignment]
    grant = backend.acquire("n", A, INFO, 30)
    assert isinstance(grant, Grant)
    with pytest.raises(StoreUnavailable, match="unread bytes"):
        backend.acquire("n", B, INFO, 30)  # never a Grant for "HD c1", never Busy for "NS"
    assert isinstance(backend.acquire("n", B, INFO, 30), Busy)  # a fresh connection: A holds it
    assert backend.release("n", A) is True


def test_an_unexpected_reply_to_the_hot_path_is_parsed_not_guessed(
    backend: MemcachedBackend,
) -> None:
    """The one-comparison fast paths take only "HD c<digits>" (add) and "HD" (delete): an
    error line the server sends instead is parsed, and raised as StoreUnavailable."""
    conn = _pooled(backend)

    class Refusing(Trickle):  # as if the server had refused the command
        def sendall(self, data: bytes) -> None:
            pass

        def recv(self, size: int) -> bytes:
            return b"SERVER_ERROR out of memory storing object\r\n"

    conn.sock = Refusing(conn.sock, 65536)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable, match="SERVER_ERROR"):
        backend.acquire("n", A, INFO, 30)
    assert isinstance(backend.acquire("n", A, INFO, 30), Grant)  # a fresh connection
    conn = _pooled(backend)
    conn.sock = Refusing(conn.sock, 65536)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable, match="SERVER_ERROR"):
        backend.release("n", A)


def test_a_connection_idle_for_a_moment_is_reused_without_a_poll(
    backend: MemcachedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection back in the pool for under a millisecond is not polled (no server
    restarts that fast); one idle for longer is, so a restarted server's is replaced."""
    conn = _pooled(backend)
    polls: list[_Connection] = []
    stale = _Connection.stale

    def counted(c: _Connection) -> bool:
        polls.append(c)
        return stale(c)

    monkeypatch.setattr(_Connection, "stale", counted)
    monkeypatch.setattr(memcached_io, "_FRESH", 10.0)  # a loaded machine may pause 1 ms
    conn.idle_since = time.monotonic()  # just checked in
    assert isinstance(backend.acquire("n", A, INFO, 30), Grant)
    assert polls == []
    conn.idle_since -= 20.0  # idle for longer than the window
    assert backend.release("n", A) is True
    assert polls == [conn]


# -- failures: unavailable is never busy -------------------------------------------------------


def _all_primitives_fail(b: MemcachedBackend, name: str) -> None:
    calls: list[Any] = [
        lambda: b.acquire(name, B, INFO, 30),
        lambda: b.acquire(name, B, INFO, 30, limit=3),
        lambda: b.release(name, A),
        lambda: b.extend(name, A, 30),
        lambda: b.inspect(name),
        lambda: b.force_release(name),
        lambda: b.claim([name, name + "2"], B, INFO, 30),
        lambda: b.release_many([name], A),
        lambda: b.record_get(name),
        lambda: b.record_set(name, "1", 0),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            call()
        assert time.monotonic() - started < 3


def test_stopped_server_is_unavailable_then_restart_works(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    server = own_servers[0]
    b = open_backend(f"{server.url}?timeout=1s")
    closing.append(b)
    assert isinstance(b, MemcachedBackend)
    first = b.acquire("job", A, INFO, 60)
    assert isinstance(first, Grant) and first.token is not None
    time.sleep(1.1)  # the token's high part is the server's start time, in whole seconds
    server.stop()
    _all_primitives_fail(b, "job")
    server.start()
    # The pooled connections died with the server: the next call uses a fresh one, no error.
    assert b.inspect("job") is None  # memcached keeps nothing across a restart (documented)
    again = b.acquire("job", B, INFO, 60)
    assert isinstance(again, Grant)
    assert isinstance(b.acquire("job", A, INFO, 60), Busy)  # no double grant
    # The CAS counter restarted at 1, but the server's start time is later.
    assert again.token is not None and again.token > first.token


def test_a_cas_remembered_before_a_restart_is_never_used_after_it(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    """A restarted server counts CAS values from 1 again: the same value can go to another
    holder's lease. The server's instance id (a random item written once per server life)
    changes, so the remembered CAS is dropped and release reads first."""
    server = own_servers[0]
    a = open_backend(f"{server.url}?timeout=1s")
    b = open_backend(f"{server.url}?timeout=1s")
    closing.extend([a, b])
    assert isinstance(a, MemcachedBackend) and isinstance(b, MemcachedBackend)
    assert isinstance(a.acquire("job", A, INFO, 60), Grant)
    remembered = a.store._held["job", A][1]  # (key, CAS, …)
    server.stop()
    server.start()
    assert isinstance(b.acquire("job", B, INFO, 60), Grant)  # the same writes, in order…
    reply = raw(server.port, b"mg latchkey:lock:job c\r\n")
    assert int(reply.split()[1][1:]) == remembered  # …so B's lease has A's old CAS
    assert a.release("job", A) is False
    assert a.extend("job", A, 60) is None
    info = b.inspect("job")
    assert info is not None and b.release("job", B) is True


def _connections(port: int) -> int:
    """The server's open client connections, as its ``stats`` counts them (this one too)."""
    return int(raw_stats(port)[b"curr_connections"])


def _all_threads_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is in the stopped state (kill() does not wait)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        return True  # no /proc: hope the stop is immediate
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    return all(state in ("T", "t") for state in states)


def test_a_hung_server_times_out_and_the_next_call_reconnects(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    """A stopped (SIGSTOP) server accepts connections and never answers: each call fails
    within ?timeout= (the kernel's SO_RCVTIMEO on the pooled socket, or on a new one)."""
    server = own_servers[0]
    b = open_backend(f"{server.url}?timeout=0.5s")
    closing.append(b)
    assert isinstance(b, MemcachedBackend)
    assert isinstance(b.acquire("n", A, INFO, 30), Grant)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        eventually(lambda: _all_threads_stopped(server.pid), what="memcached stopped")
        for call in (
            lambda: b.acquire("m", B, INFO, 30),  # on the pooled connection
            lambda: b.release("n", A),  # on a new connection: the handshake times out
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"within 0\.5s"):
                call()
            assert time.monotonic() - started < 1.5
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert b.release("n", A) is True


def test_idle_connection_to_a_restarted_server_is_replaced(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    server = own_servers[0]
    store = latchkey.connect(f"{server.url}?timeout=1s")
    closing.append(store)
    assert store.is_free("x")
    server.stop()
    server.start()
    assert store.is_free("x")  # not StoreUnavailable: the stale socket was noticed and dropped


def test_a_dead_server_never_moves_its_names_to_another(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    """pymemcache's HashClient would remap keys of a dead server, so a second holder could
    take a lock on the other server. Here a name lives on one server, dead or alive."""
    urls = ",".join(f"127.0.0.1:{s.port}" for s in own_servers)
    b = open_backend(f"memcached://{urls}?timeout=1s&prefix=m:")
    closing.append(b)
    assert isinstance(b, MemcachedBackend)
    names = [f"n{i}" for i in range(40)]
    grants = b.claim(names, A, INFO, 60)
    assert sorted(grants) == sorted(names)
    homes = {
        n: next(s for s in own_servers if raw_get(s.port, f"m:lock:{n}".encode())) for n in names
    }
    on_first = [n for n in names if homes[n] is own_servers[0]]
    on_second = [n for n in names if homes[n] is own_servers[1]]
    assert on_first and on_second  # spread over both, each lease on exactly one
    assert all(
        sum(raw_get(s.port, f"m:lock:{n}".encode()) is not None for s in own_servers) == 1
        for n in names
    )
    own_servers[0].stop()
    for name in on_first[:5]:
        with pytest.raises(StoreUnavailable):
            b.acquire(name, B, INFO, 60)
    assert isinstance(b.acquire(on_second[0], B, INFO, 60), Busy)  # the live server still works
    with pytest.raises(StoreUnavailable):
        b.claim(names, B, INFO, 60)
    own_servers[0].start()
    assert isinstance(b.acquire(on_first[0], B, INFO, 60), Grant)  # back, empty


def test_a_refused_write_is_unavailable_not_busy(backend: MemcachedBackend) -> None:
    """memcached refuses an item over its size limit (1 MB): an error, never a busy lock."""
    huge = '{"host":"h","pid":1,"metadata":{"x":"%s"}}' % ("x" * 1_100_000)
    with pytest.raises(StoreUnavailable, match="SERVER_ERROR"):
        backend.acquire("job", A, huge, 30)
    assert isinstance(backend.acquire("job", A, INFO, 30), Grant)  # the connection recovered


def test_lost_lease_after_restart_surfaces_as_lock_lost(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    server = own_servers[0]
    store = latchkey.connect(f"{server.url}?timeout=1s")
    closing.append(store)
    lock = store.lock("job", ttl="60s", renew=False)
    assert lock.acquire()
    server.stop()
    server.start()
    with pytest.raises(latchkey.LockLost):
        lock.extend()
    eventually(lambda: store.is_free("job"), what="empty restarted server")


# -- the asyncio backend (the contract suite runs its semantics; these, its own failure modes) --


def _async_backend(url: str) -> AsyncMemcachedBackend:
    b = open_async_backend(url)
    assert isinstance(b, AsyncMemcachedBackend)
    return b


def _async_pool(b: AsyncMemcachedBackend) -> Any:
    (server,) = b.io.servers
    return server


async def _until(probe: Any, what: str, timeout: float = 10.0) -> None:
    """Wait in the loop until ``probe()`` is true (a condition, not a guessed delay)."""
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(0.005)


async def _byte_by_byte_proxy(port: int, handlers: list[asyncio.Future[Any]]) -> asyncio.Server:
    """A proxy to memcached on ``port`` that hands its replies on one byte at a time (the
    loop runs between bytes), so that the backend reads every reply in pieces. Each client's
    piping is appended to ``handlers``: it ends when the client closes its connection."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 if one else 65536):
                writer.write(data)
                await writer.drain()
                if one:
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
        writer.close()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", port)
        both = asyncio.gather(pipe(client_r, server_w, False), pipe(server_r, client_w, True))
        handlers.append(both)
        await both

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def test_async_replies_split_across_reads_and_long_leases_are_parsed(
    base: str, prefix: str
) -> None:
    """The stream reader gathers a reply from as many reads as it comes in: a one-byte-at-a-
    time proxy, and a lease of 20 kB (many reads on a real socket)."""
    info = '{"host":"h","pid":1,"metadata":{"note":"%s"}}' % ("x" * 20_000)

    async def main() -> None:
        handlers: list[asyncio.Future[Any]] = []
        proxy = await _byte_by_byte_proxy(_port(base), handlers)
        proxy_port = proxy.sockets[0].getsockname()[1]
        b = _async_backend(f"memcached://127.0.0.1:{proxy_port}?prefix={prefix}")
        try:
            grant = await b.acquire("n", A, INFO, 30)  # the handshake and "HD c<cas>" in pieces
            assert isinstance(grant, Grant) and grant.token is not None
            busy = await b.acquire("n", B, INFO, 30)  # the probe's value, then "NS"
            assert isinstance(busy, Busy) and busy.holder is not None
            assert busy.holder.owner.pid == 1 and busy.holder.token == grant.token
            extended = await b.extend("n", A, 30)
            assert extended is not None and extended.token == grant.token
            assert await b.release("n", B) is False
            assert await b.release("n", A) is True
            assert await b.inspect("n") is None
            assert isinstance(await b.acquire("long", A, info, 30), Grant)
            busy = await b.acquire("long", B, INFO, 30)
            assert isinstance(busy, Busy) and busy.holder is not None
            assert busy.holder.owner.metadata == {"note": "x" * 20_000}
            assert await b.release("long", A) is True
            assert len(_async_pool(b).idle) == 1  # one connection did it all, never dropped
        finally:
            await b.aclose()
            proxy.close()
            await proxy.wait_closed()
            await asyncio.wait_for(asyncio.gather(*handlers), 5)

    asyncio.run(main())


def test_async_error_line_in_place_of_a_reply_is_unavailable(base: str, prefix: str) -> None:
    """memcached refuses an item over its size limit with SERVER_ERROR where the add's reply
    goes: StoreUnavailable (never Busy), that connection closed, the next call works."""
    huge = '{"host":"h","pid":1,"metadata":{"x":"%s"}}' % ("x" * 1_100_000)

    async def main() -> None:
        b = _async_backend(f"{base}?prefix={prefix}")
        try:
            await b.inspect("warm-up")
            (first,) = _async_pool(b).idle
            with pytest.raises(StoreUnavailable, match="SERVER_ERROR"):
                await b.acquire("job", A, huge, 30)
            assert first.is_closing() and first not in _async_pool(b).idle
            assert isinstance(await b.acquire("job", A, INFO, 30), Grant)
            assert await b.release("job", A) is True
        finally:
            await b.aclose()

    asyncio.run(main())


def test_async_cancelled_waiting_acquire_leaves_nothing_held(base: str, prefix: str) -> None:
    """A waiting acquire() polls (memcached has no push); cancelled between or during its
    attempts, it holds nothing afterwards and the store keeps working."""

    async def main() -> None:
        attempts = 0
        async with latchkey.connect_async(f"{base}?prefix={prefix}") as store:
            backend = store.backend
            original = backend.acquire

            async def counted(*args: Any, **kwargs: Any) -> Any:
                nonlocal attempts
                attempts += 1
                return await original(*args, **kwargs)

            backend.acquire = counted  # type: ignore[method-assign]
            # The holder through a store object of its own: a waiter of the holder's store
            # would be answered from its record of the lease, without asking memcached.
            holder_store = latchkey.connect_async(f"{base}?prefix={prefix}")
            holder = holder_store.lock("job", ttl="30s", renew=False)
            assert await holder.acquire()
            waiting = asyncio.ensure_future(store.lock("job", ttl="30s", wait=30).acquire())
            await _until(lambda: attempts >= 3, "three attempts of the waiter")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            info = await store.inspect("job")
            assert info is not None and len(info.holders) == 1
            assert info.holders[0].token == holder.token  # only the first holder
            await holder.release()
            await holder_store.aclose()
            assert await store.is_free("job")
            async with store.lock("job", ttl="30s", wait=5):
                assert not await store.is_free("job")
            assert await store.is_free("job")

    asyncio.run(main())


def test_async_request_cancelled_mid_reply_is_never_pooled(
    own_servers: list[RunningServer],
) -> None:
    """Cancelled while waiting for the server's answer, the connection is closed (its reply
    would be taken for the next request's); the lease the server did store is released by
    reading it (nothing was remembered)."""
    server = own_servers[0]

    async def main() -> None:
        b = _async_backend(f"{server.url}?timeout=5s")
        try:
            await b.inspect("warm-up")
            pool = _async_pool(b)
            (conn,) = pool.idle
            base = _connections(server.port) - 1  # without the pooled one, which goes
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await asyncio.to_thread(
                    eventually, lambda: _all_threads_stopped(server.pid), what="stopped"
                )
                task = asyncio.ensure_future(b.acquire("n", A, INFO, 30))
                await _until(lambda: not pool.idle, "the request under way")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert conn.is_closing() and pool.idle == []
            assert not b.store._held  # the grant never reached us: nothing remembered…
            # The thawed server reads what the closed connection had sent (the add, if it
            # went out) before it sees the close: once that connection is gone from its
            # stats, the add's fate is settled and the next look sees it.
            gone = "the old connection gone"
            await asyncio.to_thread(
                eventually, lambda: _connections(server.port) <= base, what=gone
            )
            info = await b.inspect("n")  # …but the server stored it if the add was sent
            if info is not None:  # (the usual case; under load the cancel can come first)
                assert await b.release("n", A) is True  # by reading: owner-checked, by CAS
            assert await b.inspect("n") is None
        finally:
            await b.aclose()

    asyncio.run(main())


async def _all_async_primitives_fail(b: AsyncMemcachedBackend, name: str, limit: float) -> None:
    calls: list[Any] = [
        lambda: b.acquire(name, B, INFO, 30),
        lambda: b.acquire(name, B, INFO, 30, limit=3),
        lambda: b.release(name, A),
        lambda: b.extend(name, A, 30),
        lambda: b.inspect(name),
        lambda: b.force_release(name),
        lambda: b.claim([name, name + "2"], B, INFO, 30),
        lambda: b.release_many([name], A),
        lambda: b.record_get(name),
        lambda: b.record_set(name, "1", 0),
        lambda: b.now(),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await call()
        assert time.monotonic() - started < limit


def test_async_stopped_server_is_unavailable_then_restart_works(
    own_servers: list[RunningServer],
) -> None:
    server = own_servers[0]

    async def main() -> None:
        b = _async_backend(f"{server.url}?timeout=1s")
        try:
            first = await b.acquire("job", A, INFO, 60)
            assert isinstance(first, Grant) and first.token is not None
            await asyncio.sleep(1.1)  # the token's high part: the server's start, whole seconds
            server.stop()
            await _all_async_primitives_fail(b, "job", limit=2)
            server.start()
            assert await b.inspect("job") is None  # a fresh connection, an empty server
            again = await b.acquire("job", B, INFO, 60)
            assert isinstance(again, Grant) and again.token is not None
            assert again.token > first.token
            assert isinstance(await b.acquire("job", A, INFO, 60), Busy)
        finally:
            await b.aclose()

    asyncio.run(main())


def test_async_hung_server_times_out_and_the_next_call_reconnects(
    own_servers: list[RunningServer],
) -> None:
    """A stopped (SIGSTOP) server accepts connections and never answers: each primitive
    fails within ?timeout=, on the pooled connection or on a new one; after SIGCONT the
    next call works on a fresh connection."""
    server = own_servers[0]

    async def main() -> None:
        b = _async_backend(f"{server.url}?timeout=0.5s")
        try:
            assert isinstance(await b.acquire("n", A, INFO, 30), Grant)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                await asyncio.to_thread(
                    eventually, lambda: _all_threads_stopped(server.pid), what="stopped"
                )
                for call in (
                    lambda: b.acquire("m", B, INFO, 30),  # on the pooled connection
                    lambda: b.release("n", A),  # on a new connection: the handshake hangs
                ):
                    started = time.monotonic()
                    with pytest.raises(StoreUnavailable, match=r"within 0\.5s"):
                        await call()
                    assert time.monotonic() - started < 1.5
                assert _async_pool(b).idle == []
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert await b.release("n", A) is True
        finally:
            await b.aclose()

    asyncio.run(main())


def test_async_idle_connection_to_a_restarted_server_is_replaced(
    own_servers: list[RunningServer],
) -> None:
    server = own_servers[0]

    async def main() -> None:
        b = _async_backend(f"{server.url}?timeout=1s")
        try:
            assert await b.inspect("x") is None
            server.stop()  # blocks the loop: it has not seen the end of the stream
            server.start()
            assert await b.inspect("x") is None  # not StoreUnavailable: the socket was polled
        finally:
            await b.aclose()

    asyncio.run(main())


def test_async_many_concurrent_calls_share_a_bounded_pool(base: str, prefix: str) -> None:
    async def main() -> None:
        b = _async_backend(f"{base}?prefix={prefix}")
        try:
            results = await asyncio.gather(*(b.inspect(f"n{i}") for i in range(500)))
            assert results == [None] * 500
            pool = _async_pool(b)
            assert 1 <= len(pool.idle) <= memcached_async.POOL_MAX
            pooled = list(pool.idle)
        finally:
            await b.aclose()
        assert pool.idle == [] and all(c.is_closing() for c in pooled)

    asyncio.run(main())


@pytest.mark.parametrize("extra", [b"HD\r\n", b"HD c1\r\n", b"EN\r\n", b"NS\r\n", b"H"])
def test_async_bytes_nobody_asked_for_are_never_taken_for_a_reply(
    base: str, prefix: str, extra: bytes
) -> None:
    """Bytes the server sends unasked land in the connection's buffer (data_received): that
    connection is never used again (its next reply would be misread), and the next call
    gets its own answer on a fresh one: B is Busy, never granted by an "HD c1"."""

    async def main() -> None:
        b = _async_backend(f"{base}?prefix={prefix}")
        try:
            assert isinstance(await b.acquire("n", A, INFO, 30), Grant)
            (conn,) = _async_pool(b).idle
            conn.data_received(extra)  # as the loop does when the server speaks
            busy = await b.acquire("n", B, INFO, 30)
            assert isinstance(busy, Busy) and busy.holder is not None
            assert conn.is_closing() and conn not in _async_pool(b).idle
            assert await b.release("n", A) is True
        finally:
            await b.aclose()

    asyncio.run(main())


def test_async_same_owner_gets_its_lease_back_with_one_round_trip_each(
    base: str, prefix: str
) -> None:
    """The same-owner rule costs nothing on the uncontended path: one request per acquire,
    and the second acquire of the owner is answered from the probe of that same request."""

    async def main() -> None:
        b = _async_backend(f"{base}?prefix={prefix}")
        try:
            await b.inspect("warm-up")
            (conn,) = _async_pool(b).idle
            sent: list[bytes] = []
            send = conn.send

            def counted(data: bytes) -> None:
                sent.append(data)
                send(data)

            conn.send = counted  # type: ignore[method-assign]
            first = await b.acquire("n", A, INFO, 30)
            again = await b.acquire("n", A, INFO, 60)
            assert isinstance(first, Grant) and isinstance(again, Grant)
            assert again.token == first.token and again.expires_at == first.expires_at
            assert again.remaining is not None and 0 < again.remaining <= 30
            assert len(sent) == 2  # one request each
            assert await b.release("n", A) is True
            assert await b.inspect("n") is None
        finally:
            await b.aclose()

    asyncio.run(main())


def test_a_lease_granted_as_a_frozen_server_thaws_lasts_its_ttl(
    own_servers: list[RunningServer], closing: list[Any]
) -> None:
    """memcached's clock is a whole-second counter that its main thread advances once a
    second; a request its worker threads serve before that thread's next tick reads the old
    value. After a stall (SIGSTOP, a VM pause), the requests queued during it are served first:
    an item stored then with a relative TTL of T seconds expires at the first tick, since its
    expiry was counted from the clock as it stood when the stall began (seen: a TTL of 2 s
    gone within 20 ms, six times in six). A lease sent 3 s into a stall must still last its
    TTL from when it was sent, so the store gives memcached absolute expiry times, counted on
    its own estimate of the server's clock (which a stalled server does not hold back)."""
    server = own_servers[0]
    holder = open_backend(f"{server.url}?timeout=20s")
    other = open_backend(f"{server.url}?timeout=20s")
    closing.extend([holder, other])
    for b in (holder, other):  # connected and greeted before the stall
        assert isinstance(b.acquire(f"warm-{uuid.uuid4().hex}", A, INFO, 60), Grant)
    result: list[Any] = []
    with server.frozen():
        time.sleep(3.0)  # the stall: memcached's clock stands still from here
        sent = time.monotonic()
        thread = threading.Thread(target=lambda: result.append(holder.acquire("job", A, INFO, 5)))
        thread.start()
        time.sleep(0.3)  # the request is written to the frozen server's socket
    thread.join(timeout=20)
    assert result and isinstance(result[0], Grant), result
    # The holder's own deadline is the send time + 5 s; until shortly before it nobody else
    # may get the name (before the fix: taken ~2.5 s after the thaw).
    while time.monotonic() < sent + 4.5:
        assert isinstance(other.acquire("job", B, INFO, 5), Busy), (
            f"the name was free {time.monotonic() - sent:.2f}s after a 5 s lease was sent"
        )
        time.sleep(0.1)
