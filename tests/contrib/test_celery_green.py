"""latchkey.contrib.celery under a real worker with a green pool (``celery worker -P gevent``
and ``-P eventlet``, a subprocess that monkey-patches the standard library: threads become
greenlets, sockets and ``time.sleep`` cooperative) with the suite's Redis as broker and result
backend, and locks on Redis, PostgreSQL, SQLite and memcached
(tests/contrib/celery_green_app.py).

For each store, in one worker: a duplicate queued while the first run holds the lock is
skipped; a run that outlives its one-second lease several times keeps it (the renewer greenlet
renews it: the token is unchanged and a duplicate sent later is still skipped); the lock is
free when the run returns; and the lease of a worker killed with SIGKILL ends by its TTL. Under
gevent, a task that keeps the CPU without yielding for longer than its lease loses it, and
that is reported (``lock.lost``, a WARNING), not silent. And a PostgreSQL or memcached server
that stops answering (a proxy that swallows the traffic) fails a call by its deadline under
gevent instead of hanging."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery", reason="latchkey[celery] is not installed")

import redis
from celery import Celery

import latchkey
from latchkey.contrib.celery import lock_name
from tests.conftest import ServerPool
from tests.faults.proxy import Proxy
from tests.helpers import eventually
from tests.servers import ServerUnavailable

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds a step may take on a loaded machine
TTL = 1.0  # the tasks' lease (celery_green_app.TTL)


def _base(server_pool: ServerPool, kind: str) -> str:
    try:
        return server_pool.base_url(kind)
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{kind}: server required in CI but unavailable: {exc}")
        pytest.skip(f"{kind}: not run: {exc}")


def _installed(library: str) -> None:
    """Skip unless ``library`` is installed, without importing it here: eventlet, once
    imported, warns at every fork (and warnings are errors in this suite)."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")


