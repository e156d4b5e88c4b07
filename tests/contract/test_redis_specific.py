"""What only the Redis store has to show: its key layout, its scripts, its failure modes.

The shared semantics are tested by the rest of tests/contract on every store. Tests that stop
or misconfigure a server start their own disposable one, so the shared server stays up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

import latchkey
from latchkey import ConfigError, LockLost, StoreUnavailable
from latchkey._types import Busy, Grant
from latchkey.stores import AsyncWaiter, open_async_backend, open_backend
from latchkey.stores.io.redis import CHECK_AFTER
from latchkey.stores.redis import AsyncRedisBackend, RedisBackend
from tests.conftest import ServerPool
from tests.helpers import HOSTILE_NAMES, eventually
from tests.servers import RunningServer, ServerUnavailable
from tests.servers.redis import CLIENT_KEY_PASSWORD, start_redis, start_redis_tls

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and "redis" not in _selected:
    pytest.skip("the redis row is not selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"redis: server required in CI but unavailable: {reason}")
    pytest.skip(f"redis: not run: {reason}")


@pytest.fixture
def redis_url(server_pool: ServerPool) -> str:
    """The shared server's URL with a key prefix of this test's own."""
    try:
        base = server_pool.base_url("redis")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    return f"{base}?prefix=t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = open_backend(redis_url)
    assert isinstance(b, RedisBackend)
    yield b
    b.close()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RunningServer]:
    """A private server that a test may stop, restart or protect with a password."""
    try:
        server = start_redis(tmp_path / "redis")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    yield server
    server.stop()


def _server_ms(backend: RedisBackend) -> int:
    seconds, micros = backend.io.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _commands(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


# -- key layout ------------------------------------------------------------------------------


def test_keys_of_one_name_share_a_cluster_slot(backend: RedisBackend) -> None:
    for name in ["plain", "{tag}", "a}b{c", "nul\x00inside", "é" * 127]:
        keys = [backend.store.base(name), *backend.store.keys(name), backend.store.record_key(name)]
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        assert all(k.startswith(backend.store.prefix) for k in keys)


@pytest.mark.parametrize("hostile", [*HOSTILE_NAMES, "{", "}", "}{", "\x00", "\x00" * 255])
def test_hostile_names_round_trip(backend: RedisBackend, hostile: str) -> None:
    grant = backend.acquire(hostile, "a" * 32, INFO, 30)
    assert isinstance(grant, Grant)
    info = backend.inspect(hostile)
    assert info is not None and info.name == hostile and info.token == grant.token
    assert [i.name for i in backend.list(prefix=hostile)] == [hostile]
    for key in backend.io.client.scan_iter(match=f"{backend.store.prefix}*"):
        assert key.isascii() and key.count("{") == 1 and key.count("}") == 1
    assert backend.release(hostile, "a" * 32) is True
    assert backend.inspect(hostile) is None


def test_list_prefix_is_a_byte_prefix_of_the_name(backend: RedisBackend) -> None:
    for n in ["job:1", "job:10", "job:2", "jobs", "other"]:
        backend.acquire(n, uuid.uuid4().hex, INFO, 30)
    assert [i.name for i in backend.list(prefix="job:")] == ["job:1", "job:10", "job:2"]
    assert [i.name for i in backend.list(prefix="job:1")] == ["job:1", "job:10"]
    assert len(list(backend.list())) == 5


@pytest.mark.parametrize(
    "query",
    ["prefix=bad{x", "prefix=with%20space", "prefix=" + "p" * 101, "nosuch=1", "timeout=soon"],
)
def test_bad_options_are_config_errors(query: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(f"redis://127.0.0.1:1/0?{query}")


def test_bad_db_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="db number"):
        open_backend("redis://127.0.0.1:1/zero")


def test_rediss_url_configures_tls_without_connecting() -> None:
    backend = open_backend("rediss://:pw-Zq8@127.0.0.1:1/2?ssl_cert_reqs=none&timeout=1")
    assert isinstance(backend, RedisBackend)
    pool = backend.io.client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    assert pool.connection_kwargs["db"] == 2
    assert "pw-Zq8" not in repr(backend)
    with pytest.raises(StoreUnavailable) as caught:
        backend.now()
    assert "pw-Zq8" not in str(caught.value)


def test_prefix_separates_stores(redis_url: str) -> None:
    base = redis_url.split("?")[0]
    one, two = open_backend(f"{base}?prefix=one:"), open_backend(f"{base}?prefix=two:")
    name = uuid.uuid4().hex
    try:
        assert isinstance(one.acquire(name, "a" * 32, INFO, 30), Grant)
        assert isinstance(two.acquire(name, "b" * 32, INFO, 30), Grant)
        assert one.release(name, "a" * 32) and two.release(name, "b" * 32)
    finally:
        one.close()
        two.close()


# -- scripts ---------------------------------------------------------------------------------


def test_scripts_never_touch_another_owners_lease(backend: RedisBackend) -> None:
    lease_key = backend.store.keys("n")[0]
    grant = backend.acquire("n", "a" * 32, INFO, 30)
    assert isinstance(grant, Grant)
    value = backend.io.client.get(lease_key)
    assert value is not None and value.startswith("a" * 32 + ":")
    assert backend.release("n", "b" * 32) is False
    assert backend.extend("n", "b" * 32, 600) is None
    assert backend.release_many(["n"], "b" * 32) == 0
    busy = backend.acquire("n", "b" * 32, INFO, 30)
    assert isinstance(busy, Busy) and busy.holders == 1
    assert busy.holder is not None and busy.holder.token == grant.token
    assert busy.retry_after is not None and 29 < busy.retry_after <= 30
    assert backend.io.client.get(lease_key) == value  # untouched
    assert 29_000 < backend.io.client.pttl(lease_key) <= 30_000
    assert backend.release("n", "a" * 32) is True


def test_semaphore_slots_are_per_owner(backend: RedisBackend) -> None:
    owners = [uuid.uuid4().hex for _ in range(4)]
    grants = [backend.acquire("sem", o, INFO, 30, limit=3) for o in owners]
    assert [isinstance(g, Grant) for g in grants] == [True, True, True, False]
    busy = grants[3]
    assert isinstance(busy, Busy) and busy.holders == 3
    assert backend.release("sem", owners[3]) is False
    assert backend.extend("sem", owners[3], 60) is None
    info = backend.inspect("sem")
    assert info is not None
    assert [h.token for h in info.holders] == [g.token for g in grants[:3] if isinstance(g, Grant)]
    assert backend.release("sem", owners[1]) is True
    assert isinstance(backend.acquire("sem", owners[3], INFO, 30, limit=3), Grant)


@pytest.mark.parametrize("limit", [1, 3])
def test_leases_expire_by_the_servers_clock_and_the_fence_outlives_them(
    backend: RedisBackend, limit: int
) -> None:
    lease, leases, owners, fence = backend.store.keys("n")
    first = backend.acquire("n", "a" * 32, INFO, 0.3, limit=limit)
    assert isinstance(first, Grant) and first.token is not None
    keys = [lease] if limit == 1 else [leases, owners]
    assert all(0 < backend.io.client.pttl(k) <= 300 for k in keys)
    # The counter outlives the lease by ten minutes, then goes: a name used once leaves no key
    # behind for ever (a new counter starts from the server's clock, above every old token).
    assert 600_000 < backend.io.client.pttl(fence) <= 600_300
    eventually(lambda: backend.io.client.exists(lease, leases, owners) == 0, what="keys expired")
    assert backend.purge_expired() == 0  # nothing left behind to purge
    grant = backend.acquire("n", "b" * 32, INFO, 30, limit=limit)
    assert isinstance(grant, Grant) and grant.token is not None and grant.token > first.token
    assert backend.release("n", "b" * 32) is True
    # As if it had expired, or a restart had lost it — which takes longer than a millisecond:
    # the server's clock (ms) has passed the last token when the counter starts again from it.
    eventually(lambda: _server_ms(backend) > grant.token, what="the clock past the last token")
    backend.io.client.delete(fence)
    again = backend.acquire("n", "c" * 32, INFO, 30, limit=limit)
    assert isinstance(again, Grant) and again.token is not None and again.token > grant.token


def test_tokens_keep_increasing_across_a_restart_without_persistence(
    own_server: RunningServer,
) -> None:
    store = latchkey.connect(own_server.url)
    try:
        tokens = []
        for _ in range(3):
            with store.lock("fenced", ttl="1m") as lock:
                tokens.append(lock.token)
        own_server.stop()
        own_server.start()  # no persistence: every lease and counter is gone
        with store.lock("fenced", ttl="1m") as lock:
            tokens.append(lock.token)
        with store.semaphore("fenced-pool", 3, ttl="1m") as slot:
            assert slot.token is not None and slot.token > tokens[0]
    finally:
        store.close()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_mutex_and_semaphore_holders_of_one_name_count_together(backend: RedisBackend) -> None:
    first = backend.acquire("n", "a" * 32, INFO, 30, limit=1)
    second = backend.acquire("n", "b" * 32, INFO, 20, limit=2)
    assert isinstance(first, Grant) and isinstance(second, Grant)
    busy = backend.acquire("n", "c" * 32, INFO, 30, limit=2)
    assert isinstance(busy, Busy) and busy.holders == 2
    assert busy.retry_after is not None and 19 < busy.retry_after <= 20  # the soonest to end
    assert isinstance(backend.acquire("n", "d" * 32, INFO, 30, limit=1), Busy)
    info = backend.inspect("n")
    assert info is not None and [h.token for h in info.holders] == [first.token, second.token]
    assert first.token is not None and second.token is not None and second.token > first.token
    assert backend.release("n", "a" * 32) and backend.release("n", "b" * 32)
    assert backend.inspect("n") is None
    assert isinstance(backend.acquire("n", "d" * 32, INFO, 30, limit=1), Grant)


def test_purge_counts_expired_semaphore_entries(backend: RedisBackend) -> None:
    backend.acquire("sem", "a" * 32, INFO, 0.2, limit=2)
    backend.acquire("sem", "b" * 32, INFO, 60, limit=2)
    eventually(lambda: len(backend.inspect("sem").holders) == 1, what="one expired")  # type: ignore[union-attr]
    assert backend.purge_expired() == 1
    assert backend.io.client.zcard(backend.store.keys("sem")[1]) == 1


def test_acquire_and_release_are_one_evalsha_each(backend: RedisBackend) -> None:
    backend.acquire("warm", "w" * 32, INFO, 30)  # loads the script after NOSCRIPT if needed
    backend.release("warm", "w" * 32)
    before = _commands(backend.io.client)
    backend.acquire("n", "a" * 32, INFO, 30)
    backend.release("n", "a" * 32)
    after = _commands(backend.io.client)
    spent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # commandstats also counts the commands the scripts ran; of the client's own commands
    # only the two EVALSHA (and our INFO) may appear: no EVAL, SCRIPT LOAD, PING or TIME.
    assert spent["evalsha"] == 2, spent
    assert not {"eval", "script|load", "script", "ping", "hello", "auth"} & spent.keys()


def test_a_free_mutex_costs_a_hand_written_locks_commands_plus_time_and_fence(
    backend: RedisBackend,
) -> None:
    """The mutex fast paths: acquire is EXISTS (both shapes at once), TIME, the fence's GET
    and SET, the lease's SET;
    release is GET, DEL, PUBLISH, and one EXISTS to see that no process waits in line.
    Nothing of the semaphore path runs."""
    backend.acquire("warm", "w" * 32, INFO, 30)
    backend.release("warm", "w" * 32)

    def spent(call: Callable[[], object]) -> dict[str, int]:
        before = _commands(backend.io.client)
        call()
        after = _commands(backend.io.client)
        out = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        out.pop("info", None)
        return out

    acquire = spent(lambda: backend.acquire("n", "a" * 32, INFO, 30))
    assert acquire == {"evalsha": 1, "exists": 1, "time": 1, "get": 1, "set": 2}
    release = spent(lambda: backend.release("n", "a" * 32))
    assert release == {"evalsha": 1, "get": 1, "del": 1, "publish": 1, "exists": 1}


@pytest.mark.parametrize("first_limit", [2, 3])
def test_a_live_semaphore_holder_keeps_a_mutex_out(backend: RedisBackend, first_limit: int) -> None:
    """The mutex fast path must see the other shape: no over-grant when a semaphore holds."""
    sem = backend.acquire("n", "a" * 32, INFO, 30, limit=first_limit)
    assert isinstance(sem, Grant)
    busy = backend.acquire("n", "b" * 32, INFO, 30)
    assert isinstance(busy, Busy) and busy.holders == 1
    assert busy.holder is not None and busy.holder.token == sem.token
    assert backend.release("n", "b" * 32) is False
    assert backend.extend("n", "b" * 32, 60) is None
    assert backend.release("n", "a" * 32) is True
    grant = backend.acquire("n", "b" * 32, INFO, 30)
    assert isinstance(grant, Grant) and grant.token > sem.token  # type: ignore[operator]


def test_expired_semaphore_members_do_not_keep_a_mutex_out(backend: RedisBackend) -> None:
    """A zset that still exists but holds only expired members (it outlives its last score by
    up to 1 ms; here made by hand) sends acquire to the exact count, which finds it free."""
    _, leases, owners, _ = backend.store.keys("n")
    backend.io.client.zadd(leases, {"x" * 32: 1000})  # expired in 1970
    backend.io.client.hset(owners, "x" * 32, "7:0:{}")
    assert isinstance(backend.acquire("n", "a" * 32, INFO, 30), Grant)
    assert isinstance(backend.acquire("n", "b" * 32, INFO, 30, limit=2), Grant)  # 1 live of 2
    info = backend.inspect("n")
    assert info is not None and len(info.holders) == 2  # the mutex and the new slot


def test_an_owner_token_that_is_a_prefix_of_the_holders_is_not_the_holder(
    backend: RedisBackend,
) -> None:
    """The fast paths compare "owner:" with the start of the lease string."""
    owner = "ab" * 16
    grant = backend.acquire("n", owner, INFO, 30)
    assert isinstance(grant, Grant)
    for other in [owner[:-1], owner[:8], ""]:
        assert backend.release("n", other) is False
        assert backend.extend("n", other, 600) is None
        assert isinstance(backend.acquire("n", other, INFO, 30), Busy)
    extended = backend.extend("n", owner, 600)
    assert extended is not None and extended.token == grant.token
    assert backend.io.client.pttl(backend.store.keys("n")[0]) > 500_000
    assert backend.release("n", owner) is True


def test_a_flushed_script_cache_is_reloaded(backend: RedisBackend) -> None:
    backend.acquire("warm", "w" * 32, INFO, 30)
    backend.io.client.script_flush()
    grant = backend.acquire("n", "a" * 32, INFO, 30)
    assert isinstance(grant, Grant)
    backend.io.client.script_flush()
    assert backend.release("n", "a" * 32) is True


def test_records_are_compare_and_set(backend: RedisBackend) -> None:
    assert backend.record_get("r") == (None, 0)
    assert backend.record_set("r", '{"a":1}', 0) == 1
    assert backend.record_set("r", '{"a":2}', 0) is None
    assert backend.record_get("r") == ('{"a":1}', 1)
    assert backend.record_delete("r", 0) is False
    assert backend.record_delete("r", 1) is True
    assert backend.record_get("r") == (None, 0)


# -- waiting ---------------------------------------------------------------------------------


def test_waiters_share_one_pubsub_connection(backend: RedisBackend) -> None:
    waiters = [backend.subscribe(f"w{i}") for i in range(5)] + [backend.subscribe("w0")]
    channels = backend.io.client.pubsub_channels(f"{backend.store.prefix}*")
    assert sorted(channels) == sorted({backend.store.keys(f"w{i}")[0] for i in range(5)})
    clients = backend.io.client.client_list()
    assert sum(int(c["sub"]) > 0 for c in clients) == 1
    backend.acquire("w0", "a" * 32, INFO, 30)
    backend.release("w0", "a" * 32)
    assert waiters[0].wait(5)  # one release wakes one waiter of the name: the first
    assert not waiters[-1].wait(0.05) and not waiters[1].wait(0.05)
    waiters[0].close()  # woken, and leaving without the lease: the next one is woken instead
    assert waiters[-1].wait(5)
    for w in waiters[1:]:
        w.close()
    eventually(
        lambda: not backend.io.client.pubsub_channels(f"{backend.store.prefix}*"), what="unsub"
    )


def test_waiting_threads_take_turns_reading_the_shared_connection(backend: RedisBackend) -> None:
    names = [f"t{i}" for i in range(4)]
    for n in names:
        backend.acquire(n, "a" * 32, INFO, 60)
    woke: dict[str, float] = {}

    def wait(n: str) -> None:
        with backend.subscribe(n) as waiter:
            if waiter.wait(20):
                woke[n] = time.monotonic()

    threads = [threading.Thread(target=wait, args=(n,)) for n in names]
    for t in threads:
        t.start()
    channels = [backend.store.keys(n)[0] for n in names]
    eventually(
        lambda: all(c[1] == 1 for c in backend.io.client.pubsub_numsub(*channels)),
        what="all subscribed",
    )
    for n in names:  # whichever thread reads, each release must reach its own waiter
        released = time.monotonic()
        assert backend.release(n, "a" * 32)
        eventually(lambda n=n: n in woke, timeout=5, what=f"{n} woken")  # type: ignore[misc]
        assert woke[n] - released < 2
    for t in threads:
        t.join(timeout=5)


@pytest.mark.parametrize("limit", [1, 2])
def test_a_waiting_subscriber_sees_every_release(backend: RedisBackend, limit: int) -> None:
    """Both release paths (mutex fast path, semaphore slot) publish, every time."""
    with backend.subscribe("n") as waiter:
        for i in range(20):
            owner = f"{i:032x}"
            assert isinstance(backend.acquire("n", owner, INFO, 60, limit=limit), Grant)
            assert backend.release("n", owner) is True
            assert waiter.wait(5) is True, f"release {i} was not announced"
        assert backend.release("n", "f" * 32) is False
        assert waiter.wait(0.05) is False  # a release of nothing announces nothing


def test_release_between_subscribe_and_wait_is_not_missed(backend: RedisBackend) -> None:
    backend.acquire("n", "a" * 32, INFO, 60)
    with backend.subscribe("n") as waiter:
        backend.release("n", "a" * 32)
        start = time.monotonic()
        assert waiter.wait(10) is True
        assert time.monotonic() - start < 2


# -- one process woken per release: the line and the turn (redis_lua, "Waking one process") --

TURN_MS, RESERVE_MS = 50, 500  # as in redis_lua_helpers.PROLOGUE


@pytest.fixture
def processes(redis_url: str) -> Iterator[list[RedisBackend]]:
    """Three backends of one server, each with a line id of its own, as three processes."""
    backends = [open_backend(redis_url) for _ in range(3)]
    yield backends  # type: ignore[misc]
    for b in backends:
        b.close()


def _in_line(backend: RedisBackend, name: str, owner: str) -> Any:
    """A mutex waiter of ``name`` in ``backend`` (its own line id: a process of its own), put
    in the name's line as the core does: subscribe, then an attempt that finds it busy."""
    waiter = backend.wait_in_line(name, owner, INFO, 30, 1)
    assert isinstance(backend.acquire(name, owner, INFO, 30), Busy)
    return waiter


