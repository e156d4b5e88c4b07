#!/usr/bin/env python3
"""What one WAL flush adds to a PostgreSQL hand-off (the durable floor, taken apart).

    bench/.venv/bin/python bench/flush.py [--reps 30]

A waiter in another process blocks in ``pg_advisory_lock``; the holder releases 50-150 ms
after the waiter said it is about to wait (as in scenario B), with:

- ``advisory``: ``pg_advisory_unlock`` alone (no write: the raw advisory hand-off);
- ``durable``: ``BEGIN; INSERT … ON CONFLICT DO UPDATE`` (one row); ``COMMIT``; unlock, one
  round trip (bench/subjects.py PG_FLOOR_RELEASE: ``postgresql/raw-durable-floor``);
- ``async commit``: the same with ``synchronous_commit = off`` (the commit is not flushed).

Prints, per variant, the median time from the start of the release to the holder's reply and
to the waiter's wake-up (``time.monotonic()``, one clock for both processes). ``durable`` minus
``async commit`` is the flush. Starts its own disposable PostgreSQL (tests/servers).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import subjects  # noqa: E402

import servers  # noqa: E402

KEY = subjects.key64("bench:flush")
VARIANTS = {
    "advisory": f"SELECT pg_advisory_unlock({KEY:d})",
    "durable": subjects.PG_FLOOR_RELEASE.format(key=KEY),
    "async commit": "SET synchronous_commit = off; "
    + subjects.PG_FLOOR_RELEASE.format(key=KEY)
    + "; SET synchronous_commit = on",
}


def _waiter(url: str, conn: Any) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        conn.send("ready")
        while conn.recv() == "go":
            conn.send("waiting")
            db.execute("SELECT pg_advisory_lock(%s)", (KEY,))
            woke = time.monotonic()
            db.execute("SELECT pg_advisory_unlock(%s)", (KEY,))
            conn.send(woke)


def measure(url: str, release: str, reps: int) -> tuple[float, float]:
    """Median ms from release start to (holder's reply, waiter's wake-up)."""
    import psycopg

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    waiter = ctx.Process(target=_waiter, args=(url, theirs), daemon=True)
    waiter.start()
    replies, wakes = [], []
    try:
        if not ours.poll(30) or ours.recv() != "ready":
            raise RuntimeError("waiter did not start")
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(subjects.PG_FLOOR_CREATE)
            for _ in range(reps):
                db.execute("SELECT pg_advisory_lock(%s)", (KEY,))
                ours.send("go")
                if not ours.poll(30) or ours.recv() != "waiting":
                    raise RuntimeError("waiter silent")
                time.sleep(random.uniform(0.05, 0.15))  # the waiter is really blocked
                started = time.monotonic()
                db.execute(release, prepare=False)
                replied = time.monotonic()
                if not ours.poll(30):
                    raise RuntimeError("waiter never woke")
                woke = ours.recv()
                replies.append(replied - started)
                wakes.append(woke - started)
        ours.send("stop")
    finally:
        waiter.join(10)
        if waiter.is_alive():
            waiter.kill()
    return statistics.median(replies) * 1000, statistics.median(wakes) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="latchkey-flush-") as tmp:
        env, running = servers.start(["postgresql"], Path(tmp))
        try:
            print("| variant | release reply (ms) | waiter woke (ms) |")
            print("| --- | --- | --- |")
            for _ in range(args.rounds):
                for name, release in VARIANTS.items():
                    reply, woke = measure(env["postgresql"], release, args.reps)
                    print(f"| {name} | {reply:.2f} | {woke:.2f} |", flush=True)
        finally:
            servers.stop(running)
    return 0


if __name__ == "__main__":
    sys.exit(main())