class Worker:
    """A worker under a green pool in a subprocess of its own session, and what it logged."""

    def __init__(self, pool: str, broker: str, stores: dict[str, str], tmp_path: Path) -> None:
        tag = uuid.uuid4().hex[:12]
        self.queue = f"q{tag}"
        self.pool, self.broker, self.stores = pool, broker, stores
        self.log = tmp_path / "worker.log"
        env = {
            **os.environ,
            "GREEN_TEST_BROKER": broker,
            "GREEN_TEST_QUEUE": self.queue,
            "GREEN_TEST_STORES": json.dumps(stores),
            "PYTHONPATH": str(ROOT),
        }
        env.pop("LATCHKEY_URL", None)
        command = [
            sys.executable, "-m", "celery", "-A", "tests.contrib.celery_green_app", "worker",
            "--pool", pool, "--concurrency", "10", "--loglevel", "INFO", "-Q", self.queue,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--hostname", f"{pool}-{tag}@%h",
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(TIMEOUT)


@pytest.fixture(params=["gevent", "eventlet"])
def worker(
    request: pytest.FixtureRequest, server_pool: ServerPool, tmp_path: Path
) -> Iterator[Worker]:
    _installed(request.param)
    redis_base = _base(server_pool, "redis")
    tag = uuid.uuid4().hex[:12]
    stores = {
        "redis": f"{redis_base}?prefix=t{tag}:",
        "postgresql": _base(server_pool, "postgresql"),
        "sqlite": f"sqlite:///{tmp_path}/locks-{tag}.db",
        "memcached": f"{_base(server_pool, 'memcached')}?prefix=t{tag}:",
    }
    started = Worker(request.param, redis_base, stores, tmp_path)
    try:
        yield started
    finally:
        started.kill()


@pytest.fixture
def client(worker: Worker) -> Iterator[Celery]:
    app = Celery("green-client", broker=worker.broker, backend=worker.broker, set_as_current=False)
    app.conf.update(task_default_queue=worker.queue, broker_connection_retry_on_startup=True)
    yield app
    gc.collect()  # AsyncResults unsubscribe when collected: now, while Redis runs
    app.close()


class Runs:
    """Starts ``green.hold.<store>`` runs and lets them go, through gates in Redis."""

    def __init__(self, client: Celery, worker: Worker) -> None:
        self.client, self.worker = client, worker
        self.gates = redis.Redis.from_url(client.conf.broker_url)

    def start(self, store: str, key: str) -> tuple[Any, str]:
        gate = f"g{uuid.uuid4().hex}"
        return self.client.send_task(f"green.hold.{store}", (key, gate)), gate

    def started(self, gate: str) -> dict[str, Any]:
        popped = self.gates.blpop([f"{gate}:started"], timeout=TIMEOUT)
        assert popped is not None, f"{gate}: the run never started\n{self.worker.output()}"
        return json.loads(popped[1])  # type: ignore[no-any-return]

    def go(self, gate: str) -> None:
        self.gates.set(f"{gate}:go", 1, ex=TIMEOUT)


def holder_token(store: latchkey.Store, name: str) -> int | None:
    info = store.inspect(name)
    return None if info is None else info.token


def test_green_pool_renews_skips_duplicates_releases_and_a_killed_workers_lease_ends(
    worker: Worker, client: Celery
) -> None:
    runs = Runs(client, worker)
    stores = {kind: latchkey.connect(url) for kind, url in worker.stores.items()}
    try:
        # one run per store, all at once: they hold their locks side by side in one process
        keys = {kind: uuid.uuid4().hex for kind in stores}
        first = {kind: runs.start(kind, keys[kind]) for kind in stores}
        tokens = {kind: runs.started(gate)["token"] for kind, (_, gate) in first.items()}
        names = {kind: lock_name(f"green.hold.{kind}", {"key": keys[kind]}) for kind in stores}
        for kind, store in stores.items():
            assert holder_token(store, names[kind]) == tokens[kind], kind

        # a duplicate while the first runs: skipped, in another greenlet of the same worker
        duplicates = {kind: runs.start(kind, keys[kind])[0] for kind in stores}
        for kind, result in duplicates.items():
            assert result.get(timeout=TIMEOUT) is None, kind

        # three leases later the first runs still hold their locks, under the same tokens,
        # and a duplicate is still skipped: the renewer greenlets renewed them
        time.sleep(3 * TTL)  # (the runs must outlive their leases: a span of time is the point)
        for kind, store in stores.items():
            assert holder_token(store, names[kind]) == tokens[kind], kind
        late = {kind: runs.start(kind, keys[kind])[0] for kind in stores}
        for kind, result in late.items():
            assert result.get(timeout=TIMEOUT) is None, kind

        # let them go: each returns its token, lease never lost, and the lock is free
        for _, gate in first.values():
            runs.go(gate)
        for kind, (result, _) in first.items():
            assert result.get(timeout=TIMEOUT) == {"token": tokens[kind], "lost": False}, kind
            assert store_is_free(stores[kind], names[kind]), kind
        skipped = worker.output().count(" is held (by task ")
        assert skipped == 2 * len(stores), worker.output()

        if worker.pool == "gevent":
            # a run that keeps the CPU for three leases without yielding starves the renewer
            # greenlet: the lease ends meanwhile, and that is reported once it yields again
            key = uuid.uuid4().hex
            spun = client.send_task("green.spin", (key,)).get(timeout=TIMEOUT)
            assert spun["lost"] is True, worker.output()
            name = lock_name("green.spin", {"key": key})
            assert f"lock {name!r} lost (token {spun['token']})" in worker.output()
            assert store_is_free(stores["redis"], name)

        # a worker killed while its runs hold their locks: each lease ends by its TTL
        keys = {kind: uuid.uuid4().hex for kind in stores}
        held = {kind: runs.start(kind, keys[kind]) for kind in stores}
        names = {kind: lock_name(f"green.hold.{kind}", {"key": keys[kind]}) for kind in stores}
        for _, gate in held.values():
            runs.started(gate)
        for kind, store in stores.items():
            assert not store_is_free(store, names[kind]), kind
        worker.kill()
        for kind, store in stores.items():
            eventually(
                lambda store=store, name=names[kind]: store_is_free(store, name),
                timeout=TIMEOUT, what=f"{kind}: the killed worker's lease ended",
            )  # fmt: skip
        assert "Traceback" not in worker.output(), worker.output()
        if worker.pool == "eventlet" and "PSYCOPG_WAIT_FUNC" not in os.environ:
            # psycopg's own waits stay in C under eventlet: said once, with the way out
            assert worker.output().count("PSYCOPG_WAIT_FUNC=wait_select") == 1, worker.output()
    finally:
        runs.gates.close()
        for store in stores.values():
            store.close()


def store_is_free(store: latchkey.Store, name: str) -> bool:
    return store.is_free(name)


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+advisory", "memcached", "redis"])
def test_a_frozen_server_fails_the_call_by_its_deadline_under_gevent(
    server_pool: ServerPool, scheme: str
) -> None:
    """Under gevent a server that stops answering hung: on PostgreSQL the whole process
    (libpq's blocking ``PQexecPrepared``, the sync driver's hot statements, stopped the hub,
    and with it the watchdog greenlet that cuts a call past its deadline), on memcached the
    call (its deadline was the kernel's socket timeout, which a gevent socket never sees).
    Now the call fails by the store's timeout and the other greenlets run meanwhile (Redis:
    redis-py's socket timeouts did so already)."""
    _installed("gevent")
    base = _base(server_pool, scheme.partition("+")[0])
    found = re.search(r"(127\.0\.0\.1|localhost):(\d+)", base)
    assert found, base
    proxy = Proxy("127.0.0.1", int(found.group(2)))
    url = base[: found.start(2)] + str(proxy.port) + base[found.end(2) :]
    url = url.replace("postgresql", scheme, 1)
    url += ("&" if "?" in url else "?") + "timeout=1s"
    script = ROOT / "tests" / "contrib" / "green_frozen.py"
    child = subprocess.Popen(
        [sys.executable, str(script), url, f"frozen-{uuid.uuid4().hex}"], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        ready = child.stdout.readline()
        assert ready == "ready\n", ready + child.stdout.read()
        proxy.set("blackhole")
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            out, _ = child.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the process hung on the frozen server (every greenlet stopped)")
        answer = json.loads(out.splitlines()[-1])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        proxy.close()
    assert answer["error"] is not None, answer  # StoreUnavailable: no answer within …
    assert answer["took"] < 10, answer
    assert answer["max_gap"] < 1.0, answer  # the other greenlets ran meanwhile