def _woken(backend: RedisBackend, name: str) -> tuple[str, int] | None:
    value = backend.io.client.get(f"{backend.store.base(name)}:rung")
    if value is None:
        return None
    line_id, _, ms = value.partition(":")
    return line_id, int(ms)


def test_a_release_wakes_the_first_waiting_process_only(processes: list[RedisBackend]) -> None:
    """Each backend here has its own line id, as a process has: with every waiting process
    woken by each release, 8 processes made ~8 attempts per grant."""
    holder, *others = processes
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    first = _in_line(others[0], "n", "1" * 32)
    second = _in_line(others[1], "n", "2" * 32)
    info = holder.inspect("n")
    assert info is not None and info.waiting_processes == 2
    assert holder.release("n", "h" * 32)
    assert first.wait(5) is True
    assert second.wait(0.2) is False  # not woken: not its turn
    assert isinstance(others[0].acquire("n", "1" * 32, INFO, 30), Grant)
    first.close()
    assert others[0].release("n", "1" * 32)
    assert second.wait(5) is True
    second.close()


def test_a_busy_attempt_at_a_name_found_busy_lately_joins_the_line_itself(
    processes: list[RedisBackend],
) -> None:
    """The attempt of a process about to wait (the name was busy for it a moment ago) joins
    the line in its own script, so its waiter subscribes without a JOIN round trip first (one
    of five per contended acquisition), and a release still rings it."""
    holder, other = processes[:2]
    line = f"{holder.store.base('n')}:line"  # type: ignore[attr-defined]
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    assert isinstance(other.acquire("n", "w" * 32, INFO, 30), Busy)
    assert holder.io.client.zrange(line, 0, -1) == []  # a first try waits for nothing
    assert isinstance(other.acquire("n", "w" * 32, INFO, 30), Busy)
    assert holder.io.client.zrange(line, 0, -1) == [other.store.line_id]  # type: ignore[attr-defined]
    steps = other.store.wait_in_line("n", "w" * 32, INFO, 30, 1)  # type: ignore[attr-defined]
    assert type(next(steps)).__name__ == "Subscribe"  # no JOIN first
    waiter = other.wait_in_line("n", "w" * 32, INFO, 30, 1)
    assert holder.release("n", "h" * 32)
    assert waiter.wait(5) is True
    assert isinstance(other.acquire("n", "w" * 32, INFO, 30), Grant)
    waiter.close()


