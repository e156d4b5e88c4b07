"""Versioned records (seed 003's optimistic lock)."""

from __future__ import annotations

import threading

import pytest

import latchkey
from latchkey import Conflict, InvalidValue
from tests.helpers import HOSTILE_NAMES

pytestmark = pytest.mark.requires("records")


def test_get_set_conflict(store: latchkey.Store, name: str) -> None:
    rec = store.record(name)
    assert rec.get() == (None, 0)
    assert rec.set({"status": "new", "items": [1, 2]}, version=0) == 1
    assert rec.get() == ({"status": "new", "items": [1, 2]}, 1)
    with pytest.raises(Conflict):
        rec.set({"status": "lost"}, version=0)  # it exists now
    assert rec.set({"status": "paid"}, version=1) == 2
    with pytest.raises(Conflict):
        rec.set({"status": "stale"}, version=1)
    assert rec.get() == ({"status": "paid"}, 2)


def test_update_applies_the_function(store: latchkey.Store, name: str) -> None:
    assert store.update(name, lambda v: (v or 0) + 1) == 1
    assert store.update(name, lambda v: v + 41) == 42
    assert store.record(name).get() == (42, 2)


def test_delete_checks_the_version(store: latchkey.Store, name: str) -> None:
    rec = store.record(name)
    rec.set("x", version=0)
    with pytest.raises(Conflict):
        rec.delete(version=5)
    rec.delete(version=1)
    assert rec.get() == (None, 0)


@pytest.mark.parametrize(
    "value", [None, True, 0, -1.5, "text ✓", [1, "a", None], {"nested": {"k": [1, 2]}}]
)
def test_json_values_round_trip(store: latchkey.Store, name: str, value: object) -> None:
    store.record(name).set(value, version=0)
    assert store.record(name).get() == (value, 1)


@pytest.mark.parametrize("bad", [{1, 2}, object(), float("nan"), b"bytes"])
def test_values_that_are_not_json(store: latchkey.Store, name: str, bad: object) -> None:
    with pytest.raises(InvalidValue, match=name):
        store.record(name).set(bad, version=0)
    assert store.record(name).get() == (None, 0)


def test_hostile_record_names(store: latchkey.Store) -> None:
    for hostile in HOSTILE_NAMES:
        rec = store.record(hostile)
        rec.set({"name": hostile}, version=rec.get()[1])
        assert rec.get()[0] == {"name": hostile}


def test_threads_updating_one_counter(store: latchkey.Store, name: str) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(25):
                store.update(name, lambda v: (v or 0) + 1, retries=1000)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert store.record(name).get() == (100, 100)
