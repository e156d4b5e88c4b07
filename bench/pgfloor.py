#!/usr/bin/env python3
"""What one PostgreSQL round trip costs through asyncio, against blocking libpq: the floor
under the postgresql:// and postgresql+advisory:// asyncio figures.

    .venv/bin/python bench/pgfloor.py postgresql://postgres@127.0.0.1:PORT/postgres

A bare ``SELECT 1`` (prepared, as latchkey's hot statements are), 5,000 times per try, five
tries interleaved: psycopg's ``AsyncConnection.execute``; libpq through ``psycopg.pq`` with
the event loop watching the socket (the asyncio backends' path: ``AsyncSession.run_prepared``);
blocking libpq through ``psycopg.pq`` (the sync backends' path: ``Session.run_prepared``).
Prints the median round trips per second.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import psycopg

from latchkey.stores.io.psycopg_async import AsyncSession

QUERY = b"SELECT 1"


async def psycopg_async(url: str, n: int) -> float:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    started = time.perf_counter()
    for _ in range(n):
        cur = await conn.execute(QUERY, prepare=True)
        await cur.fetchall()
    rate = n / (time.perf_counter() - started)
    await conn.close()
    return rate


async def pq_async(url: str, n: int) -> float:
    session = AsyncSession({"connect_timeout": 5, "conninfo": url}, 5.0)
    conn = await session.open()
    started = time.perf_counter()
    for _ in range(n):
        await session.run_prepared(conn, b"floor", QUERY, (), None, True)
    rate = n / (time.perf_counter() - started)
    await conn.close()
    return rate


def pq_blocking(url: str, n: int) -> float:
    conn = psycopg.connect(url, autocommit=True)
    pgconn = conn.pgconn
    pgconn.prepare(b"floor", QUERY)
    started = time.perf_counter()
    for _ in range(n):
        pgconn.exec_prepared(b"floor", (), None, 1)
    rate = n / (time.perf_counter() - started)
    conn.close()
    return rate


def main() -> None:
    url, n, tries = sys.argv[1], 5000, 5
    rates: dict[str, list[float]] = {"psycopg AsyncConnection": [], "pq + add_reader": [],
                                     "blocking libpq": []}  # fmt: skip
    for _ in range(tries):
        rates["psycopg AsyncConnection"].append(asyncio.run(psycopg_async(url, n)))
        rates["pq + add_reader"].append(asyncio.run(pq_async(url, n)))
        rates["blocking libpq"].append(pq_blocking(url, n))
    for what, values in rates.items():
        print(f"{what:24} {statistics.median(values):8.0f} round trips/s (median of {tries})")


if __name__ == "__main__":
    main()