def test_a_woken_process_gets_the_free_name_once_its_turn_is_due(
    processes: list[RedisBackend],
) -> None:
    holder, waiting, third = processes[:3]
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    waiter = _in_line(waiting, "n", "w" * 32)
    assert holder.release("n", "h" * 32)
    assert waiter.wait(5) is True
    rung = _woken(holder, "n")
    assert rung is not None and rung[0] == waiting.store.line_id  # type: ignore[attr-defined]
    eventually(lambda: _server_ms(holder) >= rung[1] + TURN_MS, what="the turn due")
    for other, owner in ((third, "x" * 32), (holder, "h" * 32)):
        busy = other.acquire("n", owner, INFO, 30)
        assert isinstance(busy, Busy) and busy.holder is None and busy.holders == 1
        assert busy.retry_after is not None and 0 < busy.retry_after <= RESERVE_MS / 1000
    assert isinstance(waiting.acquire("n", "w" * 32, INFO, 30), Grant)
    assert _woken(holder, "n") is None
    waiter.close()


def test_a_woken_process_that_finds_the_name_taken_again_tries_when_its_turn_is_due(
    processes: list[RedisBackend],
) -> None:
    """Within the turn's first 50 ms a holder may take the name again (a barge), and its next
    release within them rings nobody: the woken process is told to try again when its turn
    comes due, not when the barging holder's lease would end."""
    holder, waiting = processes[:2]
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    waiter = _in_line(waiting, "n", "w" * 32)
    line_id = waiting.store.line_id  # type: ignore[attr-defined]
    now = _server_ms(holder)  # as a release just now would have left it:
    holder.io.client.set(f"{holder.store.base('n')}:rung", f"{line_id}:{now}", px=510)
    busy = waiting.acquire("n", "w" * 32, INFO, 30)
    assert isinstance(busy, Busy) and busy.holder is not None  # the holder, as it is
    assert busy.retry_after is not None and busy.retry_after <= TURN_MS / 1000
    other = holder.acquire("n", "x" * 32, INFO, 30)  # not woken: the holder's lease end
    assert isinstance(other, Busy) and other.retry_after is not None
    assert other.retry_after > 20
    waiter.close()


