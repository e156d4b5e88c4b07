#!/usr/bin/env python3
"""A million leases: acquire+release beside them, and purging a backlog without holding anyone up.

    .venv/bin/python bench/purge.py [--stores sqlite,postgresql,mysql,redis,mongodb]
        [--live 1000000] [--expired 1000000] [--pairs 2000] [--out f.json]

For each store (its own disposable server, tests/servers; SQLite in a temporary file):

1. **empty**: the median acquire+release of a fresh name (sync API, ttl 30 s), over ``pairs``
   pairs, on an empty store;
2. the store is seeded straight through its own driver with ``live`` live leases (expiring in
   an hour) and ``expired`` expired ones (SQL stores and MongoDB: rows/documents in latchkey's
   own format — MongoDB's TTL monitor, which would delete the expired documents by itself
   within a minute, is switched off for the run; Redis: ``live`` mutex leases, and expired
   entries in semaphore zsets that one live holder each keeps alive — the only expired
   leases Redis keeps, since everything else expires by itself — and each such zset's
   member in the expiry index, ``latchkey:expiring``, as latchkey's scripts keep it: an
   older tree, which has no index, ignores that key);
3. **full**: the same acquire+release median beside them;
4. **purge**: ``store.purge_expired()`` is timed while a second process loops acquire+release
   of its own names and records each pair's latency: the purge's duration and rate, and the
   prober's p99 and worst pair during the purge against its p99 and worst pair just before it
   (what a purge adds to everyone else's wait is the difference), and any prober errors;
5. **purge again**: a purge with nothing expired and ``live`` live leases: what a purge costs
   when it removes nothing.

The target (issue 17): any backlog cleared, nobody held up more than 50 ms at a time, a purge
costing in proportion to what it removes; full/empty ≥ 0.95.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import servers  # noqa: E402

import latchkey  # noqa: E402
from latchkey._url import StoreURL  # noqa: E402

SERVER = {"postgresql": "postgresql", "mysql": "mysql", "redis": "redis", "mongodb": "mongodb"}
CHUNK = 50_000


def pairs_median(store: latchkey.Store, pairs: int) -> float:
    """Median µs of acquire+release of a fresh name."""
    tag, times = uuid.uuid4().hex[:8], []
    for i in range(pairs):
        lock = store.lock(f"bench:pair:{tag}:{i}", ttl=30)
        started = time.perf_counter()
        lock.acquire()
        lock.release()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


# -- seeding, straight through each store's own driver ----------------------------------------


def seed_sql(store: latchkey.Store, url: str, live: int, expired: int) -> None:
    store.init()
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        now = int(time.time() * 1000)
        for start in range(0, live + expired, CHUNK):
            rows = [
                (f"bench:seed:{i:09}".encode(), 0, "o" * 32, "{}", i + 1, now - 7_200_000,
                 now + 3_600_000 if i < live else now - 3_600_000)
                for i in range(start, min(live + expired, start + CHUNK))
            ]  # fmt: skip
            conn.executemany("INSERT INTO latchkey_locks VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            conn.commit()
        fence = "UPDATE latchkey_locks_meta SET value = ? WHERE key = 'fence'"
        conn.execute(fence, (live + expired,))
        conn.commit()
        conn.close()
    elif url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            for start in range(0, live + expired, CHUNK):
                conn.execute(
                    """INSERT INTO latchkey_locks
                    SELECT convert_to('bench:seed:' || lpad(g::text, 9, '0'), 'UTF8'), 0,
                           md5(g::text), '{}', nextval('latchkey_locks_fence'),
                           now() - interval '2 hours',
                           CASE WHEN g < %s THEN now() + interval '1 hour'
                                ELSE now() - interval '1 hour' END
                    FROM generate_series(%s::bigint, %s::bigint) AS g""",
                    (live, start, min(live + expired, start + CHUNK) - 1),
                )
            conn.execute("VACUUM ANALYZE latchkey_locks")
    else:
        import pymysql

        u = StoreURL.parse(url)
        host, port = u.hosts[0]
        conn = pymysql.connect(
            host=host, port=port or 3306, user=u.username or "root", password=u.password or "",
            database=u.path.strip("/"), autocommit=True,
        )  # fmt: skip
        with conn.cursor() as cur:
            for start in range(0, live + expired, CHUNK):
                end = min(live + expired, start + CHUNK) - 1
                cur.execute(
                    f"""INSERT INTO latchkey_locks
                    (name, slot, owner, owner_info, acquired_at, expires_at)
                    SELECT CONCAT('bench:seed:', LPAD(seq, 9, '0')), 0, MD5(seq), '{{}}',
                           UTC_TIMESTAMP(6) - INTERVAL 2 HOUR,
                           IF(seq < %s, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR,
                                        UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)
                    FROM seq_{start}_to_{end}""",
                    (live,),
                )
            cur.execute("ANALYZE TABLE latchkey_locks")
        conn.close()


def seed_redis(url: str, live: int, expired: int) -> None:
    import redis

    r = redis.Redis.from_url(url)
    now = int(time.time() * 1000)
    pipe = r.pipeline(transaction=False)
    for i in range(live):
        base = f"latchkey:{{{f'bench:seed:{i:09}'.encode().hex()}}}"
        pipe.set(f"{base}:lease", f"{'o' * 32}:{i + 1}:{now}:{{}}", px=3_600_000)
        if i % 10_000 == 9_999:
            pipe.execute()
    # expired semaphore entries: 10 per zset, each zset kept alive by one live holder
    for z in range(expired // 10):
        base = f"latchkey:{{{f'bench:sem:{z:09}'.encode().hex()}}}"
        members: dict[str, int] = {f"dead{j}": now - 3_600_000 for j in range(10)}
        members["live"] = now + 3_600_000
        pipe.zadd(f"{base}:leases", members)
        pipe.hset(f"{base}:owners", mapping={k: f"1:{now}:{{}}" for k in members})
        pipe.pexpireat(f"{base}:leases", now + 3_600_000)
        pipe.pexpireat(f"{base}:owners", now + 3_600_000)
        pipe.zadd("latchkey:expiring", {base: now - 3_600_000})  # its soonest expiry
        if z % 2_000 == 1_999:
            pipe.execute()
    pipe.execute()
    r.close()


def seed_mongodb(url: str, live: int, expired: int) -> None:
    import datetime as dt

    import pymongo

    client = pymongo.MongoClient(url)
    ttl_monitor(client, False)  # on, the server deletes the expired seed within a minute
    coll = client.get_default_database()["latchkey_locks"]
    now = dt.datetime.now(dt.timezone.utc)
    hour = dt.timedelta(hours=1)
    for start in range(0, live + expired, CHUNK // 5):
        docs = []
        for i in range(start, min(live + expired, start + CHUNK // 5)):
            expires = now + hour if i < live else now - hour
            docs.append({
                "_id": f"bench:seed:{i:09}", "fence": i + 1, "gc": expires,
                "holders": [{"owner": "o" * 32, "info": "{}", "token": i + 1,
                             "acquired": now - 2 * hour, "expires": expires}],
            })  # fmt: skip
        coll.insert_many(docs, ordered=False)
    client.close()


def ttl_monitor(client: Any, enabled: bool) -> None:
    """MongoDB's TTL monitor (it deletes documents whose ``gc`` passed, once a minute) on or
    off, so that the purge measured is latchkey's own."""
    client.admin.command("setParameter", 1, ttlMonitorEnabled=enabled)


