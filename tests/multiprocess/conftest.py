"""Fixtures of the multi-process tests."""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: The drivers the workers' stores import, where installed (a missing one is not preloaded).
DRIVERS = ["redis", "redis.asyncio", "psycopg", "psycopg_pool", "pymysql", "asyncmy",
           "pymemcache", "pymongo", "kazoo.client", "httpx"]  # fmt: skip

#: Children come from a fork server (multiprocessing's "forkserver"): a fresh interpreter,
#: started once per test worker, that imported latchkey, its drivers and the workers' modules;
#: each child is forked from it. So a child holds no connection, lock or state of the test
#: process (as with "spawn") and is a process of its own, but does not import them again:
#: 8 spawned children took 1.1-1.4 s to reach their first statement, 8 forked ones ~0.2 s.
#: (Forked from a process that imported latchkey, each child also goes through the fork
#: handlers an application's forked workers go through.)
ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(
    ["latchkey", "tests.multiprocess.workers", "tests.multiprocess.rows_workers"]
    + [m for m in DRIVERS if importlib.util.find_spec(m.split(".")[0]) is not None]
)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """Start a process (forked from the fork server above: no inherited connections); every one
    still alive at the end of the test is killed."""
    started: list[Any] = []

    def start(target: Callable[..., Any], *args: Any) -> Any:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