def test_a_turn_ends_when_its_process_stops_listening_or_does_not_come(
    processes: list[RedisBackend],
) -> None:
    holder, waiting, third = processes[:3]
    for leaves in (True, False):
        assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
        waiter = _in_line(waiting, "n", "w" * 32)
        assert holder.release("n", "h" * 32) and waiter.wait(5)
        rung = _woken(holder, "n")
        assert rung is not None
        if leaves:  # its waiter left: the turn is dropped as soon as it is due
            waiter.close()
            channel = waiting.store.waiters_channel("n")  # type: ignore[attr-defined]
            eventually(
                lambda c=channel: holder.io.client.pubsub_numsub(c)[0][1] == 0,  # type: ignore[misc]
                what="unsubscribed",
            )
            eventually(lambda r=rung: _server_ms(holder) >= r[1] + TURN_MS, what="due")  # type: ignore[misc]
            assert isinstance(third.acquire("n", "x" * 32, INFO, 30), Grant)
        else:  # it listens but never comes: the name is free for all after the reserve
            eventually(lambda r=rung: _server_ms(holder) >= r[1] + TURN_MS, what="due")  # type: ignore[misc]
            assert isinstance(third.acquire("n", "x" * 32, INFO, 30), Busy)
            granted = eventually(
                lambda: isinstance(third.acquire("n", "x" * 32, INFO, 30), Grant),
                what="the reserve over",
            )
            assert granted and _server_ms(holder) >= rung[1] + TURN_MS + RESERVE_MS - 2
            waiter.close()
        assert third.release("n", "x" * 32)


def test_a_release_skips_processes_that_left_the_line(processes: list[RedisBackend]) -> None:
    holder, gone, waiting = processes[:3]
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    left = _in_line(gone, "n", "g" * 32)  # first in line, then it stops listening
    waiter = _in_line(waiting, "n", "w" * 32)
    left.close()
    channel = gone.store.waiters_channel("n")  # type: ignore[attr-defined]
    eventually(lambda: holder.io.client.pubsub_numsub(channel)[0][1] == 0, what="unsub")
    assert holder.release("n", "h" * 32)
    assert waiter.wait(5) is True
    rung = _woken(holder, "n")
    assert rung is not None and rung[0] == waiting.store.line_id  # type: ignore[attr-defined]
    waiter.close()


def test_a_woken_process_that_leaves_without_the_name_wakes_the_next(
    processes: list[RedisBackend],
) -> None:
    holder, leaving, waiting = processes[:3]
    assert isinstance(holder.acquire("n", "h" * 32, INFO, 30), Grant)
    first = _in_line(leaving, "n", "l" * 32)
    second = _in_line(waiting, "n", "w" * 32)
    assert holder.release("n", "h" * 32)
    assert first.wait(5) is True  # its process's turn
    assert second.wait(0.2) is False
    first.close()  # its wait ends without the name, no other waiter of it: pass it on
    assert second.wait(5) is True
    rung = _woken(holder, "n")
    assert rung is not None and rung[0] == waiting.store.line_id  # type: ignore[attr-defined]
    second.close()


def test_async_a_woken_process_that_leaves_without_the_name_wakes_the_next(
    redis_url: str,
) -> None:
    async def main() -> None:
        holder, leaving, waiting = backends = [_async_backend(redis_url) for _ in range(3)]
        try:
            assert isinstance(await holder.acquire("n", "h" * 32, INFO, 30), Grant)
            waiters = []
            for backend, owner in ((leaving, "l" * 32), (waiting, "w" * 32)):
                waiters.append(await backend.wait_in_line("n", owner, INFO, 30, 1))
                assert isinstance(await backend.acquire("n", owner, INFO, 30), Busy)
            first, second = waiters
            assert await holder.release("n", "h" * 32)
            assert await first.wait(5) is True
            assert await second.wait(0.2) is False
            await first.close()
            assert await second.wait(5) is True
            await second.close()
        finally:
            for b in backends:
                await b.aclose()

    asyncio.run(main())


def test_a_forked_child_has_a_line_id_of_its_own(backend: RedisBackend) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, backend.store.line_id.encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child and child != backend.store.line_id
    assert ":" not in child and child.split(".")[1] == backend.store.line_id.split(".")[1]


# -- failures --------------------------------------------------------------------------------


def test_server_stopped_mid_run(own_server: RunningServer) -> None:
    url = f"{own_server.url}?timeout=2"
    store, other = latchkey.connect(url), latchkey.connect(url)
    try:
        held = store.lock("job", ttl="60s")
        assert held.acquire()
        blocked: list[BaseException] = []

        def wait_for_it() -> None:
            try:
                other.lock("job", ttl="60s", wait="30s").acquire()
            except BaseException as exc:
                blocked.append(exc)

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        channel = other.backend.store.waiters_channel("job")  # type: ignore[attr-defined]
        client = other.backend.io.client  # type: ignore[attr-defined]
        eventually(lambda: client.pubsub_numsub(channel)[0][1] == 1, what="waiter subscribed")
        own_server.stop()
        started = time.monotonic()
        # Through the holder's own store a wait=0 is answered busy from its record of the
        # lease it holds (docs/concepts/waiting.md), without asking: ask through a third.
        third = latchkey.connect(url)
        with pytest.raises(StoreUnavailable, match=rf"redis store at .*:{own_server.port}"):
            third.lock("job", ttl="60s", wait=0).acquire()
        third.close()
        assert time.monotonic() - started < 3
        waiter.join(timeout=10)
        assert not waiter.is_alive() and isinstance(blocked[0], StoreUnavailable)

        own_server.start()  # no persistence: every lease and counter is gone
        assert held.release() is False
        first = store.lock("job", ttl="60s", wait=0)
        second = other.lock("job", ttl="60s", wait=0)
        assert first.acquire() is True
        assert second.acquire() is False  # no double grant after the restart
        with pytest.raises(LockLost):
            held.extend("1m")
        first.release()
    finally:
        store.close()
        other.close()


def test_wrong_password_is_unavailable_and_not_shown(tmp_path: Path) -> None:
    try:
        server = start_redis(tmp_path / "auth", password="right-pw-7F3k")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    try:
        host = f"127.0.0.1:{server.port}"
        for url in [f"redis://:wrong-pw-Q9zX@{host}/0", f"redis://user1:wrong-pw-Q9zX@{host}/0"]:
            store = latchkey.connect(url)
            with pytest.raises(StoreUnavailable) as caught:
                store.lock("n", wait=0).acquire()
            assert "wrong-pw-Q9zX" not in str(caught.value)
            assert "wrong-pw-Q9zX" not in repr(store.backend)
            store.close()
        with pytest.raises(StoreUnavailable):
            latchkey.connect(f"redis://{host}/0").lock("n", wait=0).acquire()
        good = latchkey.connect(f"redis://:right-pw-7F3k@{host}/0")
        with good.lock("n", ttl="10s", wait=0) as lock:
            first = lock.token
            assert first is not None
        with good.lock("n", ttl="10s", wait="5s") as lock:  # waits through pub/sub with AUTH
            assert lock.token is not None and lock.token > first
        good.close()
    finally:
        server.stop()


