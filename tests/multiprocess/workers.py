"""Functions run in child processes (forked from a fork server that imported latchkey once:
none of the test process's connections or state; see tests/multiprocess/conftest.py)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import latchkey


def count_under_lock(url: str, name: str, counter: str, rounds: int) -> None:
    """Increment a file counter ``rounds`` times with a deliberate read-sleep-write race
    window that only the lock closes."""
    store = latchkey.connect(url)
    path = Path(counter)
    for _ in range(rounds):
        with store.lock(name, ttl="30s", wait="120s"):
            value = int(path.read_text())
            time.sleep(0.0005)
            path.write_text(str(value + 1))
    store.close()


def count_under_lock_in_threads(
    url: str, name: str, counter: str, threads: int, rounds: int, api: str
) -> None:
    """:func:`count_under_lock` from ``threads`` threads sharing one store object (``api``
    "sync"), or as many coroutines of one AsyncStore ("async"): the waiters of one process
    answered busy by its own holders' records (issue 17), those of the others by the store."""
    path = Path(counter)
    if api == "async":
        import asyncio

        async def main() -> None:
            async with latchkey.connect_async(url) as astore:

                async def one() -> None:
                    for _ in range(rounds):
                        async with astore.lock(name, ttl="30s", wait="120s"):
                            value = int(path.read_text())
                            await asyncio.sleep(0.0005)
                            path.write_text(str(value + 1))

                await asyncio.gather(*(one() for _ in range(threads)))

        asyncio.run(main())
        return
    import threading

    store = latchkey.connect(url)

    def one() -> None:
        for _ in range(rounds):
            with store.lock(name, ttl="30s", wait="120s"):
                value = int(path.read_text())
                time.sleep(0.0005)
                path.write_text(str(value + 1))

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    store.close()


def hold_until_killed(url: str, name: str, ttl: float, conn: Any) -> None:
    store = latchkey.connect(url)
    lock = store.lock(name, ttl=ttl)
    lock.acquire()
    conn.send(lock.token)
    time.sleep(3600)


def hold_and_report(url: str, name: str, conn: Any) -> None:
    """Hold a lock; report its token; keep it until told to release; report the result."""
    store = latchkey.connect(url)
    lock = store.lock(name, ttl="60s")
    lock.acquire()
    conn.send(lock.token)
    conn.recv()
    conn.send(lock.release())
    store.close()


def semaphore_peak(url: str, name: str, limit: int, rounds: int, inside: Any, peak: Any) -> None:
    store = latchkey.connect(url)
    for _ in range(rounds):
        with store.semaphore(name, limit, ttl="30s", wait="120s"):
            with inside.get_lock():
                inside.value += 1
                peak.value = max(peak.value, inside.value)
            time.sleep(0.002)
            with inside.get_lock():
                inside.value -= 1
    store.close()


def claim_and_process(url: str, prefix: str, items: int, batch: int, done_dir: str) -> int:
    """Seed 000: fetch candidates not done yet, claim a batch, process what we got (checking
    again after claiming), release. Returns how many items this process handled."""
    store = latchkey.connect(url)
    done = Path(done_dir)
    handled = 0
    while True:
        todo = [i for i in range(items) if not (done / str(i)).exists()]
        if not todo:
            break
        candidates = random.sample(todo, min(batch, len(todo)))
        with store.claim([f"{prefix}:{i}" for i in candidates], ttl="30s") as claim:
            for lock_name in claim.acquired:
                item = lock_name.rsplit(":", 1)[1]
                if (done / item).exists():
                    continue  # done by someone between our fetch and our claim
                # O_EXCL: a second processing of the same item fails loudly here.
                fd = os.open(done / item, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                handled += 1
                claim.release(lock_name)
    store.close()
    return handled


def increment_record(url: str, name: str, rounds: int) -> None:
    store = latchkey.connect(url)
    for _ in range(rounds):
        store.update(name, lambda v: (v or 0) + 1, retries=10_000)
    store.close()


def singleton_ticks(url: str, name: str, ticks: int, barrier: Any, log: str) -> None:
    store = latchkey.connect(url)

    @store.singleton(name, at_most="30s", at_least="1s")
    def job(tick: int) -> None:
        with open(log, "a") as f:
            f.write(f"{tick}\n")

    for tick in range(ticks):
        barrier.wait(timeout=60)  # every node's scheduler fires the tick…
        time.sleep(random.uniform(0, 0.05))  # …a little apart
        job(tick)
        barrier.wait(timeout=60)
        deadline = time.monotonic() + 30
        while not store.is_free(name) and time.monotonic() < deadline:
            time.sleep(0.02)  # the next tick comes after at_least has passed
    store.close()


def wait_in_turn(url: str, name: str, waiters: int, api: str) -> None:
    """Wait for ``name`` from ``waiters`` threads (``api="sync"``, one store) or coroutines
    (``"async"``, one AsyncStore), each taking it in turn and letting it go."""
    if api == "async":
        import asyncio

        async def main() -> None:
            async with latchkey.connect_async(url) as astore:

                async def one() -> None:
                    async with astore.lock(name, ttl="30s", wait="120s"):
                        pass

                await asyncio.gather(*(one() for _ in range(waiters)))

        asyncio.run(main())
        return
    import threading

    store = latchkey.connect(url)

    def one() -> None:
        with store.lock(name, ttl="30s", wait="120s"):
            pass

    threads = [threading.Thread(target=one) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
