#!/usr/bin/env python3
"""What the session locks over the application's pool or engine cost (``connect(client=…,
locks="session")``), against latchkey's own connections: uncontended acquire + release pairs
per second, one thread, sync API.

    bench/.venv/bin/python bench/ownclient_sessions.py [--seconds 0.5] [--rounds 8]

Subjects: ``postgresql+advisory://`` by URL, over a ``psycopg_pool.ConnectionPool`` and over a
SQLAlchemy ``Engine`` (postgresql+psycopg); ``mysql+getlock://`` by URL and over an ``Engine``
(mysql+pymysql). Over a pool, each pair checks a connection out for the acquire and gives it
back at the release (the lock lives on it in between): the pool's checkout and return are
the added cost. Each round runs every subject for ``--seconds`` in turn (the order rotating);
prints the median pairs per second and client CPU per pair (µs). Starts its own PostgreSQL and
MariaDB (the tests' servers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import latchkey
import servers


def _clients(env: dict[str, str]) -> dict[str, tuple[str, Any, Callable[[], Any]]]:
    """Each subject: its store URL (or its server's, for a client), client, closer."""
    import psycopg_pool
    import sqlalchemy

    pg, my = env["postgresql"], env["mysql"]
    pool = psycopg_pool.ConnectionPool(pg, min_size=2, max_size=4, open=False)
    pool.open(wait=True, timeout=30)
    pg_engine = sqlalchemy.create_engine(pg.replace("postgresql://", "postgresql+psycopg://"))
    my_engine = sqlalchemy.create_engine(my.replace("mysql://", "mysql+pymysql://"))
    return {
        "advisory-url": (pg.replace("postgresql://", "postgresql+advisory://"), None, list),
        "advisory-psycopg-pool": (pg, pool, pool.close),
        "advisory-engine": (pg, pg_engine, pg_engine.dispose),
        "getlock-url": (my.replace("mysql://", "mysql+getlock://"), None, list),
        "getlock-engine": (my, my_engine, my_engine.dispose),
    }


def _slice(store: Any, seconds: float) -> tuple[float, float]:
    lock = store.lock("bench", wait=0)
    pairs = 0
    cpu, wall = time.process_time(), time.perf_counter()
    end = wall + seconds
    while time.perf_counter() < end:
        assert lock.acquire()
        lock.release()
        pairs += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return pairs / wall, cpu / pairs * 1e6


def main(seconds: float, rounds: int) -> None:
    env, running = servers.start(["postgresql", "mysql"], Path(tempfile.mkdtemp(prefix="bench-")))
    try:
        clients = _clients(env)
        stores = {}
        for name, (url, client, _) in clients.items():
            if client is None:
                stores[name] = latchkey.connect(url)
            else:
                stores[name] = latchkey.connect(client=client, locks="session")
            _slice(stores[name], 0.2)  # warm: connections, prepared statements
        rates: dict[str, list[float]] = {name: [] for name in stores}
        cpus: dict[str, list[float]] = {name: [] for name in stores}
        names = list(stores)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rate, cpu = _slice(stores[name], seconds)
                rates[name].append(rate)
                cpus[name].append(cpu)
        print(f"{'subject':24} {'pairs/s':>8} {'CPU µs/pair':>12}   (medians of {rounds})")
        for name in names:
            rate, cpu = statistics.median(rates[name]), statistics.median(cpus[name])
            print(f"{name:24} {rate:8.0f} {cpu:12.0f}")
        for name, store in stores.items():
            store.close()
            clients[name][2]()
    finally:
        servers.stop(running)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=8)
    ns = parser.parse_args()
    main(ns.seconds, ns.rounds)