def test_unreachable_server_fails_within_the_timeout() -> None:
    store = latchkey.connect("redis://127.0.0.1:1/0?timeout=1")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="acquire failed"):
        store.lock("n", wait=0).acquire()
    with pytest.raises(StoreUnavailable, match="subscribe failed"):
        store.backend.subscribe("n")
    assert time.monotonic() - started < 3


def test_a_hung_server_times_out_and_the_next_call_reconnects(own_server: RunningServer) -> None:
    backend = open_backend(f"{own_server.url}?timeout=0.5")
    try:
        assert isinstance(backend.acquire("n", "a" * 32, INFO, 30), Grant)
        os.kill(own_server.pid, signal.SIGSTOP)  # accepts connections, never answers
        try:
            for call in (
                lambda: backend.acquire("m", "b" * 32, INFO, 30),
                lambda: backend.subscribe("n"),
                lambda: list(backend.list()),
            ):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable, match="Timeout"):
                    call()
                assert time.monotonic() - started < 2
        finally:
            os.kill(own_server.pid, signal.SIGCONT)
        assert backend.release("n", "a" * 32) is True
    finally:
        backend.close()


def test_an_idle_connection_the_server_closed_is_replaced(backend: RedisBackend) -> None:
    """Like redis-py's pool: a pooled connection the server closed while it sat idle is
    reconnected before use, not reported as an outage. Idle means given back CHECK_AFTER
    (1 ms) ago or more, as the driver documents: one used less than that ago is not checked
    (a connect and CLIENT KILL take ~0.8 ms on an idle machine, so the test waits that out)."""
    assert isinstance(backend.acquire("n", "a" * 32, INFO, 30), Grant)
    assert backend.io.pool.idle
    _, since = backend.io.pool.idle[-1]
    while time.monotonic() - since < CHECK_AFTER:
        time.sleep(CHECK_AFTER / 4)  # the documented idle time, not a guess at a race
    kwargs = backend.io.client.connection_pool.connection_kwargs
    with redis.Redis(host=kwargs["host"], port=kwargs["port"]) as admin:
        killed = admin.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    assert backend.release("n", "a" * 32) is True
    assert isinstance(backend.acquire("n", "b" * 32, INFO, 30), Grant)


def test_the_first_call_after_a_restart_succeeds(own_server: RunningServer) -> None:
    backend = open_backend(own_server.url)
    try:
        before = backend.acquire("n", "a" * 32, INFO, 30)
        assert isinstance(before, Grant) and before.token is not None
        own_server.stop()
        own_server.start()
        grant = backend.acquire("n", "b" * 32, INFO, 30)  # on the pooled, now dead, connection
        # No persistence: a new counter, started from the server's clock, above the old one.
        assert isinstance(grant, Grant) and grant.token is not None and grant.token > before.token
    finally:
        backend.close()


def test_an_error_reply_keeps_the_connection(backend: RedisBackend) -> None:
    backend.acquire("warm", "w" * 32, INFO, 30)
    connections = len(backend.io.client.client_list())
    # not ours: a hash where a lease goes
    backend.io.client.hset(backend.store.keys("bad")[0], "x", "1")
    with pytest.raises(StoreUnavailable, match="WRONGTYPE"):
        backend.acquire("bad", "a" * 32, INFO, 30)
    assert isinstance(backend.acquire("n", "a" * 32, INFO, 30), Grant)
    assert len(backend.io.client.client_list()) == connections


def test_threads_share_the_connections(backend: RedisBackend) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            for j in range(50):
                owner = f"{i:016x}{j:016x}"
                assert isinstance(backend.acquire(f"n{i}", owner, INFO, 30), Grant)
                assert backend.release(f"n{i}", owner) is True
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[0]
    assert 1 <= len(backend.io.pool.idle) <= 8
    idle = [conn for conn, _ in backend.io.pool.idle]
    assert len({id(conn) for conn in idle}) == len(idle)  # each connection once


def test_db_number_comes_from_the_path(own_server: RunningServer) -> None:
    base = own_server.url.rsplit("/", 1)[0]
    backend = open_backend(f"{base}/3?prefix=p:")
    try:
        backend.acquire("n", "a" * 32, INFO, 30)
        port = own_server.port
        with redis.Redis(port=port, db=3) as db3, redis.Redis(port=port) as db0:
            assert db3.exists(backend.store.keys("n")[0]) == 1
            assert db0.dbsize() == 0
    finally:
        backend.close()


def test_fork_child_uses_its_own_connections(backend: RedisBackend) -> None:
    assert isinstance(backend.acquire("n", "a" * 32, INFO, 30), Grant)
    backend.subscribe("warm").close()  # the parent has a listener thread and pooled sockets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # child: must not share the parent's sockets
        code = 1
        try:
            if backend.io.pool.idle:
                os._exit(3)
            busy = backend.acquire("n", "b" * 32, INFO, 30)
            waiter = backend.subscribe("n")
            waiter.close()
            code = 0 if isinstance(busy, Busy) and busy.holders == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.release("n", "a" * 32) is True  # the parent's connection still works
    with backend.subscribe("n") as waiter:
        assert waiter.wait(0.01) is False


# -- asyncio ---------------------------------------------------------------------------------


async def _until(probe: Callable[[], Awaitable[object]], what: str, timeout: float = 10) -> None:
    """Await ``probe`` until it is truthy (the asyncio twin of ``eventually``)."""
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.005)


def _subscribers(backend: AsyncRedisBackend, name: str) -> Callable[[], Awaitable[int]]:
    async def count() -> int:
        reply = await backend.io.client.pubsub_numsub(backend.store.waiters_channel(name))
        return int(reply[0][1])

    return count


def _async_backend(url: str) -> AsyncRedisBackend:
    backend = open_async_backend(url)
    assert isinstance(backend, AsyncRedisBackend)
    return backend


def test_async_cancelled_waiting_acquire_leaves_nothing_held(redis_url: str) -> None:
    async def main() -> None:
        store = latchkey.connect_async(redis_url)
        backend = store.backend
        assert isinstance(backend, AsyncRedisBackend)
        subscribers = _subscribers(backend, "n")
        try:
            holder = store.lock("n", ttl="60s", wait=0)
            assert await holder.acquire()
            task = asyncio.create_task(store.lock("n", ttl="60s", wait="30s").acquire())
            await _until(lambda: _is(subscribers, 1), "the waiter subscribed")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until(lambda: _is(subscribers, 0), "the waiter unsubscribed")
            info = await store.inspect("n")
            assert info is not None and len(info.holders) == 1 and info.token == holder.token
            assert await holder.release() is True
            assert await store.inspect("n") is None
            # the backend and its listener still work: a new waiter is woken by the release
            assert await holder.acquire()
            second = store.lock("n", ttl="60s", wait="30s")
            task = asyncio.create_task(second.acquire())
            await _until(lambda: _is(subscribers, 1), "the second waiter subscribed")
            assert await holder.release() is True
            assert await asyncio.wait_for(task, 10) is True
            assert await second.release() is True
        finally:
            await store.aclose()

    asyncio.run(main())


async def _is(probe: Callable[[], Awaitable[int]], expected: int) -> bool:
    return await probe() == expected


