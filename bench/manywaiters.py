#!/usr/bin/env python3
"""Ten thousand waiters on one name, spread over twenty processes: all served, fairly, with
the store's memory bounded (issue 17 item 3).

    PYTHONPATH=src bench/.venv/bin/python bench/manywaiters.py [--stores redis,postgresql]
        [--procs 20] [--waiters 500] [--hold 0] [--limit 600] [--out f.json]

For each store (its own disposable server, tests/servers; SQLite in a temporary file):

1. ``procs`` processes start, each an asyncio loop (the asyncio API: a waiting coroutine
   holds no thread) with ``waiters`` coroutines ready; once every process is ready, a
   holder in the parent takes the name, all coroutines ask for it (``wait`` up to ``limit``
   seconds, ``ttl`` 30 s), and the holder lets go;
2. each coroutine takes the lock once, checks inside that nobody else is inside (a shared
   counter in the parent's shared memory; an overlap is counted, never expected), holds it for
   ``hold`` seconds, releases it, and records when it asked and when it got it;
3. meanwhile the parent samples what the store keeps for the waiters (Redis: ``used_memory``
   and the keys under the prefix; PostgreSQL: the rows of the lease table and its waiter
   queue; others: nothing is read) every half second.

Reported per store: how many were served out of ``procs * waiters`` and in how long (grants
per second), the wait (ask → grant) median, 99th percentile and worst, how fair the order
was — each process's share of the first half of the grants (an even spread is 1.0 for every
process: the lowest and highest are shown) and the Spearman correlation between the order in
which the coroutines asked and were served — and the store's memory: the largest sample
against the one before the waiters came and after they left (bounded: it grows with the
waiters and comes back, not with the grants).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import latchkey
import servers

NAME = "many-waiters"


def url_for(store: str, env: dict[str, str], prefix: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{env['tmp']}/many.db?table={table_of(prefix)}"
    base = env[servers.FAMILY_SERVERS[store][0]]
    base = base.replace("redis://", f"{store}://", 1) if store.startswith("redis+") else base
    if store == "postgresql+advisory":
        base = base.replace("postgresql://", "postgresql+advisory://", 1)
    if store == "mysql+getlock":
        base = base.replace("mysql://", "mysql+getlock://", 1)
    sep = "&" if "?" in base else "?"
    if store in ("postgresql", "mysql"):
        return f"{base}{sep}table={table_of(prefix)}"
    return f"{base}{sep}prefix={prefix}"


def table_of(prefix: str) -> str:
    return "latchkey_" + prefix.rstrip(":")


def worker(url: str, index: int, waiters: int, hold: float, limit: float, ready: Any,
           go: Any, inside: Any, overlaps: Any, out: Any) -> None:  # fmt: skip
    async def main() -> list[tuple[float, float]]:
        store = latchkey.connect_async(url)
        try:
            await store.inspect(NAME)  # connected before the start
            ready.release()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)

            async def one() -> tuple[float, float]:
                asked = time.time()
                lock = store.lock(NAME, ttl="30s", wait=limit)
                if not await lock.acquire():
                    return (asked, float("nan"))
                got = time.time()
                with inside.get_lock():
                    inside.value += 1
                    if inside.value != 1:
                        overlaps.value += 1
                if hold:
                    await asyncio.sleep(hold)
                with inside.get_lock():
                    inside.value -= 1
                await lock.release()
                return (asked, got)

            return list(await asyncio.gather(*(one() for _ in range(waiters))))
        finally:
            await store.aclose()

    try:
        out.put((index, asyncio.run(main()), None))
    except BaseException as exc:  # reported by the parent
        out.put((index, [], f"{type(exc).__name__}: {exc}"))


def store_memory(store: str, env: dict[str, str], url: str, prefix: str) -> dict[str, int] | None:
    """What the store keeps now, where it can be read cheaply."""
    if store in ("redis", "redis+sentinel"):
        import redis

        client = redis.Redis.from_url(env["redis"] if store == "redis" else url.split("?")[0])
        try:
            used = int(client.info("memory")["used_memory"])
            keys = sum(1 for _ in client.scan_iter(match=f"{prefix}*", count=1000))
            commands = int(client.info("stats")["total_commands_processed"])
            clients = int(client.info("clients")["connected_clients"])
            calls = {k.removeprefix("cmdstat_"): v["calls"]
                     for k, v in client.info("commandstats").items()}  # fmt: skip
            return {"used_memory": used, "keys": keys, "commands": commands, "clients": clients,
                    "calls": calls}  # fmt: skip
        finally:
            client.close()
    if store == "postgresql":
        import psycopg

        with psycopg.connect(env["postgresql"], autocommit=True) as conn:
            rows = {}
            for (table,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (table_of(prefix) + "%",)
            ).fetchall():
                rows[table] = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
            return rows
    return None


def run_store(store: str, env: dict[str, str], procs: int, waiters: int, hold: float,
              limit: float) -> dict[str, Any]:  # fmt: skip
    prefix = f"mw{uuid.uuid4().hex[:8]}:"
    url = url_for(store, env, prefix)
    ctx = mp.get_context("spawn")
    ready, go = ctx.Semaphore(0), ctx.Event()
    inside, overlaps = ctx.Value("i", 0), ctx.Value("i", 0)
    out = ctx.Queue()
    holder_store = latchkey.connect(url)
    holder = holder_store.lock(NAME, ttl="60s", wait=0)
    assert holder.acquire()
    memory = [("before", time.time(), store_memory(store, env, url, prefix))]
    workers = [
        ctx.Process(target=worker, args=(url, i, waiters, hold, limit, ready, go, inside,
                                         overlaps, out))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    for _ in range(procs):
        if not ready.acquire(timeout=120):
            raise RuntimeError("a worker did not get ready in 120 s")
    go.set()
    started = time.time()
    time.sleep(0.5)  # let every coroutine ask before the holder lets go (a bench, not a test)
    memory.append(("asked", time.time(), store_memory(store, env, url, prefix)))
    holder.release()
    released = time.time()
    results: dict[int, list[tuple[float, float]]] = {}
    errors: list[str] = []
    while len(results) + len(errors) < procs:
        try:
            index, rows, error = out.get(timeout=0.5)
        except Exception:
            memory.append(("running", time.time(), store_memory(store, env, url, prefix)))
            if time.time() - started > limit + 120:
                errors.append("timed out waiting for the workers")
                break
            continue
        if error:
            errors.append(f"process {index}: {error}")
        results[index] = rows
    ended = time.time()
    for w in workers:
        w.join(30)
        if w.is_alive():
            w.kill()
    memory.append(("after", time.time(), store_memory(store, env, url, prefix)))
    holder_store.close()

    grants = sorted(
        (got, asked, index) for index, rows in results.items() for asked, got in rows
        if got == got  # not NaN: served
    )  # fmt: skip
    served = len(grants)
    waits = sorted(got - max(asked, released) for got, asked, _ in grants)
    half = grants[: served // 2]
    share = [sum(1 for g in half if g[2] == i) / max(1, len(half) / procs) for i in range(procs)]
    asked_rank = {a: r for r, a in enumerate(sorted(g[1] for g in grants))}
    spearman = None
    if served > 2:
        n = served
        d2 = sum((r - asked_rank[g[1]]) ** 2 for r, g in enumerate(grants))
        spearman = round(1 - 6 * d2 / (n * (n * n - 1)), 3)
    span = (grants[-1][0] - released) if grants else None
    return {
        "store": store, "procs": procs, "waiters": procs * waiters, "served": served,
        "errors": errors, "overlaps": overlaps.value,
        "seconds": round(span, 2) if span else None,
        "grants_per_s": round(served / span, 1) if span else None,
        "wait_ms": {
            "median": round(1000 * statistics.median(waits), 1) if waits else None,
            "p99": round(1000 * waits[int(0.99 * (len(waits) - 1))], 1) if waits else None,
            "max": round(1000 * waits[-1], 1) if waits else None,
        },
        "first_half_share": {"min": round(min(share), 2), "max": round(max(share), 2)},
        "spearman_asked_vs_served": spearman,
        "memory": [(what, round(t - started, 1), m) for what, t, m in memory],
        "wall": round(ended - started, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgresql")
    parser.add_argument("--procs", type=int, default=20)
    parser.add_argument("--waiters", type=int, default=500)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--limit", type=float, default=600.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    stores = args.stores.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="latchkey-bench-") as tmp:
        families = sorted({s for s in stores if s != "sqlite"} & set(servers.FAMILY_SERVERS))
        families = sorted({s.split("+")[0] if s in ("postgresql+advisory", "mysql+getlock")
                           else s for s in families})  # fmt: skip
        env, running = servers.start(families, Path(tmp))
        try:
            for store in stores:
                result = run_store(store, env, args.procs, args.waiters, args.hold, args.limit)
                print(json.dumps(result), flush=True)
                results.append(result)
        finally:
            servers.stop(running)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
