#!/usr/bin/env python3
"""How fast could a MariaDB lease table hand a lease over between processes? A probe of one
server-side wake-up (issue 17 item 2: the lease table polls there, ~60 ms a hand-off).

    PYTHONPATH=src bench/.venv/bin/python bench/mariadb_bell.py [--reps 40]

Not latchkey code: raw PyMySQL, the bench's own disposable MariaDB (bench/servers.py).
Subjects, each timed from the holder's release call to the waiter's grant, both reading
CLOCK_MONOTONIC (one clock for every process on the machine):

- ``kill``: the waiter registers its connection id in a MEMORY table (emptied by a restart, so
  a stale id cannot outlive the server's thread ids), then sleeps in the server
  (``SELECT SLEEP(t)``) on that connection, which a ``KILL QUERY`` ends (MariaDB answers
  error 1317, query interrupted; the connection stays usable); the release is one round trip —
  ``DELETE`` of the lease, then ``SELECT`` of the first waiter's id, as two statements of one
  multi-statement query — and, only when a waiter is there, ``KILL QUERY <id>`` on the same
  connection. The woken waiter inserts its lease row.
- ``kill-txn``: latchkey's own protocol (``latchkey.stores.mysql_bells``), sent raw: the
  release is one multi-statement round trip — in a transaction, the lease row made free (not
  deleted), the first waiter's id read and ``KILL QUERY``'d, then ``COMMIT`` — so the woken
  waiter's statement is on its way while the commit is flushed (it waits for the row lock);
  the waiter takes the row over with an ``UPDATE``. The floor of latchkey's hand-off: the
  same round trips and commits with none of latchkey's Python.
- ``getlock``: the reference, a raw ``GET_LOCK`` hand-off (the waiter blocks in the server,
  the holder's ``RELEASE_LOCK`` wakes it): the least a server-side wake-up costs here.
- ``poll``: the waiter polls the lease row every 50 ms (about the lease table's median today).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import servers  # noqa: E402

SETUP = [
    "CREATE TABLE IF NOT EXISTS lease (name VARBINARY(64) PRIMARY KEY, owner VARCHAR(40))",
    "CREATE TABLE IF NOT EXISTS bell (name VARBINARY(64), conn BIGINT UNSIGNED, since BIGINT,"
    " PRIMARY KEY (name, conn)) ENGINE=MEMORY",
]


def connect(url: str) -> Any:
    import pymysql
    from pymysql.constants import CLIENT

    u = urlsplit(url)
    return pymysql.connect(
        host=u.hostname, port=u.port or 3306, user=u.username or "root",
        password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
        client_flag=CLIENT.MULTI_STATEMENTS,
    )  # fmt: skip


def waiter(url: str, subject: str, ready: Any, go: Any, out: Any) -> None:
    import pymysql

    conn = connect(url)
    cur = conn.cursor()
    if subject == "getlock":
        ready.set()
        cur.execute("SELECT GET_LOCK('probe', 30)")
        out.put(time.monotonic())
        go.wait(30)
        cur.execute("SELECT RELEASE_LOCK('probe')")
        return
    cur.execute("SELECT CONNECTION_ID()")
    me = cur.fetchone()[0]
    while True:
        if subject == "handover":  # did the release hand it to us? (waits for its commit)
            cur.execute(
                "SELECT 1 FROM lease WHERE name = 'probe' AND owner = 'w' LOCK IN SHARE MODE"
            )
            if cur.fetchall():
                break
        elif subject == "kill-txn":
            cur.execute("UPDATE lease SET owner = 'w' WHERE name = 'probe' AND owner = ''")
            if cur.rowcount == 1:
                break
        else:
            try:
                cur.execute("INSERT INTO lease VALUES ('probe', 'w')")
                break
            except pymysql.err.IntegrityError:
                pass
        if subject in ("kill", "kill-txn", "handover"):
            cur.execute("INSERT IGNORE INTO bell VALUES ('probe', %s, 0)", (me,))
            ready.set()
            try:  # a KILL QUERY ends it: MariaDB answers error 1317 (MySQL: SLEEP returns 1)
                cur.execute("SELECT SLEEP(30)")
                cur.fetchall()
            except pymysql.err.OperationalError as exc:
                if exc.args[0] != 1317:
                    raise
        else:
            ready.set()
            time.sleep(0.05)
    out.put(time.monotonic())
    cur.execute("DELETE FROM bell WHERE name = 'probe' AND conn = %s", (me,))
    go.wait(30)
    cur.execute("DELETE FROM lease WHERE name = 'probe'")


def hand_off(url: str, subject: str) -> float:
    holder = connect(url)
    cur = holder.cursor()
    if subject == "getlock":
        cur.execute("SELECT GET_LOCK('probe', 30)")
    elif subject in ("kill-txn", "handover"):  # the row stays; '' is free
        cur.execute("INSERT INTO lease VALUES ('probe', 'h') ON DUPLICATE KEY UPDATE owner = 'h'")
    else:
        cur.execute("INSERT INTO lease VALUES ('probe', 'h')")
    ready, go, out = mp.Event(), mp.Event(), mp.Queue()
    proc = mp.Process(target=waiter, args=(url, subject, ready, go, out))
    proc.start()
    ready.wait(30)
    time.sleep(0.05 + 0.2 * (hash(time.time()) % 100) / 100)  # the waiter really waits
    started = time.monotonic()
    if subject == "getlock":
        cur.execute("SELECT RELEASE_LOCK('probe')")
    elif subject == "kill-txn":
        cur.execute(
            "START TRANSACTION;"
            " UPDATE lease SET owner = '' WHERE name = 'probe' AND owner = 'h';"
            " SET @w = (SELECT conn FROM bell WHERE name = 'probe' ORDER BY since LIMIT 1);"
            " DELETE FROM bell WHERE name = 'probe' AND conn = @w;"
            " KILL QUERY @w; COMMIT"
        )
        while cur.nextset():
            pass
    elif subject == "handover":
        cur.execute(
            "START TRANSACTION;"
            " SELECT owner FROM lease WHERE name = 'probe' AND owner = 'h' FOR UPDATE;"
            " SET @w = (SELECT conn FROM bell WHERE name = 'probe' ORDER BY since LIMIT 1);"
            " KILL QUERY @w;"
            " DELETE FROM lease WHERE name = 'probe';"
            " INSERT INTO lease VALUES ('probe', 'w');"
            " DELETE FROM bell WHERE name = 'probe' AND conn = @w; COMMIT"
        )
        while cur.nextset():
            pass
    elif subject == "kill":
        cur.execute(
            "DELETE FROM lease WHERE name = 'probe' AND owner = 'h';"
            " SELECT conn FROM bell WHERE name = 'probe' ORDER BY since LIMIT 1"
        )
        cur.nextset()
        row = cur.fetchone()
        if row is not None:
            cur.execute(f"KILL QUERY {int(row[0])}")
    else:
        cur.execute("DELETE FROM lease WHERE name = 'probe' AND owner = 'h'")
    granted = out.get(timeout=30)
    go.set()
    proc.join(30)
    holder.close()
    return (granted - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="latchkey-bell-") as tmp:
        env, running = servers.start(["mysql"], Path(tmp))
        try:
            setup = connect(env["mysql"])
            for sql in SETUP:
                setup.cursor().execute(sql)
            times: dict[str, list[float]] = {
                "handover": [], "kill-txn": [], "kill": [], "getlock": [], "poll": []
            }
            for _ in range(args.reps):
                for subject in times:  # interleaved, so each sees the same load
                    times[subject].append(hand_off(env["mysql"], subject))
            for subject, ms in times.items():
                ms.sort()
                p90 = ms[int(len(ms) * 0.9) - 1]
                print(f"{subject:8} hand-off median {statistics.median(ms):6.2f} ms,"
                      f" p90 {p90:6.2f} ms ({len(ms)} hand-offs)")  # fmt: skip
        finally:
            servers.stop(running)


if __name__ == "__main__":
    main()
