"""Row claiming by several processes over one events table, on each SQL store (issue 13):
exactly once for ``take`` (each row's work recorded in the same transaction), also when some
workers are SIGKILLed in the middle of a batch; at least once with strictly increasing
per-row fencing tokens for ``lease``, under kills too; exactly once for ``lease`` whose work
commits with the end of the lease (``complete``), under kills too."""

from __future__ import annotations

import os
import signal
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import servers
from tests.appdb import ROW_STORES, AppDB
from tests.helpers import eventually
from tests.multiprocess import rows_workers

EVENTS = 240
WORKERS = 5


@pytest.fixture
def db(store_row: servers.StoreRow, store_url: str) -> Iterator[AppDB]:
    if store_row.id not in ROW_STORES:
        pytest.skip(f"{store_row.id} claims no rows")
    app = AppDB(store_url)
    try:
        yield app
    finally:
        app.close()


def run_round(
    db: AppDB, spawn: Callable[..., Any], worker: Callable[..., Any], args: tuple[Any, ...],
    kill: int,
) -> None:  # fmt: skip
    """``WORKERS`` workers; ``kill`` of them SIGKILLed once a fifth of the rows are done (in
    the middle of a batch: each row pauses), and as many started in their place; every
    survivor must end cleanly."""
    procs = [spawn(worker, *args) for _ in range(WORKERS)]
    killed = []
    if kill:
        done = args[2]
        eventually(
            lambda: db.execute(f"SELECT count(*) FROM {done}")[0][0] >= EVENTS // 5,
            timeout=60, what="the workers under way",
        )  # fmt: skip
        for proc in procs[:kill]:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc)
        procs += [spawn(worker, *args) for _ in range(kill)]
    for proc in procs:
        proc.join(timeout=120)
        if proc in killed:
            assert proc.exitcode == -signal.SIGKILL
        else:
            assert proc.exitcode == 0, f"worker {proc.pid} exited with {proc.exitcode}"


@pytest.mark.parametrize("kill", [0, 2], ids=["clean", "sigkill"])
def test_take_is_exactly_once(db: AppDB, store_url: str, spawn: Any, kill: int) -> None:
    events, done = db.create_events(EVENTS), db.create_done()
    pause = 0.02 if kill else 0.002
    run_round(db, spawn, rows_workers.take_worker, (store_url, events, done, 5, pause), kill)
    counts = Counter(row[0] for row in db.execute(f"SELECT event_id FROM {done}"))
    assert sorted(counts) == list(range(1, EVENTS + 1))  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    left = db.execute(f"SELECT count(*) FROM {events} WHERE processed_at IS NULL")
    assert left == [(0,)]


@pytest.mark.parametrize("kill", [0, 2], ids=["clean", "sigkill"])
def test_lease_is_at_least_once_with_increasing_tokens(
    db: AppDB, store_url: str, spawn: Any, kill: int
) -> None:
    events, done = db.create_events(EVENTS), db.create_done()
    pause = 0.02 if kill else 0.002
    run_round(db, spawn, rows_workers.lease_worker, (store_url, events, done, 5, pause), kill)
    tokens: dict[int, list[int]] = defaultdict(list)
    for event_id, token in db.execute(f"SELECT event_id, token FROM {done} ORDER BY seq"):
        tokens[event_id].append(token)
    assert sorted(tokens) == list(range(1, EVENTS + 1))  # nothing lost
    for event_id, seen in tokens.items():
        assert seen == sorted(set(seen)), f"row {event_id}: tokens {seen}"
    if not kill:
        assert all(len(seen) == 1 for seen in tokens.values())  # no crash: once each
    left = db.execute(f"SELECT count(*) FROM {events} WHERE processed_at IS NULL")
    assert left == [(0,)]


@pytest.mark.parametrize("kill", [0, 2], ids=["clean", "sigkill"])
def test_lease_with_complete_is_exactly_once(
    db: AppDB, store_url: str, spawn: Any, kill: int
) -> None:
    events, done = db.create_events(EVENTS), db.create_done()
    pause = 0.02 if kill else 0.002
    run_round(db, spawn, rows_workers.complete_worker, (store_url, events, done, 5, pause), kill)
    counts = Counter(row[0] for row in db.execute(f"SELECT event_id FROM {done}"))
    assert sorted(counts) == list(range(1, EVENTS + 1))  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    left = db.execute(f"SELECT count(*) FROM {events} WHERE processed_at IS NULL")
    assert left == [(0,)]
