"""The Celery app that tests/contrib/test_celery_green.py runs in a worker under the gevent or
eventlet pool (a subprocess: ``celery -A tests.contrib.celery_green_app worker -P gevent``):
the worker monkey-patches the standard library before it imports this module. Its broker,
queue and lock stores come from the environment the test sets.

One task per store, ``green.hold.<store>``, with a lease of one second, shorter than the runs:
each run holds its lock until the test says go, sleeping with ``time.sleep`` (patched: the
greenlet yields, and the renewer greenlet runs meanwhile). ``green.spin`` never yields for
three leases, as a CPU-bound task would."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from latchkey.contrib.celery import Singleton

BROKER = os.environ.get("GREEN_TEST_BROKER", "memory://")
#: store -> URL, e.g. {"redis": "redis://…?prefix=…", "postgresql": …, "sqlite": …}
STORES: dict[str, str] = json.loads(os.environ.get("GREEN_TEST_STORES", "{}"))
TTL = 1.0  # seconds: every run outlives several leases
LIMIT = 60  # seconds a run waits for the test's go

app = Celery("green", broker=BROKER, backend=BROKER if BROKER != "memory://" else None)
app.conf.update(
    task_default_queue=os.environ.get("GREEN_TEST_QUEUE", "green"),
    broker_connection_retry_on_startup=True,
)


def _hold(task: Singleton, key: str, gate: str) -> dict[str, Any]:
    """Say on ``<gate>:started`` which token the run holds, then sleep in small steps until
    ``<gate>:go`` exists; return the token and whether the lease was lost meanwhile."""
    lock = task.current_lock
    assert lock is not None
    client = redis.Redis.from_url(BROKER)
    try:
        client.rpush(f"{gate}:started", json.dumps({"pid": os.getpid(), "token": lock.token}))
        deadline = time.monotonic() + LIMIT
        while not client.exists(f"{gate}:go"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate}: the test never let the task go")
            time.sleep(0.05)
    finally:
        client.close()
    return {"token": lock.token, "lost": lock.lost}


for _store, _url in STORES.items():
    app.task(
        _hold, base=Singleton, name=f"green.hold.{_store}", bind=True, lock_keys=["key"],
        lock_ttl=TTL, latchkey_url=_url,
    )  # fmt: skip


@app.task(base=Singleton, name="green.spin", bind=True, lock_ttl=TTL,
          latchkey_url=STORES.get("redis"))  # fmt: skip
def spin(self: Singleton, key: str) -> dict[str, Any]:
    """Keep the CPU busy for three leases without yielding (the renewer greenlet cannot run),
    then yield once: the renewer finds the lease gone."""
    lock = self.current_lock
    assert lock is not None
    end = time.monotonic() + 3 * TTL
    while time.monotonic() < end:
        pass
    for _ in range(100):  # yield until the renewer has run (at most 5 s)
        time.sleep(0.05)
        if lock.lost:
            break
    return {"token": lock.token, "lost": lock.lost}