def test_async_cancelled_command_is_not_reused_half_read(own_server: RunningServer) -> None:
    """A script call cancelled after it was sent: its reply, when it comes, must not be read
    as the answer to the next call on the same connection."""

    async def main() -> None:
        backend = _async_backend(f"{own_server.url}?timeout=5")
        try:
            assert isinstance(await backend.acquire("a", "a" * 32, INFO, 60), Grant)
            os.kill(own_server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(backend.acquire("b", "b" * 32, INFO, 60), 0.3)
            finally:
                os.kill(own_server.pid, signal.SIGCONT)
            assert await backend.release("a", "a" * 32) is True
            grant = await backend.acquire("c", "c" * 32, INFO, 60)
            assert isinstance(grant, Grant)
            assert await backend.inspect("a") is None
        finally:
            await backend.aclose()

    asyncio.run(main())


def test_async_hung_or_stopped_server_is_unavailable_within_the_timeout(
    own_server: RunningServer,
) -> None:
    async def main() -> None:
        backend = _async_backend(f"{own_server.url}?timeout=0.5")
        try:
            first = await backend.acquire("n", "a" * 32, INFO, 30)
            assert isinstance(first, Grant) and first.token is not None
            await (await backend.subscribe("warm")).close()  # the listener exists now
            os.kill(own_server.pid, signal.SIGSTOP)  # accepts connections, never answers
            try:
                calls: list[Callable[[], Awaitable[object]]] = [
                    lambda: backend.acquire("m", "b" * 32, INFO, 30),
                    lambda: backend.subscribe("n"),
                    lambda: _collect(backend.list()),
                    backend.now,
                ]
                for call in calls:
                    started = time.monotonic()
                    with pytest.raises(StoreUnavailable, match="Timeout"):
                        await call()
                    assert time.monotonic() - started < 1.5
            finally:
                os.kill(own_server.pid, signal.SIGCONT)
            assert await backend.release("n", "a" * 32) is True

            own_server.stop()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=rf"redis store at .*:{own_server.port}"):
                await backend.acquire("n", "a" * 32, INFO, 30)
            with pytest.raises(StoreUnavailable, match="subscribe failed"):
                await backend.subscribe("n")
            assert time.monotonic() - started < 1.5
            own_server.start()  # no persistence: a new counter; the next calls reconnect
            grant = await backend.acquire("n", "b" * 32, INFO, 30)
            # The new counter starts from the server's clock: above the lost one's tokens.
            assert isinstance(grant, Grant) and grant.token is not None
            assert grant.token > first.token
            waiter = await backend.subscribe("n")
            assert await backend.release("n", "b" * 32) is True
            assert await waiter.wait(5) is True
            await waiter.close()
        finally:
            await backend.aclose()

    asyncio.run(main())


async def _collect(items: AsyncIterator[object]) -> list[object]:
    return [item async for item in items]


def test_async_waiter_is_woken_by_the_release_notice(redis_url: str) -> None:
    """Counted, not timed: the wait that ends the blocked acquire returns True (woken by the
    PUBLISH), and every later attempt followed one wait."""

    async def main() -> None:
        store = latchkey.connect_async(redis_url)
        backend = store.backend
        assert isinstance(backend, AsyncRedisBackend)
        attempts, waits = [0], list[bool]()
        long_wait = asyncio.Event()  # a wait long enough for a notice to arrive in it
        acquire, wait_in_line = backend.acquire, backend.wait_in_line

        async def counting_acquire(*args: Any) -> Any:
            attempts[0] += 1
            return await acquire(*args)

        async def counting_wait_in_line(*args: Any) -> AsyncWaiter:
            waiter = await wait_in_line(*args)
            assert waiter is not None
            wait = waiter.wait

            async def counted(timeout: float) -> bool:
                if timeout >= 0.3:
                    long_wait.set()
                woke = await wait(timeout)
                waits.append(woke)
                return woke

            waiter.wait = counted  # type: ignore[method-assign]
            return waiter

        # The holder goes through a store object of its own: a waiter of the holder's own
        # store is answered from its record of the lease, without asking the store.
        holder_store = latchkey.connect_async(redis_url)
        try:
            holder = holder_store.lock("n", ttl="60s", wait=0)
            assert await holder.acquire()
            backend.acquire = counting_acquire  # type: ignore[method-assign]
            backend.wait_in_line = counting_wait_in_line  # type: ignore[method-assign]
            waiter = store.lock("n", ttl="60s", wait="30s")
            task = asyncio.create_task(waiter.acquire())
            await asyncio.wait_for(long_wait.wait(), 20)
            assert await holder.release() is True
            assert await asyncio.wait_for(task, 10) is True
            assert waits[-1] is True, waits  # woken by the notice, not by the end of a wait
            # the first attempt, the one right after subscribing, then one after each wait
            assert attempts[0] == len(waits) + 2, (attempts, waits)
            assert await waiter.release() is True
        finally:
            await holder_store.aclose()
            await store.aclose()

    asyncio.run(main())


def test_async_a_thousand_waiters_share_one_pubsub_connection(redis_url: str) -> None:
    async def main() -> None:
        backend = _async_backend(redis_url)
        try:
            names = [f"w{i}" for i in range(10)]
            waiters = await asyncio.gather(*(backend.subscribe(names[i % 10]) for i in range(1000)))
            clients = await backend.io.client.client_list()
            assert sum(int(c["sub"]) > 0 for c in clients) == 1
            channels = await backend.io.client.pubsub_channels(f"{backend.store.prefix}*")
            assert sorted(channels) == sorted(backend.store.keys(n)[0] for n in names)
            assert isinstance(await backend.acquire("w0", "a" * 32, INFO, 30), Grant)
            assert await backend.release("w0", "a" * 32) is True
            assert await waiters[0].wait(10) is True  # one release, one waiter: the first
            assert await waiters[10].wait(0.05) is False  # no herd
            await waiters[0].close()  # woken, leaving without the lease: passes it on
            for _ in range(98):  # each release wakes the next in line not woken yet
                assert isinstance(await backend.acquire("w0", "a" * 32, INFO, 30), Grant)
                assert await backend.release("w0", "a" * 32) is True
            # Every announcement read before anyone waits: a waiter whose wait has taken its
            # ring is first in line again, and a later announcement would ring it twice.
            await _until(lambda: _rung(waiters[10::10]), "each release rang the next in line")
            woken = await asyncio.gather(*(w.wait(0) for w in waiters[10::10]))
            assert all(woken) and len(woken) == 99
            assert await waiters[1].wait(0.05) is False  # w1 was not released
            await asyncio.gather(*(w.close() for w in waiters[1:]))
            await _until(
                lambda: _none(backend.io.client.pubsub_channels(f"{backend.store.prefix}*")),
                "unsubscribed",
            )
        finally:
            await backend.aclose()

    asyncio.run(main())


async def _rung(waiters: list[Any]) -> bool:
    return all(w._event.is_set() for w in waiters)


async def _none(items: Awaitable[list[Any]]) -> bool:
    return not await items


def test_a_waiter_knows_how_many_of_its_process_come_before_it(redis_url: str) -> None:
    """``Waiter.ahead``: the waiters of one name in this process that a release notice wakes
    before this one (the core's safety-net poll grows with it); other names do not count,
    and when the first leaves the others move up."""
    backend = open_backend(redis_url)
    assert isinstance(backend, RedisBackend)
    try:
        line = [backend.subscribe("n") for _ in range(3)]
        other = backend.subscribe("m")
        assert [w.ahead for w in line] == [0, 1, 2] and other.ahead == 0
        line[0].close()
        assert [w.ahead for w in line[1:]] == [0, 1]
        for waiter in (*line[1:], other):
            waiter.close()
    finally:
        backend.close()

    async def main() -> None:
        abackend = _async_backend(redis_url)
        try:
            aline = [await abackend.subscribe("n") for _ in range(3)]
            assert [w.ahead for w in aline] == [0, 1, 2]
            await aline[0].close()
            assert [w.ahead for w in aline[1:]] == [0, 1]
            for waiter in aline[1:]:
                await waiter.close()
        finally:
            await abackend.aclose()

    asyncio.run(main())


