#!/usr/bin/env python3
"""The cost of latchkey's own SQL, sent raw through the driver (no latchkey code around it).

    bench/.venv/bin/python bench/statements.py [--slices 12]

Alternates, in 0.5 s slices in one process, acquire+release pairs made of:

PostgreSQL (psycopg, autocommit, prepared):
- ``minimal``: INSERT … ON CONFLICT DO NOTHING RETURNING / DELETE (bench/subjects.py);
- ``minimal+notify``: the same, with pg_notify in the DELETE statement;
- ``latchkey SQL``: latchkey's ACQUIRE_MUTEX and RELEASE statements, same parameters;
- ``advisory``: pg_advisory_lock / pg_advisory_unlock;
- ``advisory+notify``: pg_advisory_lock / pg_advisory_unlock + pg_notify (a notify makes the
  transaction take an XID, so its commit writes and flushes WAL);
- ``latchkey advisory SQL``: latchkey's TRY_LOCK and UNLOCK statements.

So "statement cost" (latchkey SQL minus minimal) is told apart from Python-side cost (see
breakdown.py for backend and core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import subjects  # noqa: E402

import servers  # noqa: E402


def rate(pair: Callable[[], None], seconds: float) -> float:
    n, started = 0, time.perf_counter()
    while n < 100_000 and time.perf_counter() - started < seconds:
        pair()
        n += 1
    return n / (time.perf_counter() - started)


def pg_pairs(url: str) -> dict[str, Callable[[], None]]:
    import psycopg

    import latchkey
    from latchkey._owner import Owner
    from latchkey.stores import pg_advisory, postgresql

    store = latchkey.connect(url + "?table=stmt_locks")
    store.init()
    backend = store.backend
    assert isinstance(backend, postgresql.PostgreSQLBackend)
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(subjects.PG_CREATE)
    # latchkey's own statements, rendered for its table, sent as they are
    acquire_sql = backend._render(conn, postgresql.ACQUIRE_MUTEX)
    release_sql = backend._render(conn, postgresql.RELEASE)
    info = Owner.current().to_json()
    name = b"stmt"
    key = subjects.key64("stmt")

    def minimal(notify: bool) -> Callable[[], None]:
        delete = subjects.PG_DELETE_NOTIFY if notify else subjects.PG_DELETE

        def pair() -> None:
            owner = subjects.token()
            conn.execute(subjects.PG_INSERT, ("stmt", owner), prepare=True).fetchone()
            conn.execute(delete, ("stmt", owner), prepare=True)

        return pair

    def latchkey_sql() -> None:
        owner = subjects.token()
        params = {"name": name, "owner": owner, "owner_info": info, "ttl": 30.0}
        conn.execute(acquire_sql, params, prepare=True).fetchall()
        params = {"name": name, "owner": owner, "channel": backend.channel}
        conn.execute(release_sql, params, prepare=True).fetchall()

    def advisory(notify: bool) -> Callable[[], None]:
        unlock = (
            "SELECT pg_advisory_unlock(%s), pg_notify('bench', 'x')"
            if notify
            else subjects.PG_ADV_UNLOCK
        )

        def pair() -> None:
            conn.execute(subjects.PG_ADV_LOCK, (key,), prepare=True).fetchall()
            conn.execute(unlock, (key,), prepare=True).fetchall()

        return pair

    hi, lo = (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF

    def latchkey_advisory_sql() -> None:
        params = {"key": key, "hi": hi, "lo": lo}
        conn.execute(pg_advisory.TRY_LOCK, params, prepare=True).fetchall()
        conn.execute(pg_advisory.UNLOCK, {"key": key}, prepare=True).fetchall()

    return {
        "pg minimal": minimal(False),
        "pg minimal+notify": minimal(True),
        "pg latchkey SQL": latchkey_sql,
        "pg advisory": advisory(False),
        "pg advisory+notify": advisory(True),
        "pg latchkey advisory SQL": latchkey_advisory_sql,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--slices", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="latchkey-statements-"))
    workdir.chmod(0o755)
    env, running = servers.start(["postgresql"], workdir)
    try:
        pairs = pg_pairs(env["postgresql"])
        for pair in pairs.values():
            rate(pair, 0.3)
        got: dict[str, list[float]] = {k: [] for k in pairs}
        order = list(pairs)
        for i in range(args.slices):
            for k in order if i % 2 == 0 else order[::-1]:
                got[k].append(rate(pairs[k], args.seconds))
    finally:
        servers.stop(running)
    print("| pair of statements | pairs/s | µs/pair |")
    print("| --- | --- | --- |")
    for k, v in got.items():
        med = statistics.median(v)
        print(f"| {k} | {med:,.0f} | {1e6 / med:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
