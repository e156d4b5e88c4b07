#!/usr/bin/env python3
"""Seed 002: many daemon processes draining one events table (issue 13).

    bench/.venv/bin/python bench/eventqueue.py [--stores postgresql,mysql,sqlite]
        [--subjects naive,for-update,skip1,take1,take10,lease10,lease10c,lease10cb,own1,own10]
        [--daemons 100]
        [--sqlite-daemons 8]
        [--rows 3000] [--kill-fraction 0.1] [--rounds normal,kill] [--out results.json]
        [--pg-index composite|partial]
    bench/.venv/bin/python bench/eventqueue.py --report results.json   # reprint a saved run

(Not ``bench/queue.py``: bench/ is first on sys.path here, and a module named ``queue`` would
shadow the standard library's, which multiprocessing imports.)

Per store and subject, fresh tables: ``ev_<tag>`` (id, payload, processed_at NULL; --rows due
rows) and ``pr_<tag>`` (event_id, pid, token), which every processing inserts into, so that
afterwards *doubles* (events with more than one ``pr`` row) and *lost* events (no ``pr`` row)
are counted exactly. The daemons are forked before the clock starts, each opens its
connections and runs one query, then all wait on a barrier; the clock runs from the barrier's
release (as the first daemon released reads ``CLOCK_MONOTONIC``) to the last daemon's exit.
Each daemon loops until no row of the table is left with ``processed_at IS NULL`` (an empty
batch alone is not enough: the last rows may be locked or leased by a daemon that is about
to be killed), bounded by a deadline and a loop count.

Subjects (the raw ones use psycopg 3 and PyMySQL, the drivers latchkey uses; sqlite3):

- ``naive``: autocommit ``SELECT id … WHERE processed_at IS NULL ORDER BY id LIMIT 1``, then
  ``UPDATE … SET processed_at``, then the record; no lock (the seed's first daemon).
- ``for-update``: the seed's fix, ``BEGIN; SELECT … LIMIT 1 FOR UPDATE; UPDATE; record;
  COMMIT``. On SQLite (no FOR UPDATE) the same transaction opened with ``BEGIN IMMEDIATE``.
- ``skip1``: the statements ``take1`` sends, by hand: ``BEGIN; SELECT * … LIMIT 1 FOR UPDATE
  SKIP LOCKED; UPDATE; record; COMMIT`` (an empty read while rows are due waits as take's
  daemons do): the floor of a one-row take on this machine, what take1 costs without latchkey.
- ``take1``, ``take10``: ``store.rows(...).take(limit=1|10)``; the UPDATE and the record go
  through ``batch.execute``, in the batch's transaction.
- ``lease10``: ``store.rows(...).lease(limit=10, ttl=…)``; per row, one transaction of the
  daemon's own connection does ``UPDATE … WHERE id = ? AND processed_at IS NULL`` and, only if
  that changed the row, the record (with ``batch.token(row)``); then ``batch.done(row)``.
- ``lease10c``: the same lease, but per row ``with batch.complete(row) as tx:`` runs the
  UPDATE and the record (with ``batch.token(row)``) in one transaction that also ends the
  row's lease, only if it is still ours (exactly once; one commit per row, not two).
- ``lease10cb``: the same with one ``batch.complete(*rows)`` for the whole batch (one commit
  per ten rows, as take10; the batch's work commits together).

Two floors, no claim at all (normal round only): daemon *i* of *n* owns the rows whose id is
*i* modulo *n*, so nothing is contended and nothing is read to find work; what is left is the
work's own cost at a given commit rate:

- ``own1``: per row, ``BEGIN; UPDATE; record; COMMIT`` (the statements ``lease10`` runs per row,
  without the lease): the most rows/s any scheme that commits every row can reach here
  (``take1``, ``for-update``, ``lease10``, ``lease10c``).
- ``own10``: the same with ten rows per transaction: the ceiling of ``take10`` and ``lease10cb``.

The ``kill`` round (take and lease subjects) SIGKILLs about --kill-fraction of the daemons in the
middle of a batch: a doomed daemon kills itself while handling its r-th row (r random in 1..15),
after that row's UPDATE and record were sent and before they were committed.

Each cell also gives the CPU spent per row: the daemons' own (their process time after the
start) and the whole machine's (``/proc/stat``, every core, the server included) — on two
cores a hundred daemons are CPU-bound, so these say where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import sqlite3
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

DASH = "\u2013"
#: The floors (above) and their rows per transaction.
FLOORS = {"own1": 1, "own10": 10}
SUBJECTS = ["naive", "for-update", "skip1", "take1", "take10", "lease10", "lease10c", "lease10cb",
            *FLOORS]
LATCHKEY_SUBJECTS = {"take1", "take10", "lease10", "lease10c", "lease10cb"}
LEASE_SUBJECTS = {"lease10", "lease10c", "lease10cb"}
STORES = ["postgresql", "mysql", "sqlite"]
LEASE_TTL = {"normal": "30s", "kill": "2s"}
#: Bounds: a daemon gives up after this many seconds or loop turns; the parent waits this long
#: for the barrier and for the whole subject.
#: (MariaDB's innodb_lock_wait_timeout is 50 s: a daemon blocked at its deadline still ends.)
DAEMON_SECONDS, DAEMON_TURNS = 120.0, 200_000
BARRIER_SECONDS, SUBJECT_SECONDS = 180.0, 200.0
#: A daemon that sees an empty batch while due rows remain (locked or leased elsewhere) sleeps
#: this long before it looks again.
IDLE_SLEEP = 0.02
#: How many errors (deadlocks, busy database …) one daemon retries before it reports failure.
MAX_ERRORS = 200

NOW = {"postgresql": "now()", "mysql": "NOW(6)", "sqlite": "datetime('now')"}
PH = {"postgresql": "%s", "mysql": "%s", "sqlite": "?"}


# -- connections ------------------------------------------------------------------------------


class Raw:
    """One autocommit connection of the store's own driver, with a transaction helper."""

    def __init__(self, store: str, env: dict[str, str], db_path: str) -> None:
        self.store = store
        if store == "postgresql":
            import psycopg

            self.conn: Any = psycopg.connect(env["postgresql"], autocommit=True)
        elif store == "mysql":
            import pymysql

            u = urlsplit(env["mysql"])
            self.conn = pymysql.connect(
                host=u.hostname, port=u.port or 3306, user=u.username or "root",
                password=u.password or "", database=u.path.lstrip("/"), autocommit=True,
            )  # fmt: skip
        else:
            self.conn = sqlite3.connect(db_path, isolation_level=None, timeout=60)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")

    def run(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[list[Any], int]:
        """Execute one statement; return its rows (if any) and its row count."""
        if self.store == "sqlite":
            sql = sql.replace("%s", "?")
        if self.store == "mysql":
            with self.conn.cursor() as cur:
                cur.execute(sql, params or None)
                return list(cur.fetchall() or ()), cur.rowcount
        cur = self.conn.execute(sql, params)
        rows = list(cur.fetchall()) if cur.description else []
        return rows, cur.rowcount

    def begin(self, immediate: bool = False) -> None:
        if self.store == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        else:
            self.run("BEGIN")

    def commit(self) -> None:
        self.run("COMMIT")

    def rollback(self) -> None:
        with contextlib.suppress(Exception):
            self.run("ROLLBACK")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def latchkey_url(store: str, env: dict[str, str], db_path: str, tag: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{db_path}?table=lk_{tag}"
    return f"{env[store]}?table=lk_{tag}"


def create_tables(raw: Raw, tag: str, rows: int, partial: bool = False) -> None:
    ev, pr = f"ev_{tag}", f"pr_{tag}"
    if raw.store == "postgresql":
        raw.run(f"CREATE TABLE {ev} (id integer PRIMARY KEY, payload text NOT NULL,"
                " processed_at timestamptz)")  # fmt: skip
        raw.run(f"CREATE TABLE {pr} (event_id integer NOT NULL, pid integer NOT NULL,"
                " token bigint)")  # fmt: skip
    elif raw.store == "mysql":
        raw.run(f"CREATE TABLE {ev} (id int PRIMARY KEY, payload varchar(200) NOT NULL,"
                " processed_at datetime(6) NULL) ENGINE=InnoDB")  # fmt: skip
        raw.run(f"CREATE TABLE {pr} (n int AUTO_INCREMENT PRIMARY KEY, event_id int NOT NULL,"
                " pid int NOT NULL, token bigint) ENGINE=InnoDB")  # fmt: skip
    else:
        raw.run(f"CREATE TABLE {ev} (id INTEGER PRIMARY KEY, payload TEXT NOT NULL,"
                " processed_at TEXT)")  # fmt: skip
        raw.run(f"CREATE TABLE {pr} (event_id INTEGER NOT NULL, pid INTEGER NOT NULL,"
                " token INTEGER)")  # fmt: skip
    # The index a queue table has: due rows in id order. --pg-index partial: PostgreSQL's
    # partial index of the due rows, which the how-to recommends there (see the how-to: the
    # composite index keeps every processed row's dead NULL entry at the head of each scan).
    if raw.store == "postgresql" and partial:
        raw.run(f"CREATE INDEX {ev}_due ON {ev} (id) WHERE processed_at IS NULL")
    else:
        raw.run(f"CREATE INDEX {ev}_due ON {ev} (processed_at, id)")
    values = [(i, f"event {i}") for i in range(1, rows + 1)]
    raw.begin()
    if raw.store in ("mysql", "postgresql"):
        with raw.conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {ev} (id, payload) VALUES (%s, %s)", values)
    else:
        raw.conn.executemany(f"INSERT INTO {ev} (id, payload) VALUES (?, ?)", values)
    raw.commit()
    if raw.store == "postgresql":
        raw.run(f"ANALYZE {ev}")


def count(raw: Raw, tag: str, rows: int) -> dict[str, int]:
    ev, pr = f"ev_{tag}", f"pr_{tag}"
    one = lambda sql: int(raw.run(sql)[0][0][0])  # noqa: E731
    return {
        "records": one(f"SELECT count(*) FROM {pr}"),
        "distinct": one(f"SELECT count(DISTINCT event_id) FROM {pr}"),
        "doubles": one(
            f"SELECT count(*) FROM (SELECT event_id FROM {pr} GROUP BY event_id"
            " HAVING count(*) > 1) d"
        ),
        "lost": one(
            f"SELECT count(*) FROM {ev} e WHERE NOT EXISTS"
            f" (SELECT 1 FROM {pr} p WHERE p.event_id = e.id)"
        ),
        "unmarked": one(f"SELECT count(*) FROM {ev} WHERE processed_at IS NULL"),
        "rows": rows,
    }


# -- one daemon -------------------------------------------------------------------------------


def daemon(cfg: dict[str, Any], index: int, barrier: Any, kill_at: int) -> None:
    """A daemon process: connect, warm up, wait for the start, drain the queue, report."""
    store, subject, tag = cfg["store"], cfg["subject"], cfg["tag"]
    ev, pr, now = f"ev_{tag}", f"pr_{tag}", NOW[store]
    out: dict[str, Any] = {"index": index, "pid": os.getpid(), "rows": 0, "batches": 0,
                           "errors": 0, "first_error": None, "guard": 0, "empty": 0,
                           "status": "started"}  # fmt: skip
    handled = 0  # rows whose statements were sent (for the kill point)

    def maybe_die() -> None:
        nonlocal handled
        handled += 1
        if kill_at and handled == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def note_error(exc: BaseException) -> None:
        out["errors"] += 1
        if out["first_error"] is None:
            out["first_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if out["errors"] > MAX_ERRORS:
            raise RuntimeError(f"more than {MAX_ERRORS} errors; first: {out['first_error']}")

    raw = queue = store_obj = None
    try:
        raw = Raw(store, cfg["env"], cfg["db_path"])
        raw.run(f"SELECT count(*) FROM {ev}")
        if subject in LATCHKEY_SUBJECTS:
            import latchkey

            store_obj = latchkey.connect(cfg["latchkey_url"])
            queue = store_obj.rows(ev, key="id", where="processed_at IS NULL", order_by="id")
        barrier.wait(BARRIER_SECONDS)
        out["start"] = time.monotonic()  # the clock starts at the first daemon's release
        cpu_start = time.process_time()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        out["status"] = "failed before start"
        out["first_error"] = f"{type(exc).__name__}: {exc}"[:300]
        write_result(cfg, index, out)
        return

    # In the driver's own placeholder style: batch.execute passes them on as they are.
    update = f"UPDATE {ev} SET processed_at = {now} WHERE id = %s".replace("%s", PH[store])
    record = f"INSERT INTO {pr} (event_id, pid, token) VALUES (%s, %s, %s)".replace("%s", PH[store])
    due = f"SELECT id FROM {ev} WHERE processed_at IS NULL ORDER BY id LIMIT 1"
    deadline = time.monotonic() + DAEMON_SECONDS
    pid = os.getpid()
    own = list(range(1 + index, cfg["rows"] + 1, cfg["daemons"]))  # the floors' share
    try:
        for _turn in range(DAEMON_TURNS):
            if time.monotonic() > deadline:
                out["status"] = "deadline"
                break
            if subject == "naive":
                found, _ = raw.run(due)
                if not found:
                    out["status"] = "done"
                    break
                raw.run(update, (found[0][0],))
                raw.run(record, (found[0][0], pid, None))
                out["rows"] += 1
                continue
            if subject in FLOORS:
                mine = own[: FLOORS[subject]]
                del own[: FLOORS[subject]]
                if not mine:
                    out["status"] = "done"
                    break
                try:
                    raw.begin(immediate=True)  # on SQLite as for-update; else a plain BEGIN
                    for row_id in mine:
                        raw.run(update, (row_id,))
                        raw.run(record, (row_id, pid, None))
                    raw.commit()
                except Exception as exc:
                    raw.rollback()
                    own[:0] = mine
                    note_error(exc)
                    continue
                out["rows"] += len(mine)
                out["batches"] += 1
                continue
            if subject in ("for-update", "skip1"):
                # skip1 reads the whole row, as take hands it out (columns=None)
                read = due if subject == "for-update" else due.replace("SELECT id", "SELECT *")
                lock = " FOR UPDATE" if subject == "for-update" else " FOR UPDATE SKIP LOCKED"
                try:
                    raw.begin(immediate=True)
                    found, _ = raw.run(read if store == "sqlite" else read + lock)
                    if found:
                        raw.run(update, (found[0][0],))
                        raw.run(record, (found[0][0], pid, None))
                    raw.commit()
                except Exception as exc:
                    raw.rollback()
                    note_error(exc)
                    continue
                if not found and subject == "skip1" and raw.run(due)[0]:
                    out["empty"] += 1  # due rows remain, locked by others
                    time.sleep(IDLE_SLEEP)
                    continue
                if not found:
                    out["status"] = "done"
                    break
                out["rows"] += 1
                continue
            limit = 1 if subject == "take1" else 10
            got = 0
            try:
                if subject.startswith("take"):
                    assert queue is not None
                    with queue.take(limit=limit, wait=0) as batch:
                        rows = list(batch)
                        for row in rows:
                            batch.execute(update, (row["id"],))
                            batch.execute(record, (row["id"], pid, None))
                            maybe_die()
                        got = len(rows)
                elif subject in ("lease10c", "lease10cb"):
                    assert queue is not None
                    with queue.lease(limit=limit, ttl=cfg["ttl"], wait=0) as batch:
                        rows = list(batch)
                        groups = [[r] for r in rows] if subject == "lease10c" else [rows]
                        for group in groups:
                            if not group:
                                continue
                            try:
                                with batch.complete(*group) as tx:
                                    for row in group:
                                        tx.execute(update, (row["id"],))
                                        tx.execute(record, (row["id"], pid, batch.token(row)))
                                        maybe_die()
                            except latchkey.LockLost:
                                out["guard"] += len(group)  # rolled back: the row is another's
                        got = len(rows)
                else:
                    assert queue is not None
                    with queue.lease(limit=limit, ttl=cfg["ttl"], wait=0) as batch:
                        rows = list(batch)
                        for row in rows:
                            raw.begin()
                            try:
                                _, changed = raw.run(update + " AND processed_at IS NULL",
                                                     (row["id"],))  # fmt: skip
                                if changed == 1:
                                    raw.run(record, (row["id"], pid, batch.token(row)))
                                maybe_die()
                                raw.commit()
                            except BaseException:
                                raw.rollback()
                                raise
                            if changed != 1:
                                out["guard"] += 1  # the row was done by another daemon
                            batch.done(row)
                        got = len(rows)
            except Exception as exc:
                note_error(exc)
                time.sleep(IDLE_SLEEP)
                continue
            out["batches"] += 1
            out["rows"] += got
            if got == 0:
                found, _ = raw.run(due)
                if not found:
                    out["status"] = "done"
                    break
                out["empty"] += 1  # nothing for us, yet rows are due (held by others)
                time.sleep(IDLE_SLEEP)
        else:
            out["status"] = "too many turns"
    except BaseException as exc:
        out["status"] = "failed"
        out["first_error"] = out["first_error"] or f"{type(exc).__name__}: {exc}"[:300]
    out["end"] = time.monotonic()
    out["cpu"] = time.process_time() - cpu_start
    with contextlib.suppress(Exception):
        if store_obj is not None:
            store_obj.close()
    if raw is not None:
        raw.close()
    write_result(cfg, index, out)


def write_result(cfg: dict[str, Any], index: int, out: dict[str, Any]) -> None:
    Path(cfg["results_dir"], f"{index}.json").write_text(json.dumps(out))


# -- one subject --------------------------------------------------------------------------------


def run_subject(
    store: str,
    subject: str,
    round_: str,
    env: dict[str, str],
    workdir: Path,
    args: Any,
    rep: int = 0,
) -> dict[str, Any]:
    daemons = args.sqlite_daemons if store == "sqlite" else args.daemons
    tag = f"{subject.replace('-', '_')}_{round_}_{int(time.time() * 1000) % 10**8}"
    db_path = str(workdir / "events.db")
    results_dir = workdir / f"res_{store}_{tag}"
    results_dir.mkdir()
    cfg = {"store": store, "subject": subject, "tag": tag, "env": env, "db_path": db_path,
           "latchkey_url": latchkey_url(store, env, db_path, tag), "ttl": LEASE_TTL[round_],
           "results_dir": str(results_dir), "rows": args.rows, "daemons": daemons}  # fmt: skip
    cell: dict[str, Any] = {"store": store, "subject": subject, "round": round_, "rep": rep,
                            "daemons": daemons, "rows": args.rows}  # fmt: skip
    if subject in LEASE_SUBJECTS:
        cell["ttl"] = cfg["ttl"]
    setup = Raw(store, env, db_path)
    try:
        create_tables(setup, tag, args.rows, args.pg_index == "partial")
    finally:
        setup.close()
    if subject in LEASE_SUBJECTS:
        # latchkey's lease table exists before the clock starts, as in a queue that has run
        # before: otherwise the first lessees create it inside the timed window, taking turns
        # on the DDL lock (on PostgreSQL 34 of 100 daemons did, 5.3 s of waiting in all).
        import latchkey

        with latchkey.connect(cfg["latchkey_url"]) as lk:
            lk.init()
    rng = random.Random(f"{store}/{subject}/{round_}/{rep}")
    doomed: dict[int, int] = {}
    if round_ == "kill":
        for i in rng.sample(range(daemons), max(1, round(daemons * args.kill_fraction))):
            doomed[i] = rng.randint(1, 15)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(daemons + 1)
    procs = [ctx.Process(target=daemon, args=(cfg, i, barrier, doomed.get(i, 0)), daemon=True)
             for i in range(daemons)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        barrier.wait(BARRIER_SECONDS)
    except Exception as exc:  # a daemon could not start
        cell["failed"] = f"start: {type(exc).__name__}"
    machine = machine_cpu()  # from the start (the daemons' imports and connects are before)
    started = time.monotonic()
    deadline = started + SUBJECT_SECONDS
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stragglers = [p for p in procs if p.is_alive()]
    for p in stragglers:  # our own children, by pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    if stragglers:
        cell["failed"] = f"{len(stragglers)} daemons still running after {SUBJECT_SECONDS:.0f}s"
    machine = machine_cpu() - machine
    reports = []
    for i in range(daemons):
        f = results_dir / f"{i}.json"
        if f.exists():
            reports.append(json.loads(f.read_text()))
    ends = [r["end"] for r in reports if "end" in r]
    cell["killed"] = sum(1 for p in procs if p.exitcode == -signal.SIGKILL) - len(stragglers)
    # From the first daemon's release (CLOCK_MONOTONIC is one clock for every process), not
    # from the parent's: on two cores a hundred busy daemons can keep the parent from running
    # for a good part of a short subject, which made its rate look several times higher.
    starts = [r["start"] for r in reports if "start" in r]
    began = min(starts) if starts else started
    cell["wall_s"] = round(max(ends) - began, 3) if ends else None
    statuses: dict[str, int] = {}
    for r in reports:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    cell["statuses"] = statuses
    cell["errors"] = sum(r["errors"] for r in reports)
    errs = [r["first_error"] for r in reports if r.get("first_error")]
    if errs:
        cell["first_error"] = errs[0]
    cell["guard"] = sum(r["guard"] for r in reports)
    cell["empty"] = sum(r.get("empty", 0) for r in reports)
    finished = [r["rows"] for r in reports if "end" in r]
    if finished:  # how evenly the work spread: the fewest and most rows one daemon did
        cell["per_daemon"] = [min(finished), max(finished)]
    if any(s not in ("done",) for s in statuses) and "failed" not in cell:
        bad = {s: n for s, n in statuses.items() if s != "done"}
        cell["failed"] = f"daemons ended {bad}"
    check = Raw(store, env, db_path)
    try:
        cell.update(count(check, tag, args.rows))
    finally:
        check.close()
    if cell["wall_s"]:
        cell["rows_per_s"] = round(cell["distinct"] / cell["wall_s"], 1)
    if cell.get("distinct"):  # CPU per row: the daemons' own, and the whole machine's
        daemons_cpu = sum(r.get("cpu", 0.0) for r in reports)
        cell["daemon_cpu_us_per_row"] = round(1e6 * daemons_cpu / cell["distinct"])
        cell["machine_cpu_us_per_row"] = round(1e6 * machine / cell["distinct"])
    return cell


def machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy (every core; /proc/stat: user, nice,
    system, irq, softirq), or 0 where there is no /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pg_statements(env: dict[str, str]) -> list[str]:
    """The costliest statements since the last call (server execution time), then reset."""
    import psycopg

    with psycopg.connect(env["postgresql"], autocommit=True) as conn:
        found = conn.execute(
            "SELECT total_exec_time, calls, query FROM pg_stat_statements"
            " WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY total_exec_time DESC LIMIT 6"
        ).fetchall()
        conn.execute("SELECT pg_stat_statements_reset()")
    return [f"{ms:,.0f} ms in {calls:,} calls ({ms / max(calls, 1):.2f} ms each):"
            f" {' '.join(query.split())[:110]}" for ms, calls, query in found]  # fmt: skip


# -- report -----------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    lines = ["| store | subject | round | daemons | rows/s | doubles | lost | wall | notes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for cell in results["cells"]:
        notes = []
        if cell.get("killed"):
            notes.append(f"{cell['killed']} killed")
        if cell.get("ttl"):
            notes.append(f"ttl {cell['ttl']}")
        if cell.get("errors"):
            notes.append(f"{cell['errors']} retried errors")
        if cell.get("empty"):
            notes.append(f"{cell['empty']} empty batches while rows were due")
        if cell.get("guard"):
            notes.append(f"{cell['guard']} rows already done when leased")
        if cell.get("records", 0) != cell.get("distinct", 0):
            notes.append(f"{cell['records'] - cell['distinct']} extra records")
        if cell.get("failed"):
            notes.append(f"FAILED: {cell['failed']}")
            if cell.get("first_error"):
                notes.append(cell["first_error"][:120])
        if cell.get("per_daemon"):
            low, high = cell["per_daemon"]
            notes.append(f"rows per daemon {low}{DASH}{high}")
        if cell.get("machine_cpu_us_per_row"):
            notes.append(f"CPU per row: daemons {cell['daemon_cpu_us_per_row']} µs, machine "
                         f"{cell['machine_cpu_us_per_row']} µs")  # fmt: skip
        rate = f"{cell['rows_per_s']:,.0f}" if cell.get("rows_per_s") else DASH
        wall = f"{cell['wall_s']:.1f} s" if cell.get("wall_s") else DASH
        lines.append(
            f"| {cell['store']} | {cell['subject']} | {cell['round']} | {cell['daemons']} |"
            f" {rate} | {cell.get('doubles', DASH)} | {cell.get('lost', DASH)} | {wall} |"
            f" {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def summary(results: dict[str, Any]) -> str:
    """Per store, subject and round over the repetitions: median rows/s (range), and doubles,
    lost rows and killed daemons summed over all of them."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for cell in results["cells"]:
        groups.setdefault((cell["store"], cell["subject"], cell["round"]), []).append(cell)
    head = "| store | subject | round | runs | rows/s, median (range) | doubles | lost | killed |"
    lines = [head + " failed runs |", "| --- " * 9 + "|"]
    for (store, subject, round_), cells in groups.items():
        rates = sorted(c["rows_per_s"] for c in cells if c.get("rows_per_s"))
        rate = (f"{statistics.median(rates):,.0f} ({rates[0]:,.0f}{DASH}{rates[-1]:,.0f})"
                if rates else DASH)  # fmt: skip
        failed = sum(1 for c in cells if c.get("failed"))
        lines.append(
            f"| {store} | {subject} | {round_} | {len(cells)} | {rate} |"
            f" {sum(c.get('doubles', 0) for c in cells)} | {sum(c.get('lost', 0) for c in cells)}"
            f" | {sum(c.get('killed', 0) for c in cells)} | {failed or ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--subjects", default=",".join(SUBJECTS))
    parser.add_argument("--rounds", default="normal,kill")
    parser.add_argument("--daemons", type=int, default=100)
    parser.add_argument("--sqlite-daemons", type=int, default=8)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--kill-fraction", type=float, default=0.1)
    parser.add_argument("--innodb-deadlock-detect", choices=["on", "off"], default="on",
                        help="MariaDB's setting (default on, as shipped)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3, help="runs of every subject")
    parser.add_argument("--pg-index", choices=["composite", "partial"], default="composite",
                        help="PostgreSQL's index of due rows: (processed_at, id), or (id) WHERE"
                        " processed_at IS NULL")  # fmt: skip
    parser.add_argument("--pg-stats", action="store_true",
                        help="PostgreSQL: preload pg_stat_statements and keep each subject's"
                        " costliest statements (server time) in its cell")  # fmt: skip
    parser.add_argument("--out")
    parser.add_argument("--report")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(table(saved))
        print()
        print(summary(saved))
        return
    stores = [s for s in args.stores.split(",") if s]
    subjects = [s for s in args.subjects.split(",") if s]
    rounds = [r for r in args.rounds.split(",") if r]
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "load_before": os.getloadavg(),
        "pg_index": args.pg_index,
        "cells": [],
    }
    with tempfile.TemporaryDirectory(prefix="latchkey-queue-") as tmp:
        env, running = servers.start([s for s in stores if s != "sqlite"], Path(tmp))
        try:
            if args.pg_stats and "postgresql" in env:
                pg = next(srv for srv in running if srv.url == env["postgresql"])
                servers.enable_pg_stat_statements(pg)
            if "mysql" in env and args.innodb_deadlock_detect == "off":
                setting = Raw("mysql", env, "")
                setting.run("SET GLOBAL innodb_deadlock_detect = OFF")
                setting.close()
            # FOR UPDATE last on each store: on MariaDB its long queue leaves the server busy
            # (purge) for a while, which would slow whatever ran next.
            plan = [
                (r, s)
                for r in rounds
                for s in subjects
                if (r == "normal" or s in LATCHKEY_SUBJECTS) and s != "for-update"
            ]
            plan += [(r, s) for r in rounds for s in subjects
                     if r == "normal" and s == "for-update"]  # fmt: skip
            for store in stores:
                for rep in range(args.repeat):
                    # the subjects' order turns each repetition; FOR UPDATE stays last
                    turn = rep % (len(plan) - 1) if len(plan) > 1 else 0
                    rest, last = plan[:-1], plan[-1:]
                    if not any(s == "for-update" for _, s in last):
                        rest, last = plan, []
                    for round_, subject in rest[turn:] + rest[:turn] + last:
                        try:
                            cell = run_subject(store, subject, round_, env, Path(tmp), args, rep)
                        except Exception as exc:
                            failed = f"{type(exc).__name__}: {exc}"[:300]
                            cell = {"store": store, "subject": subject, "round": round_,
                                    "rep": rep, "daemons": DASH, "failed": failed}  # fmt: skip
                        if args.pg_stats and store == "postgresql":
                            cell["statements"] = pg_statements(env)
                        results["cells"].append(cell)
                        print(table({"cells": [cell]}).splitlines()[-1], flush=True)
                        for line in cell.get("statements", [])[:4]:
                            print("    " + line, flush=True)
        finally:
            servers.stop(running)
    results["load_after"] = os.getloadavg()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print()
    print(table(results))
    print()
    print(summary(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
