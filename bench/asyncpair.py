#!/usr/bin/env python3
"""N uncontended acquire+release pairs of mysql+getlock or postgresql+advisory, for counting
what a pair costs:

    bench/.venv/bin/python bench/asyncpair.py URL {sync,async,raw} N [--profile]

URL is a ``mysql://`` or ``postgresql://`` URL of a running server (bench/servers.py or
tests/servers start one): ``mysql+getlock`` or ``postgresql+advisory`` is measured.
``sync``/``async``: latchkey's pair (one lock object per pair); ``raw``: asyncmy's
``SELECT GET_LOCK(k, 0)`` + ``SELECT RELEASE_LOCK(k)`` on one connection, or psycopg's
``AsyncConnection.execute`` of ``pg_try_advisory_lock`` + ``pg_advisory_unlock`` (prepared,
as bench/rawasync.py's F does). ``--profile``
prints cProfile's function calls per pair (and the loop's turns, ``_run_once``). Under
callgrind, run it with two N and divide the difference of the instruction counts by the
difference of N (issue 12, run 15 in docs/benchmarks.md):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        bench/.venv/bin/python bench/asyncpair.py URL async 600    # and 100
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
from typing import Any

import latchkey


def main() -> None:
    base, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    profile = "--profile" in sys.argv
    pg = base.startswith("postgresql://")
    url = (
        base.replace("postgresql://", "postgresql+advisory://", 1)
        if pg
        else base.replace("mysql://", "mysql+getlock://", 1)
    )
    profiler = cProfile.Profile()

    def report() -> None:
        stats: Any = pstats.Stats(profiler).stats
        calls = sum(row[1] for row in stats.values())
        turns = sum(row[1] for key, row in stats.items() if key[2] == "_run_once")
        print(f"{what}: {calls / n:.1f} function calls a pair, {turns / n:.1f} turns of the loop")

    if what == "sync":
        store = latchkey.connect(url)

        def pairs(count: int) -> None:
            for _ in range(count):
                lock = store.lock("pair", ttl=30, wait=5)
                lock.acquire()
                lock.release()

        pairs(50)
        if profile:
            profiler.enable()
        pairs(n)
        profiler.disable()
        store.close()
        if profile:
            report()
        return

    async def run() -> None:
        if what == "async":
            astore = latchkey.connect_async(url)

            async def pair() -> None:
                lock = astore.lock("pair", ttl=30, wait=5)
                await lock.acquire()
                await lock.release()

        elif pg:
            import psycopg

            aconn = await psycopg.AsyncConnection.connect(base, autocommit=True)
            lock_sql = "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))"
            unlock_sql = "SELECT pg_advisory_unlock(hashtextextended(%s, 0))"

            async def pair() -> None:
                cur = await aconn.execute(lock_sql, ("pair",), prepare=True)
                await cur.fetchall()
                cur = await aconn.execute(unlock_sql, ("pair",), prepare=True)
                await cur.fetchall()

        else:
            from urllib.parse import urlsplit

            import asyncmy

            u = urlsplit(base)
            conn = await asyncmy.connect(
                host=u.hostname, port=u.port or 3306, user=u.username or "root",
                password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
            )  # fmt: skip
            cur = conn.cursor()

            async def pair() -> None:
                await cur.execute("SELECT GET_LOCK(%s, 0)", ("pair",))
                await cur.fetchall()
                await cur.execute("SELECT RELEASE_LOCK(%s)", ("pair",))
                await cur.fetchall()

        for _ in range(50):
            await pair()
        if profile:
            profiler.enable()
        for _ in range(n):
            await pair()
        profiler.disable()
        if profile:
            report()

    asyncio.run(run())


if __name__ == "__main__":
    main()
