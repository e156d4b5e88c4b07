"""Faults, for every store with a server: unreachable, stopped mid-run, restarted.

A store failure is StoreUnavailable (a ConnectionError) within the configured timeout — never
"busy" — the next call after the server is back reconnects, and no lease is granted twice.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import latchkey
from latchkey import LockLost, StoreUnavailable
from tests import servers
from tests.faults.proxy import Proxy
from tests.helpers import eventually


def _with_port(url: str, port: int) -> str:
    return re.sub(
        r"@?(127\.0\.0\.1|localhost):\d+",
        lambda m: m.group(0).split(":")[0] + f":{port}",
        url,
        count=1,
    )


def test_unreachable_server_is_unavailable_not_busy(
    store_row: servers.StoreRow,
    base_url: str,
    name: str,
    connect: Callable[[str], latchkey.Store],
) -> None:
    if store_row.server is None:
        pytest.skip(f"{store_row.id}: embedded store, nothing to reach")
    url = servers.with_query(_with_port(base_url, servers.free_port()), timeout="2s")
    store = connect(url)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        store.lock(name, ttl="10s", wait=0).acquire()
    assert time.monotonic() - started < 15
    assert isinstance(caught.value, ConnectionError)
    with pytest.raises(StoreUnavailable):
        store.inspect(name)
    store.close()


def test_server_stopped_mid_run_then_restarted(
    store_row: servers.StoreRow,
    running_server: servers.RunningServer,
    store_url: str,
    name: str,
    connect: Callable[[str], latchkey.Store],
) -> None:
    url = servers.with_query(store_url, timeout="2s")
    store, other = connect(url), connect(url)
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()
    assert other.lock(name, ttl="60s", wait=0).acquire() is False
    running_server.stop()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            other.lock(name, ttl="60s", wait=0).acquire()
        with pytest.raises(StoreUnavailable):
            other.lock(name, ttl="60s", wait="1s").acquire()  # a wait never hides a failure
        with pytest.raises(StoreUnavailable):
            holder.extend()
        assert time.monotonic() - started < 30
    finally:
        running_server.start()
    caps = store.capabilities
    second = other.lock(name, ttl="60s", wait=0)
    if caps.durable and caps.ttl:
        # The lease survived the restart: still the holder's, and no one else's.
        assert second.acquire() is False
        holder.extend()
        assert holder.release() is True
        assert second.acquire() is True
    else:
        # The lease died with the server (or its session): the holder must learn it.
        with pytest.raises(LockLost):
            holder.extend()
        assert holder.lost
        assert second.acquire() is True
    second.release()
    store.close()
    other.close()


# Rerun once, reported as a rerun (pytest-rerunfailures): SIGSTOP on a 2-core machine shared
# by two test workers and a dozen servers has failed three ways under load, each once in
# several runs — an unclosed socket found by the garbage collector (redis+sentinel, mongodb),
# and one call on memcached (asyncio) returning instead of failing. The attempt that
# misbehaved is named below; a failure twice in a row fails the run.
@pytest.mark.flaky(reruns=1)
def test_a_frozen_server_is_unavailable_within_the_timeout(
    store_row: servers.StoreRow,
    running_server: servers.RunningServer,
    store_url: str,
    name: str,
    connect: Callable[[str], latchkey.Store],
) -> None:
    """A server that stops answering while its kernel still acknowledges everything (SIGSTOP:
    a stalled machine) — TCP timeouts never fire and the server's own timers do not run. Every
    call fails with StoreUnavailable within the store's timeout plus latchkey's one-second
    local margin (and at most one connection attempt), on connections opened before and during
    the freeze;
    after the thaw the same store object works again."""
    timeout = 1.0
    store = connect(servers.with_query(store_url, timeout=f"{timeout:g}s"))
    holder = store.lock(name, ttl="60s")
    assert holder.acquire()  # a pooled connection, open and idle when the freeze comes
    other = connect(servers.with_query(store_url, timeout=f"{timeout:g}s"))
    # One statement's local bound (timeout + 1 s) and, where a store asks whether a session that
    # failed has ended or the server is down, one connection attempt (libpq's connect_timeout
    # is at least 2 s); and scheduling slack.
    bound = (timeout + 1.0) + 2.0 + 1.5
    with running_server.frozen():
        for what, attempt in (
            ("extend", lambda: holder.extend()),
            ("inspect", lambda: store.inspect(name)),
            ("acquire on a new connection", lambda: other.lock(name, wait=0).acquire()),
        ):
            started = time.monotonic()
            try:
                answer = attempt()
            except StoreUnavailable:
                pass
            else:
                pytest.fail(f"{what}: answered {answer!r} while the server was frozen")
            took = time.monotonic() - started
            assert took < bound, f"{what}: {took:.1f}s to report the frozen server"
    eventually(lambda: _works(other, name), timeout=30, what="the store works after the thaw")
    store.close()
    other.close()


def _works(store: latchkey.Store, name: str) -> bool:
    try:
        store.inspect(name)
    except StoreUnavailable:
        return False
    return True


def test_a_holder_cut_off_from_its_server_learns_why_its_lease_was_lost(
    store_row: servers.StoreRow,
    store_url: str,
    name: str,
    connect: Callable[[str], latchkey.Store],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renewing holder whose connections are blackholed (a partition that drops packets)
    keeps retrying while its lease lasts, then reports it lost — through on_lost, one warning
    and check() — with the renewal's failure as the reason, not a bare "lease expired"; once
    the network heals, the lease has ended on the server too and someone else gets it."""
    if store_row.server is None:
        pytest.skip(f"{store_row.id}: embedded store, no network to cut")
    if store_row.discovers:  # cluster and Sentinel: tests/contract/test_redis_cluster_specific.py
        pytest.skip(f"{store_row.id}: the client bypasses a proxy at the URL's address")
    found = re.search(r"(127\.0\.0\.1|localhost):(\d+)", store_url)
    assert found, store_url
    proxy = Proxy("127.0.0.1", int(found.group(2)))
    try:
        store = connect(servers.with_query(_with_port(store_url, proxy.port), timeout="300ms"))
        if not store.capabilities.ttl:
            store.close()
            pytest.skip(f"{store_row.id}: the lease lives as long as the session, no TTL to end")
        calls: list[object] = []
        lock = store.lock(name, ttl="2s", renew=True, on_lost=calls.append)
        assert lock.acquire()
        with caplog.at_level(logging.WARNING, logger="latchkey"):
            proxy.set("blackhole")
            eventually(lambda: calls, timeout=15, what="on_lost called by the renewer")
        assert len(calls) == 1 and lock.lost
        lost = [r.message for r in caplog.records if "lost (token" in r.message]
        assert len(lost) == 1 and "could not renew before the lease ended" in lost[0], lost
        with pytest.raises(LockLost, match="could not renew before the lease ended"):
            lock.check()
        proxy.heal()
        other = connect(store_url)
        eventually(
            lambda: other.lock(name, ttl="10s", wait=0).acquire(),
            timeout=15,
            what="the lease ended on the server too",
        )
        other.close()
        store.close()
    finally:
        proxy.close()


