"""The Celery app that tests/contrib/test_celery_prefork.py runs in a prefork worker (a
subprocess: ``celery -A tests.contrib.celery_prefork_app worker --pool prefork``). Its broker,
queue and lock store come from the environment the test sets."""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, signals

from latchkey.contrib.celery import Singleton, store_for

BROKER = os.environ.get("PREFORK_TEST_BROKER", "memory://")
STORE = os.environ.get("PREFORK_TEST_STORE")

app = Celery("prefork", broker=BROKER, backend=BROKER if BROKER != "memory://" else None)
app.conf.update(
    task_default_queue=os.environ.get("PREFORK_TEST_QUEUE", "prefork"),
    latchkey_url=STORE,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,  # a child busy with a task takes no other
)


@signals.worker_init.connect
def _warm_up(**_: Any) -> None:
    """Open the store in the worker's main process before it forks its pool, as an app that
    touches its locks at import would: each child must still use connections of its own."""
    store_for(STORE).is_free("prefork:warm-up")
    print(f"store opened in the main process {os.getpid()}", flush=True)


@app.task(base=Singleton, name="prefork.hold", lock_keys=["key"], bind=True)
def hold(self: Singleton, key: str, gate: str) -> dict[str, Any]:
    """Hold ``key``'s lock until the test pushes to ``<gate>:go``; say so on
    ``<gate>:started``. Returns who ran it and who the store says holds the lock."""
    lock = self.current_lock
    assert lock is not None
    client = redis.Redis.from_url(BROKER)
    try:
        client.rpush(f"{gate}:started", os.getpid())
        if client.blpop([f"{gate}:go"], timeout=60) is None:
            raise TimeoutError(f"{gate}: the test never let the task go")
        info = self.latchkey_store.inspect(lock.name)  # asked while the other child works too
    finally:
        client.close()
    assert info is not None
    return {"pid": os.getpid(), "owner_pid": info.owner.pid, "token": lock.token}
