"""The renewal thread holds only a weak reference: a forgotten held lock stops its renewer."""

from __future__ import annotations

import gc
import threading

import latchkey
from tests.helpers import eventually


def _renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("latchkey-renew:forgotten")]


def test_a_forgotten_lock_stops_its_renewer_at_once() -> None:
    store = latchkey.connect("memory://")
    lock = store.lock("forgotten", ttl="60s", renew=True)  # renews every 20 s
    assert lock.acquire()
    assert len(_renewers()) == 1
    del lock
    gc.collect()
    # Without the weakref callback the thread would sleep on until its next renewal (20 s).
    eventually(lambda: not _renewers(), timeout=5, what="the renewer of a collected lock ended")


def test_a_held_lock_keeps_its_renewer() -> None:
    store = latchkey.connect("memory://")
    lock = store.lock("kept", ttl="60s", renew=True)
    assert lock.acquire()
    gc.collect()
    assert any(t.name == "latchkey-renew:kept" for t in threading.enumerate())
    lock.release()
    assert not any(t.name == "latchkey-renew:kept" for t in threading.enumerate())
