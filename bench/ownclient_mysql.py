#!/usr/bin/env python3
"""What borrowing the application's asyncio MySQL client costs, against latchkey's own
connections: uncontended acquire + release pairs per second, one coroutine, asyncio API.

    bench/.venv/bin/python bench/ownclient_mysql.py [--seconds 0.5] [--rounds 12]

Subjects: ``url`` (``connect_async("mysql://…")``: latchkey's asyncmy pool, MariaDB's
prepared acquire and release), and ``connect_async(client=…)`` over an asyncmy connection
and pool, an aiomysql connection and pool, and SQLAlchemy AsyncEngines over each driver —
every request on a borrowed connection goes in one round trip with the application's session
settings saved, latchkey's set and the application's restored around it. Each round runs
every subject for ``--seconds`` in turn (the order rotating each round); prints the median
pairs per second and the client CPU per pair (µs), the steadier figure on a shared machine.
Starts its own MariaDB (the tests' server, tests/servers).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import latchkey
import servers


async def _clients(url: str) -> dict[str, tuple[Any, Callable[[], Awaitable[None]]]]:
    """Each subject's client (None: by URL) and how to close it."""
    import aiomysql
    import asyncmy
    from sqlalchemy.ext.asyncio import create_async_engine

    u = urlsplit(url)
    args = {"host": u.hostname, "port": u.port, "user": u.username or "root",
            "password": u.password or ""}  # fmt: skip
    db = u.path.strip("/")
    amy = await asyncmy.connect(**args, database=db)
    amy_pool = await asyncmy.create_pool(**args, database=db, maxsize=4)
    aio = await aiomysql.connect(**args, db=db)
    aio_pool = await aiomysql.create_pool(**args, db=db, maxsize=4)
    engines = {d: create_async_engine(f"mysql+{d}://root@{u.hostname}:{u.port}/{db}")
               for d in ("asyncmy", "aiomysql")}  # fmt: skip

    async def nothing() -> None:
        return None

    async def closing(pool: Any) -> None:
        pool.close()
        await pool.wait_closed()

    return {
        "url": (None, nothing),
        "asyncmy-connection": (amy, amy.ensure_closed),
        "asyncmy-pool": (amy_pool, lambda: closing(amy_pool)),
        "aiomysql-connection": (aio, aio.ensure_closed),
        "aiomysql-pool": (aio_pool, lambda: closing(aio_pool)),
        "engine-asyncmy": (engines["asyncmy"], engines["asyncmy"].dispose),
        "engine-aiomysql": (engines["aiomysql"], engines["aiomysql"].dispose),
    }


async def _slice(store: Any, seconds: float) -> tuple[float, float]:
    """Pairs per second and client CPU µs per pair over ``seconds``."""
    lock = store.lock("bench", ttl="30s", wait=0)
    pairs = 0
    cpu, wall = time.process_time(), time.perf_counter()
    end = wall + seconds
    while time.perf_counter() < end:
        assert await lock.acquire()
        await lock.release()
        pairs += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return pairs / wall, cpu / pairs * 1e6


async def main(seconds: float, rounds: int) -> None:
    env, running = servers.start(["mysql"], Path(tempfile.mkdtemp(prefix="bench-own-")))
    try:
        url = env["mysql"]
        clients = await _clients(url)
        stores = {}
        for name, (client, _) in clients.items():
            table = f"bench_{name.replace('-', '_')}"
            if client is None:
                stores[name] = latchkey.connect_async(f"{url}?table={table}")
            else:
                stores[name] = latchkey.connect_async(client=client, table=table)
            await _slice(stores[name], 0.2)  # warm: tables, connections, statements
        rates: dict[str, list[float]] = {name: [] for name in stores}
        cpus: dict[str, list[float]] = {name: [] for name in stores}
        names = list(stores)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rate, cpu = await _slice(stores[name], seconds)
                rates[name].append(rate)
                cpus[name].append(cpu)
        print(f"{'subject':22} {'pairs/s':>8} {'CPU µs/pair':>12}   (medians of {rounds})")
        for name in names:
            rate, cpu = statistics.median(rates[name]), statistics.median(cpus[name])
            print(f"{name:22} {rate:8.0f} {cpu:12.0f}")
        for name, store in stores.items():
            await store.aclose()
            await clients[name][1]()
    finally:
        servers.stop(running)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=12)
    ns = parser.parse_args()
    asyncio.run(main(ns.seconds, ns.rounds))
