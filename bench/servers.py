"""Disposable servers for the benchmarks (the tests' own, tests/servers) and server-side counters.

Servers run on free loopback ports in a temporary directory, with the tests' settings: default
durability (PostgreSQL and MariaDB fsync every commit; Redis without persistence; memcached
with -M). The machine's own services on 5432/3306/6379 are never used.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import SERVERS, RunningServer, load_all  # noqa: E402

FAMILY_SERVERS = {
    "redis": ["redis"],
    "postgresql": ["postgresql"],
    "mysql": ["mysql"],
    "memcached": ["memcached"],
    "sqlite": [],
    "etcd": ["etcd"],
    "zookeeper": ["zookeeper"],
    "redis+cluster": ["redis_cluster"],
    "redis+sentinel": ["redis_sentinel"],
}


def start(families: list[str], workdir: Path) -> tuple[dict[str, str], list[RunningServer]]:
    """Start the servers the families need; return env (server → URL, plus tmp) and them."""
    load_all()
    env = {"tmp": str(workdir)}
    running: list[RunningServer] = []
    try:
        for family in families:
            for server in FAMILY_SERVERS[family]:
                srv = SERVERS[server].start(workdir / server)
                running.append(srv)
                env[server] = srv.url
    except BaseException:
        stop(running)
        raise
    return env, running


def stop(running: list[RunningServer]) -> None:
    for srv in running:
        with contextlib.suppress(Exception):
            srv.stop()


def enable_pg_stat_statements(srv: RunningServer) -> None:
    """Preload pg_stat_statements (a restart) so round trips can be counted per statement."""
    import psycopg

    with psycopg.connect(srv.url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    srv.stop()
    srv.start()
    with psycopg.connect(srv.url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")


def counters(server: str, env: dict[str, str]) -> Counter[str]:
    """The server's own statement/command counters right now."""
    if server == "redis":
        import redis

        r = redis.Redis.from_url(env["redis"])
        try:
            stats = r.info("commandstats")
            out = Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})
            out["(server time, µs)"] = sum(int(v["usec"]) for v in stats.values())
            return out
        finally:
            r.close()
    if server == "postgresql":
        import psycopg

        with psycopg.connect(env["postgresql"], autocommit=True) as conn:
            out: Counter[str] = Counter()
            with contextlib.suppress(psycopg.Error):
                for query, calls, micros in conn.execute(
                    "SELECT query, calls, total_exec_time * 1000 FROM pg_stat_statements"
                    " WHERE query NOT LIKE '%FROM pg_stat_statements%'"
                ):
                    out[" ".join(query.split())[:90]] += int(calls)
                    out["(server execution time, µs)"] += int(micros)
            row = conn.execute(
                "SELECT xact_commit, xact_rollback FROM pg_stat_database"
                " WHERE datname = current_database()"
            ).fetchone()
            assert row is not None
            out["(transactions committed)"] = int(row[0])
            out["(transactions rolled back)"] = int(row[1])
            return out
    if server == "mysql":
        from subjects import RawMy

        my = RawMy(env["mysql"], getlock=True)
        try:
            my.cur.execute("SHOW GLOBAL STATUS")
            wanted = ("Questions", "Com_", "Handler_commit", "Handler_rollback")
            return Counter({
                str(k): int(v) for k, v in my.cur.fetchall()
                if str(k).startswith(wanted) and str(v).isdigit()
            })  # fmt: skip
        finally:
            my.close()
    if server == "memcached":
        from pymemcache.client.base import Client

        host, port = env["memcached"].split("://", 1)[1].split(":")
        mc = Client((host, int(port)))
        try:
            stats: dict[Any, Any] = mc.stats()
            keep = ("cmd_", "get_", "delete_", "incr_", "decr_", "cas_", "touch_", "store_")
            return Counter({
                (k.decode() if isinstance(k, bytes) else str(k)): int(v)
                for k, v in stats.items()
                if (k.decode() if isinstance(k, bytes) else str(k)).startswith(keep)
                and isinstance(v, int)
            })  # fmt: skip
        finally:
            mc.close()
    return Counter()