def test_async_aclose_closes_the_connections_and_the_listener(redis_url: str) -> None:
    async def main() -> None:
        backend = _async_backend(redis_url)
        admin = _async_backend(redis_url)
        try:
            assert isinstance(await backend.acquire("n", "a" * 32, INFO, 30), Grant)
            waiter = await backend.subscribe("n")
            before = len(await admin.io.client.client_list())
            await backend.aclose()
            assert await waiter.wait(0.01) is False
            await waiter.close()

            async def gone() -> bool:
                return len(await admin.io.client.client_list()) <= before - 2

            await _until(gone, "the backend's connections closed")
            assert not [t for t in asyncio.all_tasks() if t.get_name() == "latchkey-redis-listener"]
        finally:
            await admin.aclose()

    asyncio.run(main())


def test_a_health_check_leaves_no_key_for_ever(redis_url: str, backend: RedisBackend) -> None:
    """``latchkey check`` probes with a name of its own each time: every key it leaves has an
    expiry (the fence counter's: ten minutes past the probe's lease)."""
    with latchkey.connect(redis_url) as store:
        store.check()
    keys = backend.io.client.keys(backend.store.prefix + "*")
    assert keys, "the probe left its fence counter (for ten minutes)"
    assert all(backend.io.client.pttl(key) > 0 for key in keys), keys


# -- redis-py's own options in the URL ----------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RunningServer, int, dict[str, Path]]]:
    """A private Redis serving TLS on a port of its own, with a client certificate required."""
    try:
        server, tls_port, files = start_redis_tls(tmp_path / "redis-tls")
    except ServerUnavailable as exc:
        _skip_or_fail(str(exc))
    yield server, tls_port, files
    server.stop()


def _tls_url(tls_port: int, files: dict[str, Path], *, without: str = "") -> str:
    """A rediss:// URL with redis-py's TLS options: paths that start with ``/`` (whole, not cut
    at the first slash), the client key's password, a client name. ``without``: one left out."""
    options = {
        "ssl_ca_certs": str(files["ca.pem"]),
        "ssl_certfile": str(files["client.pem"]),
        "ssl_keyfile": str(files["client-enc.key"]),
        "ssl_password": CLIENT_KEY_PASSWORD,
        "ssl_min_version": "TLSv1_2",
        "client_name": "tls-worker",
        "timeout": "3s",
        "prefix": f"t{uuid.uuid4().hex[:8]}:",
    }
    query = "&".join(f"{k}={v}" for k, v in options.items() if k != without)
    return f"rediss://127.0.0.1:{tls_port}/0?{query}"


def test_a_rediss_url_with_redis_pys_tls_options_reaches_a_tls_server(
    tls_server: tuple[RunningServer, int, dict[str, Path]],
    connect: Callable[[str], latchkey.Store],
) -> None:
    server, tls_port, files = tls_server
    url = _tls_url(tls_port, files)
    store = connect(url)
    try:
        with store.lock("tls", ttl="10s", wait=0) as lock:
            assert lock.token is not None and store.inspect("tls") is not None
        with redis.Redis(port=server.port, decode_responses=True) as admin:  # the plain port
            names = [c["name"] for c in admin.client_list()]
        assert "tls-worker" in names, names  # client_name reached the connections
        for shown in (repr(store), store.url):
            assert CLIENT_KEY_PASSWORD not in shown
    finally:
        store.close()


@pytest.mark.parametrize(
    ("left_out", "why"),
    [
        # TLS 1.3: the server's refusal comes after the handshake, read or met while writing
        ("ssl_certfile", "CERTIFICATE_REQUIRED|EOF occurred in violation of protocol"),
        ("ssl_ca_certs", "CERTIFICATE_VERIFY_FAILED"),
    ],
)
def test_a_rediss_url_without_the_tls_options_the_server_needs_is_unavailable(
    tls_server: tuple[RunningServer, int, dict[str, Path]], left_out: str, why: str
) -> None:
    """The options are what made the connection above: without the client certificate the
    server hangs up; without the CA the server's certificate is not trusted."""
    _, tls_port, files = tls_server
    url = _tls_url(tls_port, files, without=left_out)
    if left_out == "ssl_certfile":
        url = url.replace(f"ssl_keyfile={files['client-enc.key']}&", "")
        url = url.replace(f"ssl_password={CLIENT_KEY_PASSWORD}&", "")
    with latchkey.connect(url) as store:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=why) as caught:
            store.lock("tls", ttl="10s", wait=0).acquire()
        assert time.monotonic() - started < 3 + 1
    assert CLIENT_KEY_PASSWORD not in str(caught.value)


def test_health_check_interval_pings_a_connection_idle_that_long(
    own_server: RunningServer,
) -> None:
    """redis-py's health check, asked for in the URL, runs on latchkey's own connections: a
    connection idle for the interval gets a PING before its next command; without the
    option, none."""

    def pings() -> int:
        with redis.Redis(port=own_server.port) as admin:
            stats = admin.info("commandstats").get("cmdstat_ping", {})
            return int(stats.get("calls", 0))

    for query, expected in (("health_check_interval=1", 1), ("socket_keepalive=yes", 0)):
        backend = open_backend(f"{own_server.url}?{query}")
        try:
            backend.now()  # a connection, used and given back
            before = pings()
            time.sleep(1.2)  # the interval is whole seconds of idleness: nothing to poll for
            backend.now()
            assert pings() - before == expected, query
        finally:
            backend.close()


# -- the expiry index: a purge costs what it removes ------------------------------------------


def _index(admin: redis.Redis, prefix: str = "latchkey:") -> dict[str, int]:
    """The expiry index: semaphore base key -> score (ms)."""
    members = admin.zrange(f"{prefix}expiring", 0, -1, withscores=True)
    return {k.decode(): int(v) for k, v in members}


def _store_base(name: str, prefix: str = "latchkey:") -> str:
    return f"{prefix}{{{name.encode().hex()}}}"


def _soonest(admin: redis.Redis, base: str) -> int:
    """The soonest expiry in a semaphore's zset."""
    return int(admin.zrange(f"{base}:leases", 0, 0, withscores=True)[0][1])


def test_a_purge_beside_many_live_leases_reads_the_index_not_every_key(
    own_server: RunningServer, connect: Callable[[str], latchkey.Store]
) -> None:
    """2,000 live mutex leases and 50 live semaphores, one of which keeps an expired entry: the
    purge removes that entry in one EVALSHA that reads the index and the one due zset: no
    SCAN, and none of the live semaphores is touched (sync and asyncio)."""
    store = connect(own_server.url)
    admin = redis.Redis(port=own_server.port)
    try:
        assert len(store.claim([f"m{i:04}" for i in range(2_000)], ttl="60s")) == 2_000
        slots = [store.semaphore(f"s{i:02}", 3, ttl="60s") for i in range(50)]
        for slot in slots:
            assert slot.acquire()
        short = store.semaphore("s00", 3, ttl="200ms")
        assert short.acquire()
        assert store.purge_expired() == 0  # (loads the script: NOSCRIPT, SCRIPT LOAD)
        eventually(lambda: len(store.inspect("s00").holders) == 1, what="expiry")  # type: ignore[union-attr]
        before = _commands(admin)
        assert store.purge_expired() == 1
        after = _commands(admin)
        spent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        spent.pop("info", None)
        assert "scan" not in spent, spent
        # the index's ZRANGEBYSCORE, then the due zset's own (drop_expired): nothing else read
        assert spent["evalsha"] == 1 and spent["zrangebyscore"] == 2, spent
        assert store.purge_expired() == 0
        assert len(store.inspect("s00").holders) == 1  # type: ignore[union-attr]
    finally:
        admin.close()
        store.close()


