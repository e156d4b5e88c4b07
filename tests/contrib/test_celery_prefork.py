"""latchkey.contrib.celery under a real prefork worker (``celery worker --pool prefork
--concurrency 2``, a subprocess) with the suite's Redis as broker, result backend and lock
store: each pool process opens the store's connections of its own after the fork (the worker's
main process opened the store before forking: tests/contrib/celery_prefork_app.py), and a
duplicate run in the other pool process is skipped while the first holds the lock."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("celery", reason="latchkey[celery] is not installed")

import redis
from celery import Celery

import latchkey
from latchkey.contrib.celery import lock_name
from tests.conftest import ServerPool
from tests.helpers import eventually
from tests.servers import ServerUnavailable

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds a step may take on a loaded machine


@pytest.fixture
def redis_base(server_pool: ServerPool) -> str:
    try:
        return server_pool.base_url("redis")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"redis: server required in CI but unavailable: {exc}")
        pytest.skip(f"redis: not run: {exc}")


class Worker:
    """A prefork worker in a subprocess of its own session, and what it logged."""

    def __init__(self, redis_base: str, tmp_path: Path) -> None:
        tag = uuid.uuid4().hex[:12]
        self.queue = f"q{tag}"
        self.store_url = f"{redis_base}?prefix=t{tag}:"
        self.log = tmp_path / "worker.log"
        env = {
            **os.environ,
            "PREFORK_TEST_BROKER": redis_base,
            "PREFORK_TEST_QUEUE": self.queue,
            "PREFORK_TEST_STORE": self.store_url,
            "PYTHONPATH": str(ROOT),
        }
        env.pop("LATCHKEY_URL", None)
        command = [
            sys.executable, "-m", "celery", "-A", "tests.contrib.celery_prefork_app", "worker",
            "--pool", "prefork", "--concurrency", "2", "-O", "fair", "--loglevel", "INFO",
            "-Q", self.queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--hostname", f"prefork-{tag}@%h",
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Warm shutdown (SIGTERM: the pool processes finish and exit); SIGKILL to the
        worker's own process group if it is still there after the timeout."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(TIMEOUT)


@pytest.fixture
def worker(redis_base: str, tmp_path: Path) -> Iterator[Worker]:
    started = Worker(redis_base, tmp_path)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def client(redis_base: str, worker: Worker) -> Iterator[Celery]:
    app = Celery("prefork-client", broker=redis_base, backend=redis_base, set_as_current=False)
    app.conf.update(task_default_queue=worker.queue, broker_connection_retry_on_startup=True)
    yield app
    gc.collect()  # AsyncResults unsubscribe when collected: now, while Redis runs
    app.close()


def test_each_pool_process_opens_its_own_store_and_a_duplicate_is_skipped(
    redis_base: str, worker: Worker, client: Celery
) -> None:
    key, other_key = uuid.uuid4().hex, uuid.uuid4().hex
    gate_a, gate_b = f"g{uuid.uuid4().hex}", f"g{uuid.uuid4().hex}"
    gates = redis.Redis.from_url(redis_base)
    try:
        first = client.send_task("prefork.hold", (key, gate_a))
        started = gates.blpop([f"{gate_a}:started"], timeout=TIMEOUT)
        assert started is not None, f"the first task never started\n{worker.output()}"
        first_pid = int(started[1])
        assert first_pid != worker.process.pid  # a pool process, not the worker itself
        # the store was opened (connected) in the worker's main process, before the fork
        assert f"store opened in the main process {worker.process.pid}" in worker.output()

        # the same key: the other pool process runs it, finds the lock held and skips it
        duplicate = client.send_task("prefork.hold", (key, f"g{uuid.uuid4().hex}"))
        assert duplicate.get(timeout=TIMEOUT) is None
        name = lock_name("prefork.hold", {"key": key})
        eventually(
            lambda: (
                f"skipped, {name!r} is held" in worker.output()
                and f"in pid {first_pid} on" in worker.output()
            ),
            timeout=TIMEOUT,
            what="the duplicate's log line naming the holder's pid",
        )

        # another key runs beside the first, in the other pool process
        second = client.send_task("prefork.hold", (other_key, gate_b))
        started = gates.blpop([f"{gate_b}:started"], timeout=TIMEOUT)
        assert started is not None, f"the second task never started\n{worker.output()}"
        second_pid = int(started[1])
        assert second_pid not in (first_pid, worker.process.pid)

        gates.rpush(f"{gate_a}:go", 1)
        gates.rpush(f"{gate_b}:go", 1)
        done_first, done_second = first.get(timeout=TIMEOUT), second.get(timeout=TIMEOUT)
    finally:
        gates.close()
    # each pool process holds its leases as itself, over connections of its own
    assert done_first["pid"] == done_first["owner_pid"] == first_pid
    assert done_second["pid"] == done_second["owner_pid"] == second_pid
    with latchkey.connect(worker.store_url) as store:
        assert store.is_free(name)  # released when the task returned
        assert store.is_free(lock_name("prefork.hold", {"key": other_key}))
