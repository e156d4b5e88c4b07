"""One chaos worker process: loops over a few hot names through latchkey's public API and
reports every call to the recorder (see history.py). Started by run.py as
``python -m tests.faults.worker CONFIG_JSON``; it may be SIGKILLed or SIGSTOPped at any time.

Each cycle is one of: a mutex held for a few steps (each step: tell the recorder, then
``lock.check()``, then read the register and write it back plus one, with the lock's fencing
token), sometimes extended, sometimes renewed in the background, sometimes abandoned without
release; a stale Lock object released or extended again after its release; a semaphore slot
held briefly; a record incremented with ``store.update``.

``variant`` breaks latchkey on purpose, to prove that the checker catches each kind of bug
(tests/faults/test_chaos.py): ``release-without-owner-check``, ``grant-on-error``,
``client-clock-expiry`` (SQLite: the store's clock read from this process's wall clock),
``renewer-ignores-deadline``.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import random
import sys
import time
from multiprocessing.connection import Client
from typing import Any

import latchkey
from latchkey import LockLost, LockTimeout, StoreUnavailable
from latchkey._types import Grant


class Reporter:
    def __init__(self, address: str, worker: int) -> None:
        self.conn = Client(address, family="AF_UNIX")
        self.worker = worker

    def ask(self, *message: Any) -> Any:
        self.conn.send(message)
        return self.conn.recv()

    def call(self, kind: str, name: str, fn: Any, **args: Any) -> Any:
        """Run ``fn()`` between an invocation and a return report; return its result, or the
        exception it raised (reported as ("error", type, text))."""
        op = self.ask("inv", self.worker, kind, name, args)
        try:
            result = fn()
        except (StoreUnavailable, LockLost, LockTimeout) as exc:
            self.ask("ret", op, ("error", type(exc).__name__, str(exc)[:200]))
            return exc
        self.ask("ret", op, result)
        return result


def describe(lock: Any, granted: bool) -> tuple[Any, ...]:
    return ("granted", lock.token) if granted else ("busy",)


def main() -> None:
    config = json.loads(sys.argv[1])
    logging.getLogger("latchkey").setLevel(logging.ERROR)  # losses are expected here
    offset = float(config.get("clock_offset", 0.0))
    if offset:
        _offset_wall_clock(offset)
    rng = random.Random(config["seed"])
    store = latchkey.connect(config["url"])
    _break(store, config.get("variant"))
    rep = Reporter(config["recorder"], config["worker"])
    ttl, limit = config["ttl"], config["limit"]
    deadline = time.monotonic() + config["seconds"]
    stale: list[tuple[str, Any]] = []  # (lease id, Lock object) kept after release/abandon
    caps = store.capabilities
    semaphores, records = caps.semaphores, caps.records
    stop = config["stop"]
    while time.monotonic() < deadline and not os.path.exists(stop):
        roll = rng.random()
        if roll < 0.6:
            _mutex_cycle(store, rep, rng, rng.choice(config["names"]), ttl, stale)
        elif roll < 0.75 and stale:
            lid, old = stale.pop(rng.randrange(len(stale)))
            if rng.random() < 0.5:
                rep.call("stale_release", old.name, old.release, token=old.token, lid=lid)
            else:
                extend = functools.partial(_extend, old)
                rep.call("stale_extend", old.name, extend, token=old.token, lid=lid)
        elif roll < 0.88:
            if semaphores:
                _semaphore_cycle(store, rep, rng, config["semaphore"], limit, ttl)
        elif records:
            record = config["record"]
            rep.call("update", record, functools.partial(store.update, record, _increment))
    rep.ask("exit", rep.worker)
    store.close()


def _increment(value: Any) -> int:
    return int(value or 0) + 1


def _take(lock: Any) -> tuple[Any, ...]:
    return describe(lock, lock.acquire())


def _give_back(lock: Any) -> tuple[Any, ...]:
    return ("ok", lock.release())


def _extend(lock: Any) -> tuple[Any, ...]:
    lock.extend()
    return ("ok", lock.token)


_LEASES = itertools.count(1)
#: Hold each mutex for many steps (the renewer-ignores-deadline variant: a holder SIGSTOPped
#: mid-hold must have steps left when it wakes, for the bug to show).
LONG_HOLDS = False


def _mutex_cycle(
    store: Any,
    rep: Reporter,
    rng: random.Random,
    name: str,
    ttl: float,
    stale: list[tuple[str, Any]],
) -> None:
    wait = rng.choice([0, 0.2, 1.0])
    renew = rng.random() < 0.5
    lock = store.lock(name, ttl=ttl, wait=wait, renew=renew)
    lid = f"{rep.worker}:{next(_LEASES)}"  # which Lock object: links its calls to its lease
    acquire = functools.partial(_take, lock)
    result = rep.call("acquire", name, acquire, ttl=ttl, wait=wait, lid=lid, renew=renew)
    if not (isinstance(result, tuple) and result[0] == "granted"):
        return
    for _ in range(rng.randint(1, 3) if not LONG_HOLDS else rng.randint(6, 10)):
        rep.ask("step", rep.worker, name, lock.token, lid)
        try:
            lock.check()
        except LockLost:
            break
        prev = rep.ask("read", rep.worker, name)
        rep.ask("write", rep.worker, name, lock.token or 0, prev, prev + 1, lid)
        if rng.random() < 0.3:
            extend = functools.partial(_extend, lock)
            rep.call("extend", name, extend, ttl=ttl, token=lock.token, lid=lid)
        time.sleep(rng.choice([0, 0.01, ttl * 0.4]))
    if rng.random() < 0.1:
        stale.append((lid, lock))  # abandoned: its lease must end before anyone else's grant
        return
    release = functools.partial(_give_back, lock)
    rep.call("release", name, release, token=lock.token, lid=lid)
    if rng.random() < 0.3:
        stale.append((lid, lock))


def _semaphore_cycle(
    store: Any, rep: Reporter, rng: random.Random, name: str, limit: int, ttl: float
) -> None:
    wait = rng.choice([0, 0.2])
    slot = store.semaphore(name, limit, ttl=ttl, wait=wait)
    lid = f"{rep.worker}:{next(_LEASES)}"
    acquire = functools.partial(_take, slot)
    result = rep.call("acquire", name, acquire, ttl=ttl, wait=wait, limit=limit, lid=lid)
    if isinstance(result, tuple) and result[0] == "granted":
        time.sleep(rng.choice([0, 0.02]))
        release = functools.partial(_give_back, slot)
        rep.call("release", name, release, token=slot.token, lid=lid)


def _offset_wall_clock(offset: float) -> None:
    """This process's wall clock reads ``offset`` seconds off (Python's ``time.time``; the
    recorder never reads the workers' clocks, and latchkey must not depend on them)."""
    real = time.time
    time.time = lambda: real() + offset