def test_the_index_has_a_member_per_semaphore_with_holders_and_none_when_all_left(
    own_server: RunningServer, connect: Callable[[str], latchkey.Store]
) -> None:
    """Each semaphore with holders has one index member scored by its zset's soonest expiry,
    kept by acquire, renewal and release; a mutex has none; when the last holder leaves (by
    release, force release, or expiry and a purge) the member goes, and the index with it."""
    store = connect(own_server.url)
    admin = redis.Redis(port=own_server.port)
    base = _store_base
    try:
        a = store.semaphore("a", 3, ttl="30s")
        a2 = store.semaphore("a", 3, ttl="20s")
        b = store.semaphore("b", 2, ttl="30s")
        c = store.semaphore("c", 2, ttl="200ms")
        mutex = store.lock("m", ttl="30s")
        for lease in (a, a2, b, c, mutex):
            assert lease.acquire()
        index = _index(admin)
        assert sorted(index) == [base("a"), base("b"), base("c")]
        assert all(index[k] == _soonest(admin, k) for k in index)
        last = admin.zrange(f"{base('a')}:leases", -1, -1, withscores=True)[0][1]
        assert index[base("a")] < last  # the 20 s holder's expiry, not the 30 s one's
        a2.extend("60s")  # the soonest moves on to the other holder
        assert _index(admin)[base("a")] == _soonest(admin, base("a"))
        assert a2.release() and _index(admin)[base("a")] == _soonest(admin, base("a"))
        assert a.release() and base("a") not in _index(admin)
        assert store.force_release("b") and base("b") not in _index(admin)
        eventually(lambda: store.is_free("c"), what="expiry")
        assert base("c") in _index(admin)  # expired unreleased: due, for the purge
        assert store.purge_expired() == 0  # (the zset itself expired with its holder)
        assert admin.exists("latchkey:expiring") == 0
        mutex.release()
    finally:
        admin.close()
        store.close()


def test_a_zset_written_before_the_index_is_registered_by_its_next_renewal(
    own_server: RunningServer, connect: Callable[[str], latchkey.Store]
) -> None:
    """Data of an older latchkey: a zset with an expired entry kept by a live holder, and no
    index member. The purge does not see it (it reads the index only); the live holder's next
    renewal (or any acquire or release of the name) registers it, and the next purge removes
    the entry. Left alone, the zset still expires with its last holder (PEXPIREAT)."""
    store = connect(own_server.url)
    admin = redis.Redis(port=own_server.port)
    try:
        live = store.semaphore("old", 3, ttl="30s")
        dead = store.semaphore("old", 3, ttl="200ms")
        assert live.acquire() and dead.acquire()
        admin.delete("latchkey:expiring")  # as an older latchkey left it
        eventually(lambda: len(store.inspect("old").holders) == 1, what="expiry")  # type: ignore[union-attr]
        assert store.purge_expired() == 0
        assert 0 < admin.pttl(f"{_store_base('old')}:leases") <= 30_000
        live.extend("30s")
        assert store.purge_expired() == 1
        assert admin.zcard(f"{_store_base('old')}:leases") == 1
        assert live.release() and admin.exists("latchkey:expiring") == 0
    finally:
        admin.close()
        store.close()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_purge_with_a_limit_stops_after_a_page_and_the_next_calls_clear_the_rest(
    redis_url: str, flavour: str
) -> None:
    """250 semaphores each keeping one expired entry beside a live holder: ``limit=50`` stops
    after the first script (100 zsets, 100 entries), as the core's batches need; calls until
    one returns less than its limit clear the rest, and leave every live holder."""
    names = [f"s{i:03}" for i in range(250)]
    if flavour == "sync":
        backend: Any = open_backend(redis_url)
        call: Callable[[Any], Any] = lambda value: value  # noqa: E731
    else:
        backend = open_async_backend(redis_url)
        loop = asyncio.new_event_loop()
        call = loop.run_until_complete
    try:
        for n in names:
            assert isinstance(call(backend.acquire(n, "live" * 8, INFO, 60, 3)), Grant)
            assert isinstance(call(backend.acquire(n, "dead" * 8, INFO, 0.2, 3)), Grant)
        eventually(lambda: _server_ms_of(redis_url) > _index_max(redis_url), what="expiry")
        assert call(backend.purge_expired(50)) == 100
        rest = [call(backend.purge_expired(100)) for _ in range(2)]
        assert rest == [100, 50]
        assert call(backend.purge_expired(100)) == 0
        for n in names[::50]:
            info = call(backend.inspect(n))
            assert info is not None and len(info.holders) == 1
    finally:
        if flavour == "sync":
            backend.close()
        else:
            call(backend.aclose())
            loop.close()


def _server_ms_of(url: str) -> int:
    with redis.Redis.from_url(url.split("?")[0]) as admin:
        seconds, micros = admin.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _index_max(url: str) -> int:
    prefix = url.split("prefix=")[1]
    with redis.Redis.from_url(url.split("?")[0]) as admin:
        top = admin.zrange(f"{prefix}expiring", -1, -1, withscores=True)
    return int(top[0][1]) if top else 0


def test_a_release_does_not_wait_for_a_renewal_stuck_on_a_frozen_server(
    redis_url: str, server_pool: ServerPool
) -> None:
    """A renewal in flight when the server stalls: the release takes its own timeout, not the
    renewal's first (the chaos run found releases of renewed ZooKeeper leases taking up to
    two timeouts while the ensemble restarted: the release joined the renewer thread, which
    was waiting out its extend). The renewal's late failure is dropped: the lock is released,
    not lost. (The sync runner's Renewer; the core is the same for every store.)"""
    server = server_pool.running["redis"]
    store = latchkey.connect(f"{redis_url}&timeout=1s")
    try:
        lock = store.lock("stuck", ttl="3s", renew=True)  # a renewal every second
        assert lock.acquire()
        renewer = lock._renewer  # type: ignore[attr-defined]
        with server.frozen():
            eventually(lambda: renewer._busy, timeout=5, what="a renewal in flight")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                lock.release()
            took = time.monotonic() - started
        assert took < 1.6, f"the release took {took:.2f} s: it waited for the renewal"
        eventually(lambda: not renewer._thread.is_alive(), timeout=5, what="the renewer ends")
        assert not lock.lost and lock.token is None
    finally:
        store.close()


def test_async_a_release_does_not_wait_for_a_renewal_stuck_on_a_frozen_server(
    redis_url: str, server_pool: ServerPool
) -> None:
    """The asyncio twin of the test above: the release cancels the renewal task in flight
    (its round trip to the frozen server) and takes its own timeout, not the renewal's first;
    the lock is released, not lost."""
    server = server_pool.running["redis"]

    async def main() -> float:
        store = latchkey.connect_async(f"{redis_url}&timeout=1s")
        try:
            lock = store.lock("stuck-async", ttl="3s", renew=True)  # a renewal every second
            assert await lock.acquire()
            renewer = lock._renewer  # type: ignore[attr-defined]
            with server.frozen():

                async def renewing() -> bool:
                    return bool(renewer._busy)

                await _until(renewing, "a renewal in flight")
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await lock.release()
                took = time.monotonic() - started
            assert not lock.lost and lock.token is None
            assert renewer._task.done()
            return took
        finally:
            await store.aclose()

    took = asyncio.run(main())
    assert took < 1.6, f"the release took {took:.2f} s: it waited for the renewal"
