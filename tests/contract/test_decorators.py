"""@store.singleton (run at most once at a time, ShedLock-style) and @store.locked."""

from __future__ import annotations

import logging
import threading

import pytest

import latchkey
from latchkey import ConfigError
from tests.helpers import eventually


def test_singleton_runs_when_free(store: latchkey.Store, name: str) -> None:
    @store.singleton(name, at_most="30s")
    def job(x: int) -> int:
        assert not store.is_free(name)
        return x * 2

    assert job(21) == 42
    assert store.is_free(name)  # no at_least: released at once
    assert job.__name__ == "job"


def test_singleton_skips_when_held(
    store: latchkey.Store, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    @store.singleton(name, at_most="30s")
    def job() -> str:
        calls.append(1)
        return "ran"

    with store.lock(name, ttl="30s"), caplog.at_level(logging.INFO, logger="latchkey"):
        assert job() is None
    assert calls == []
    assert any("skipped" in r.getMessage() and name in r.getMessage() for r in caplog.records)
    assert job() == "ran"


@pytest.mark.requires("ttl")
def test_singleton_keeps_the_lock_at_least(store: latchkey.Store, name: str) -> None:
    runs: list[int] = []

    @store.singleton(name, at_most="30s", at_least="1s")
    def job() -> None:
        runs.append(1)

    job()
    assert not store.is_free(name)  # finished at once, but held for at_least
    job()  # a node whose schedule fires a little later skips this tick
    assert runs == [1]
    eventually(lambda: store.is_free(name), what="at_least to pass")
    job()
    assert runs == [1, 1]


def test_singleton_releases_when_the_job_raises(store: latchkey.Store, name: str) -> None:
    @store.singleton(name, at_most="30s")
    def job() -> None:
        raise ValueError("failed")

    with pytest.raises(ValueError):
        job()
    assert store.is_free(name)


def test_singleton_bad_durations(store: latchkey.Store, name: str) -> None:
    with pytest.raises(ConfigError, match="at_least"):
        store.singleton(name, at_most="1m", at_least="2m")
    with pytest.raises(ConfigError, match="at_most"):
        store.singleton(name, at_most="sometimes")


def test_locked_formats_the_name_and_excludes(store: latchkey.Store, name: str) -> None:
    seen: list[bool] = []

    @store.locked(name + ":user:{user_id}", ttl="30s")
    def recalc(user_id: int, *, verbose: bool = False) -> int:
        seen.append(store.is_free(f"{name}:user:{user_id}"))
        return user_id

    assert recalc(7) == 7
    assert seen == [False]
    assert store.is_free(f"{name}:user:7")


def test_locked_blocks_until_free(store: latchkey.Store, name: str) -> None:
    order: list[str] = []
    holder = store.lock(f"{name}:1", ttl="60s")
    holder.acquire()

    @store.locked(name + ":{n}", ttl="60s", wait="30s")
    def work(n: int) -> None:
        order.append("work")

    t = threading.Thread(target=work, args=(1,))
    t.start()
    eventually(t.is_alive, what="worker started")
    order.append("release")
    holder.release()
    t.join(timeout=40)
    assert order == ["release", "work"]


def test_locked_bad_template(store: latchkey.Store, name: str) -> None:
    @store.locked(name + ":{missing}", ttl="30s")
    def work(n: int) -> None:
        pytest.fail("ran without its lock")

    with pytest.raises(ConfigError, match="missing"):
        work(1)