def _break(store: Any, variant: str | None) -> None:
    """Apply a deliberately broken variant (see the module docstring)."""
    if not variant:
        return
    backend = store.backend
    if variant == "release-without-owner-check":
        backend.release = lambda name, owner: backend.force_release(name)
    elif variant == "grant-on-error":
        acquire = backend.acquire
        counter = iter(range(10**9, 2 * 10**9))

        def lying_acquire(*args: Any, **kwargs: Any) -> Any:
            try:
                return acquire(*args, **kwargs)
            except StoreUnavailable:
                return Grant(next(counter), None)

        backend.acquire = lying_acquire
    elif variant == "client-clock-expiry":
        now_sql = backend.store.NOW
        answer = backend.io.answer

        def client_clock(request: Any) -> Any:
            if request[0] == now_sql:
                return [(int(time.time() * 1000),)], 1
            return answer(request)

        backend.io.answer = client_clock
    elif variant == "renewer-ignores-deadline":
        global LONG_HOLDS
        LONG_HOLDS = True
        from latchkey._core.lease import LeaseCore

        # The deadline is never consulted, and a renewal that finds the lease gone is shrugged
        # off: the holder goes on acting until it releases.
        LeaseCore.lost = property(lambda self: False)  # type: ignore[assignment]
        LeaseCore._lose = lambda self, reason: iter(())  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown variant {variant!r}")


if __name__ == "__main__":
    main()