def test_an_acquire_whose_answer_was_lost_gives_the_lease_back(
    store_row: servers.StoreRow,
    store_url: str,
    name: str,
    connect: Callable[[str], latchkey.Store],
) -> None:
    """The acquire reaches the server, which grants it, but its answer is lost (a proxy that
    drops the server's replies): the caller gets StoreUnavailable within its timeout, and the
    lease it cannot know it holds is given back in the background once the network heals,
    instead of holding the name until the lease's end."""
    if store_row.server is None:
        pytest.skip(f"{store_row.id}: embedded store, no network to cut")
    if store_row.discovers:  # cluster and Sentinel: the client bypasses a proxy
        pytest.skip(f"{store_row.id}: the client bypasses a proxy at the URL's address")
    found = re.search(r"(127\.0\.0\.1|localhost):(\d+)", store_url)
    assert found, store_url
    proxy = Proxy("127.0.0.1", int(found.group(2)))
    try:
        store = connect(servers.with_query(_with_port(store_url, proxy.port), timeout="1s"))
        other = connect(store_url)
        if not store.capabilities.ttl:
            store.close()
            other.close()
            pytest.skip(f"{store_row.id}: a session lock ends with its connection already")
        with store.lock(f"{name}:warm", ttl="10s"):  # connections open before the fault
            pass
        proxy.set("mute")
        with pytest.raises(latchkey.StoreUnavailable):
            store.lock(name, ttl="60s", wait=0).acquire()
        proxy.heal()
        eventually(  # given back long before the 60 s lease would have ended
            lambda: other.lock(name, ttl="10s", wait=0).acquire(),
            timeout=20,
            what="the lost grant given back",
        )
        other.close()
        store.close()
    finally:
        proxy.close()


def _open_and_lock(url: str, start: Any, out: Any) -> None:
    start.wait()
    try:
        latchkey.connect(url).lock("n", ttl="10s", wait=0).acquire()
        out.put("ok")
    except Exception as exc:  # reported to the parent
        out.put(repr(exc))


def test_sqlite_processes_opening_a_new_file_at_once(tmp_path: Path) -> None:
    """Processes opening a new file at the same moment: the ones that lose the race to switch
    it to WAL mode got "database is locked" at once (SQLite's busy handler does not cover
    that), about one time in forty for two processes. Probabilistic: without the retry this
    test failed in about one run of three here (60 rounds of 8 processes)."""
    ctx = multiprocessing.get_context("fork")
    failures: list[str] = []
    for round_ in range(60):
        url = f"sqlite:///{tmp_path}/new-{round_}.db"
        start, out = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_open_and_lock, args=(url, start, out)) for _ in range(8)]
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        failures += [r for r in results if r != "ok"]
    assert not failures