# -- the prober ---------------------------------------------------------------------------------


def probe(url: str, stop: Any, marks: Any, out: Any) -> None:
    """Loop acquire+release of fresh names until ``stop``; send (start time, µs, error) rows."""
    store, tag, rows = latchkey.connect(url), uuid.uuid4().hex[:8], []
    i = 0
    marks.put("ready")
    while not stop.is_set():
        lock = store.lock(f"bench:probe:{tag}:{i}", ttl=30)
        started = time.time()
        t0 = time.perf_counter()
        error = ""
        try:
            lock.acquire()
            lock.release()
        except latchkey.LatchkeyError as exc:
            error = f"{type(exc).__name__}: {str(exc)[-160:]}"
        rows.append((started, (time.perf_counter() - t0) * 1e6, error))
        i += 1
    store.close()
    out.put(rows)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 2 else max(values, default=0)


def measure(name: str, url: str, live: int, expired: int, pairs: int) -> dict[str, Any]:
    store = latchkey.connect(url)
    result: dict[str, Any] = {"store": name, "live": live, "expired": expired}
    result["empty_us"] = pairs_median(store, pairs)
    started = time.monotonic()
    if name == "redis":
        seed_redis(url, live, expired)
    elif name == "mongodb":
        store.init()
        seed_mongodb(url, live, expired)
    else:
        seed_sql(store, url, live, expired)
    result["seed_s"] = time.monotonic() - started
    result["full_us"] = pairs_median(store, pairs)
    result["full_over_empty"] = result["empty_us"] / result["full_us"]

    ctx = mp.get_context("spawn")
    stop, marks, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    prober = ctx.Process(target=probe, args=(url, stop, marks, out))
    prober.start()
    marks.get(timeout=60)
    time.sleep(2.0)  # the prober's baseline, before the purge
    purge_start = time.time()
    try:
        purged = store.purge_expired()
    except BaseException:
        stop.set()  # else the prober runs on, and this process waits for it at exit
        raise
    purge_end = time.time()
    time.sleep(0.5)
    stop.set()
    rows = out.get(timeout=120)
    prober.join(60)
    before = [us for t, us, _ in rows if purge_start - 1.5 <= t < purge_start]
    during = [us for t, us, _ in rows if purge_start <= t < purge_end]
    result.update(
        purged=purged,
        purge_s=purge_end - purge_start,
        purge_rows_per_s=purged / max(purge_end - purge_start, 1e-9),
        probe_before_p99_ms=p99(before) / 1000,
        probe_before_max_ms=max(before, default=0) / 1000,
        probe_during_pairs=len(during),
        probe_during_p99_ms=p99(during) / 1000,
        probe_during_max_ms=max(during, default=0) / 1000,
        probe_errors=sorted({e for _, _, e in rows if e}),
    )
    started = time.monotonic()
    result["purge_again_count"] = store.purge_expired()
    result["purge_again_s"] = time.monotonic() - started
    store.close()
    if name == "mongodb":
        import pymongo

        with pymongo.MongoClient(url) as client:
            ttl_monitor(client, True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stores", default="sqlite,postgresql,mysql,redis")
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--expired", type=int, default=1_000_000)
    parser.add_argument("--pairs", type=int, default=2_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    servers.load_all()
    results = []
    with tempfile.TemporaryDirectory(prefix="latchkey-purge-") as tmp:
        for name in args.stores.split(","):
            running = None
            try:
                if name == "sqlite":
                    url = f"sqlite:///{tmp}/purge.db"
                else:
                    running = servers.SERVERS[SERVER[name]].start(Path(tmp) / name)
                    url = running.url
                row = measure(name, url, args.live, args.expired, args.pairs)
            finally:
                if running is not None:
                    running.stop()
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
