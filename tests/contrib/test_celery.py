"""latchkey.contrib.celery with a real Celery worker (a thread pool of 4, in this process)
and a real Redis as broker, result backend and lock store (the suite's Redis server)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("celery", reason="latchkey[celery] is not installed")

from celery import Celery
from celery.contrib.testing.worker import start_worker

import latchkey
from latchkey import ConfigError
from latchkey.contrib.celery import Singleton, lock_name
from tests.conftest import ServerPool
from tests.helpers import eventually
from tests.servers import ServerUnavailable

TIMEOUT = 60  # seconds a result may take on a loaded machine

#: What the tasks did, and the gates that hold them, by a key of each test's own.
EVENTS: list[str] = []
GATES: dict[str, threading.Event] = {}
TOKENS: dict[str, list[int]] = {}


def gate(key: str) -> threading.Event:
    return GATES.setdefault(key, threading.Event())


@pytest.fixture(scope="module")
def redis_base(server_pool: ServerPool) -> str:
    try:
        return server_pool.base_url("redis")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"redis: server required in CI but unavailable: {exc}")
        pytest.skip(f"redis: not run: {exc}")


@pytest.fixture(scope="module")
def app(redis_base: str) -> Iterator[Celery]:
    tag = uuid.uuid4().hex[:12]
    app = Celery(f"t{tag}", broker=redis_base, backend=redis_base, set_as_current=False)
    app.conf.update(
        task_default_queue=f"q{tag}",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        latchkey_url=f"{redis_base}?prefix=t{tag}:",
    )

    @app.task(base=Singleton, name="t.hold", lock_keys=["key"], lock_ttl="3s")
    def hold(key: str, note: str = "") -> int:
        lock = hold.current_lock
        assert lock is not None
        EVENTS.append(f"start {key} {note}")
        assert gate(key).wait(TIMEOUT)
        EVENTS.append(f"end {key} {note}")
        return int(lock.token)

    @app.task(base=Singleton, name="t.fail")
    def fail(key: str) -> None:
        raise ValueError(f"failed {key}")

    @app.task(base=Singleton, name="t.flaky", bind=True)
    def flaky(self: Singleton, key: str) -> list[int]:
        tokens = TOKENS.setdefault(key, [])
        lock = self.current_lock
        assert lock is not None and lock.token is not None
        tokens.append(lock.token)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return list(tokens)

    @app.task(
        base=Singleton,
        name="t.queued",
        lock_keys=["key"],
        on_busy="retry",
        busy_countdown=0.2,
        max_retries=None,
    )
    def queued(key: str) -> str:
        EVENTS.append(f"queued {key}")
        return "done"

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        yield app
    # The tests' AsyncResults unsubscribe from their results when collected: collect them now,
    # while Redis runs, not at interpreter exit after the suite stopped it (a ConnectionError
    # raised in __del__ then fails the run).
    gc.collect()
    app.close()


@pytest.fixture
def store(app: Celery) -> Iterator[latchkey.Store]:
    with latchkey.connect(app.conf.latchkey_url) as store:
        yield store


def test_a_duplicate_is_skipped_while_the_first_runs_and_the_lock_ends_with_it(
    app: Celery, store: latchkey.Store, caplog: pytest.LogCaptureFixture
) -> None:
    key, hold = uuid.uuid4().hex, app.tasks["t.hold"]
    name = lock_name("t.hold", {"key": key})
    first = hold.delay(key, "first")
    eventually(lambda: f"start {key} first" in EVENTS, timeout=TIMEOUT, what="first running")
    assert not store.is_free(name)
    with caplog.at_level(logging.INFO, logger="latchkey.contrib.celery"):
        # a duplicate: same key (the note is not part of it) → skipped, returns None
        assert hold.delay(key, "second").get(timeout=TIMEOUT) is None
    assert any("skipped" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    other = uuid.uuid4().hex  # another key runs alongside
    gate(other).set()
    assert hold.delay(other).get(timeout=TIMEOUT) > 0
    gate(key).set()
    assert first.get(timeout=TIMEOUT) > 0
    assert store.is_free(name)  # released before the result was stored
    assert f"start {key} second" not in EVENTS


def test_the_lease_is_renewed_while_the_task_runs(app: Celery, store: latchkey.Store) -> None:
    key = uuid.uuid4().hex
    name = lock_name("t.hold", {"key": key})
    result = app.tasks["t.hold"].delay(key)
    first = eventually(lambda: store.inspect(name), timeout=TIMEOUT, what="lock taken")

    def renewed() -> bool:
        now = store.inspect(name)
        assert now is not None and now.token == first.token  # the same lease, never lost
        return bool(now.expires_at and first.expires_at and now.expires_at > first.expires_at)

    eventually(renewed, timeout=TIMEOUT, what="the lease extended")
    gate(key).set()
    assert result.get(timeout=TIMEOUT) == first.token
    assert store.is_free(name)


def test_a_failure_releases_the_lock(app: Celery, store: latchkey.Store) -> None:
    key = uuid.uuid4().hex
    with pytest.raises(ValueError, match=f"failed {key}"):
        app.tasks["t.fail"].delay(key).get(timeout=TIMEOUT)
    assert store.is_free(lock_name("t.fail", {"key": key}))


def test_a_retry_releases_the_lock_and_the_next_attempt_takes_it_again(app: Celery) -> None:
    key = uuid.uuid4().hex
    tokens = app.tasks["t.flaky"].delay(key).get(timeout=TIMEOUT)
    # the retry ran (a held lock would have made it a skipped duplicate) under a new lease
    assert len(tokens) == 2 and tokens[1] > tokens[0]


def test_on_busy_retry_runs_the_duplicate_after_the_holder(
    app: Celery, store: latchkey.Store
) -> None:
    key = uuid.uuid4().hex
    # this test holds the task's lock, as another worker running it would
    with store.lock(lock_name("t.queued", {"key": key}), ttl="1m"):
        later = app.tasks["t.queued"].delay(key)
        eventually(lambda: later.state == "RETRY", timeout=TIMEOUT, what="the duplicate retried")
        assert f"queued {key}" not in EVENTS
    assert later.get(timeout=TIMEOUT) == "done"  # a later attempt found the lock free
    assert f"queued {key}" in EVENTS


def test_the_lock_name_is_stable_and_short_enough() -> None:
    assert lock_name("t", {"b": 2, "a": [1, "x"]}) == 'celery:t:{"a":[1,"x"],"b":2}'
    assert lock_name("t", {"a": [1, "x"], "b": 2}) == lock_name("t", {"b": 2, "a": [1, "x"]})
    long = lock_name("t", {"a": "é" * 300})
    assert long.startswith("celery:t:sha256:") and len(long.encode()) <= 255
    assert lock_name("t" * 300, {}).startswith("celery:sha256:")
    assert lock_name("t", {"a": 1}) != lock_name("t", {"a": "1"})


def test_lock_keys_choose_the_arguments_and_are_checked(app: Celery) -> None:
    hold: Any = app.tasks["t.hold"]
    assert hold.lock_name_for(("k",), {"note": "x"}) == hold.lock_name_for((), {"key": "k"})
    bad = type("Bad", (Singleton,), {"name": "t.bad", "lock_keys": ["nope"], "run": hold.run})
    with pytest.raises(ConfigError, match=r"lock_keys \['nope'\] are not arguments"):
        bad().lock_name_for(("k",), {})
    with pytest.raises(ConfigError, match=r"task t\.hold"):
        hold.lock_name_for((), {"unknown": 1})
