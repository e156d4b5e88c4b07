"""``LockInfo.waiting_processes`` and ``latchkey ls``'s PROCS WAITING, with real processes
waiting: on the Redis stores, the subscribers of a name's wake channel; on ZooKeeper, the
processes whose nodes wait in line (told apart by the owner record each node carries)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

import latchkey
from latchkey import cli
from tests import servers
from tests.helpers import eventually
from tests.multiprocess import workers

#: The stores that can tell how many processes wait (the others answer None: see
#: tests/contract/test_mutex.py).
STORE_ROWS = {"redis", "redis+sentinel", "redis+cluster", "zookeeper"}


def _waiting(store: latchkey.Store, name: str) -> int | None:
    info = store.inspect(name)
    return None if info is None else info.waiting_processes


def _ls(url: str, name: str, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    capsys.readouterr()
    assert cli.main(["--url", url, "ls", "--prefix", name, *extra]) == 0
    return capsys.readouterr().out


def test_waiting_processes_counts_the_processes_that_wait(
    store: latchkey.Store,
    store_url: str,
    name: str,
    spawn: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A TTL far beyond the test's length: on a loaded machine the four processes have taken
    # most of a minute to get in line, and a 60 s lease then ran out under them (ZooKeeper
    # then counts its first waiter as the holder: seen as 3 waiting processes, not 4).
    holder = store.lock(name, ttl="10m", wait=0)
    assert holder.acquire()
    assert _waiting(store, name) == 0
    assert not store.lock(name, wait=0).acquire()  # a try that does not wait never counts
    assert _waiting(store, name) == 0
    # Four processes wait: two with one thread each, one with two threads (one store), one
    # with two coroutines (one AsyncStore): each store's waiters share one subscription.
    # The first is killed below; on ZooKeeper its node goes when its session expires: a
    # session of 5 s, not the tests' 30 s (tests/servers/zookeeper.py), ends the wait sooner.
    doomed = store_url
    if store.scheme == "zookeeper":
        doomed = servers.with_query(store_url, session_timeout="5s")
    procs = [
        spawn(workers.wait_in_turn, doomed, name, 1, "sync"),
        spawn(workers.wait_in_turn, store_url, name, 1, "sync"),
        spawn(workers.wait_in_turn, store_url, name, 2, "sync"),
        spawn(workers.wait_in_turn, store_url, name, 2, "async"),
    ]
    eventually(lambda: _waiting(store, name) == 4, timeout=60, what="four processes wait")
    (listed,) = [info for info in store.list(prefix=name) if info.name == name]
    assert listed.waiting_processes == 4

    table = _ls(store_url, name, capsys).splitlines()
    assert table[0].split()[-2:] == ["PROCS", "WAITING"]
    assert table[1].split()[0] == name and table[1].split()[-1] == "4"
    (entry,) = json.loads(_ls(store_url, name, capsys, "--json"))
    assert entry["name"] == name and entry["waiting_processes"] == 4

    # Its connection closes (ZooKeeper: its session ends, its node goes): one fewer waits.
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(timeout=10)
    eventually(lambda: _waiting(store, name) == 3, timeout=30, what="three processes wait")

    assert holder.release()  # the others take it in turn and leave
    for proc in procs[1:]:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert store.inspect(name) is None
