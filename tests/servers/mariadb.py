"""A disposable MariaDB server for the tests, and the two MySQL store rows.

``mariadb-install-db`` creates a fresh data directory in the test workdir, then ``mariadbd``
listens on 127.0.0.1 on a free port (its unix socket and pid file stay in the workdir) with
MariaDB's default durability (InnoDB flushes the redo log at every commit): the fault tests
stop and restart it and expect committed leases and fencing counters to survive. ``root``
has no password over TCP; the tests create their own users where they need one.

The failover tests start a primary with a binary log (``start(workdir, primary=True)``) and
a GTID replica of it (:func:`start_replica`), and promote the replica with :func:`promote`.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql

from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    ensure_binary,
    free_port,
    keep,
    read_pidfile,
    replace_scheme,
    wait_port_open,
    with_query,
)
from tests.servers.pairs import ReplicatedPair, until

DATABASE = "latchkey_test"


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False, timeout=180)
    if proc.returncode != 0:
        raise ServerUnavailable(f"{what} failed ({proc.returncode}): {proc.stderr[-800:]}")


def _create_database(port: int) -> None:
    conn = pymysql.connect(host="127.0.0.1", port=port, user="root", connect_timeout=10)
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE} CHARACTER SET utf8mb4")
    finally:
        conn.close()


def start(
    workdir: Path, primary: bool = False, binlog_format: str = "ROW", options: tuple[str, ...] = ()
) -> RunningServer:
    """Install a fresh data directory in ``workdir`` and start mariadbd on a free port.
    ``primary``: with a binary log (``binlog_format``: ROW, MIXED — MariaDB's default — or
    STATEMENT) and server id 1, ready for :func:`start_replica`; ``options``: more of
    mariadbd's (``--ssl-cert=…``)."""
    if primary:
        return _start(
            workdir,
            ["--log-bin=mariadb-bin", "--server-id=1", f"--binlog-format={binlog_format}",
             *options],
        )  # fmt: skip
    return _start(workdir, ["--skip-log-bin", *options])


def _start(
    workdir: Path, options: list[str], database: bool = True, port: int | None = None
) -> RunningServer:
    mariadbd = ensure_binary("mariadbd", "mariadb-server", search=("/usr/sbin/mariadbd",))
    install_db = ensure_binary("mariadb-install-db", "mariadb-server")
    data, run, tmp = workdir / "data", workdir / "run", workdir / "tmp"
    run.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(exist_ok=True)  # the server's temporary files: its own, not the machine's /tmp
    install = [install_db, "--no-defaults", f"--datadir={data}", "--user=root",
               "--auth-root-authentication-method=normal", "--skip-test-db", f"--tmpdir={tmp}"]
    try:
        _run(install, workdir, "mariadb-install-db")
    except ServerUnavailable:
        # Seen twice in a row under a loaded CI run (a segmentation fault of the bootstrap
        # server, after "Could not remove temporary table" in /tmp), never alone: once more,
        # on a fresh data directory, before the test is failed for it.
        shutil.rmtree(data, ignore_errors=True)
        _run(install, workdir, "mariadb-install-db")
    port = free_port() if port is None else port
    pidfile = run / "mariadbd.pid"
    cmd = [
        mariadbd, "--no-defaults", f"--datadir={data}", f"--socket={run / 'mariadbd.sock'}",
        f"--port={port}", "--bind-address=127.0.0.1", f"--pid-file={pidfile}", "--user=root",
        f"--tmpdir={tmp}",
        *options, "--max-connections=500", "--innodb-buffer-pool-size=64M",
        f"--log-error={workdir / 'mariadbd.err'}",
    ]

    def launch() -> int:
        pidfile.unlink(missing_ok=True)
        with open(workdir / "mariadbd.out", "ab") as out:
            proc = subprocess.Popen(
                cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        keep(proc)
        read_pidfile(pidfile, timeout=60)
        return proc.pid

    pid = launch()
    wait_port_open(port, timeout=60)
    if database:
        _create_database(port)
    return RunningServer(
        url=f"mysql://root@127.0.0.1:{port}/{DATABASE}",
        pid=pid,
        port=port,
        workdir=workdir,
        restart_cmd=launch,
        # "cmd": the command line start() runs again (a pair edits it as roles change)
        extra={"data": str(data), "socket": str(run / "mariadbd.sock"), "cmd": cmd},
    )


def start_replica(
    primary: RunningServer,
    workdir: Path,
    server_id: int = 2,
    port: int | None = None,
    options: tuple[str, ...] = (),
) -> RunningServer:
    """A GTID replica of ``primary`` (started with ``primary=True``) on loopback ``port``
    (None: a free one): a fresh data directory that replays the primary's binary log from its
    start (the database and everything after), ``read_only`` as a replica is, with a binary
    log of its own so that it can be promoted; ``options``: more of mariadbd's. Returns once
    it has caught up with the primary."""
    replica = _start(
        workdir,
        [f"--server-id={server_id}", "--log-bin=mariadb-bin", "--log-slave-updates",
         "--binlog-format=ROW", "--read-only", *options],
        database=False, port=port,
    )  # fmt: skip
    try:
        with sql(primary.port) as cur:
            # Only if missing: a primary that waits for a semi-synchronous replica it does not
            # have yet would not answer the statements (a promoted replica has the user).
            cur.execute("SELECT COUNT(*) FROM mysql.user WHERE user = 'repl'")
            if not cur.fetchone()[0]:
                cur.execute("CREATE USER IF NOT EXISTS repl@'127.0.0.1' IDENTIFIED BY 'repl'")
                cur.execute("GRANT REPLICATION SLAVE ON *.* TO repl@'127.0.0.1'")
        with sql(replica.port) as cur:
            cur.execute(
                "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = %s, "
                "MASTER_USER = 'repl', MASTER_PASSWORD = 'repl', MASTER_USE_GTID = slave_pos, "
                "MASTER_CONNECT_RETRY = 1",
                (primary.port,),
            )
            cur.execute("START SLAVE")
        caught_up(primary, replica)
    except BaseException:
        replica.stop()
        raise
    return replica


def caught_up(primary: RunningServer, replica: RunningServer, timeout: float = 60) -> None:
    """Until the replica has applied everything the primary has written so far."""
    with sql(primary.port) as cur:
        cur.execute("SELECT @@gtid_binlog_pos")
        (position,) = cur.fetchone()
    with sql(replica.port) as cur:
        cur.execute("SELECT MASTER_GTID_WAIT(%s, %s)", (position, timeout))
        (waited,) = cur.fetchone()
    if waited != 0:
        raise ServerUnavailable(f"the replica did not reach {position} within {timeout}s")


def promote(replica: RunningServer, timeout: float = 60, semisync: bool = False) -> None:
    """Make the replica a primary as a failover tool does: stop receiving, apply what it has
    received (``RESET SLAVE ALL`` deletes the relay log: a transaction received but not yet
    applied would be lost), stop replicating, forget the primary, accept writes.
    ``semisync``: before it accepts writes, its commits wait for a semi-synchronous replica
    (:data:`SEMISYNC_PRIMARY`), which it does not have yet."""
    with sql(replica.port) as cur:
        cur.execute("STOP SLAVE IO_THREAD")
        cur.execute("SHOW SLAVE STATUS")
        columns = [column[0] for column in cur.description]
        received = dict(zip(columns, cur.fetchone(), strict=True))["Gtid_IO_Pos"]
        cur.execute("SELECT MASTER_GTID_WAIT(%s, %s)", (received, timeout))
        (waited,) = cur.fetchone()
        if waited != 0:
            raise RuntimeError(f"the replica did not apply {received} within {timeout}s")
        cur.execute("STOP SLAVE")
        cur.execute("RESET SLAVE ALL")
        if semisync:
            for setting in SEMISYNC_PRIMARY:
                cur.execute(f"SET GLOBAL {setting}")
        cur.execute("SET GLOBAL read_only = 0")


@contextlib.contextmanager
def sql(port: int) -> Iterator[Any]:
    """A cursor on a root connection to the server on ``port`` (autocommit)."""
    conn = pymysql.connect(host="127.0.0.1", port=port, user="root", connect_timeout=10,
                           autocommit=True)  # fmt: skip
    try:
        with conn.cursor() as cur:
            yield cur
    finally:
        conn.close()


#: A primary's semi-synchronous replication: a commit is acknowledged once a replica has it
#: (``AFTER_SYNC``), and the wait lasts ten minutes before it would fall back to asynchronous:
#: never, in a test.
SEMISYNC_PRIMARY = (
    "rpl_semi_sync_master_wait_point = 'AFTER_SYNC'",
    "rpl_semi_sync_master_timeout = 600000",
    "rpl_semi_sync_master_enabled = 1",
)


def _as_options(settings: tuple[str, ...]) -> list[str]:
    """``name = value`` settings as mariadbd's command-line options."""
    return [
        "--" + name.strip().replace("_", "-") + "=" + value.strip().strip("'")
        for name, value in (setting.split("=", 1) for setting in settings)
    ]


#: The account the pair's URL names: a read-only server refuses its writes (no SUPER).
PAIR_USER = "latchkey"


class MariaDBPair(ReplicatedPair):
    """A primary and a semi-synchronous GTID replica (see :mod:`tests.servers.pairs`)."""

    def replica_ready(self) -> bool:
        try:
            with sql(self.primary.port) as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE 'Rpl_semi_sync_master_%'")
                status = dict(cur.fetchall())
        except pymysql.Error:
            return False
        return status.get("Rpl_semi_sync_master_clients") == "1" and (
            status.get("Rpl_semi_sync_master_status") == "ON"
        )

    def promote(self, replica: RunningServer) -> None:
        promote(replica, semisync=True)
        cmd = replica.extra["cmd"]  # started again by a restart fault: as the primary it is
        assert isinstance(cmd, list)
        cmd.remove("--read-only")
        cmd.extend(_as_options(SEMISYNC_PRIMARY))

    def replica_of(self, primary: RunningServer, workdir: Path, port: int) -> RunningServer:
        server_id = int(self.extra.get("generation", 1)) + 2  # type: ignore[call-overload]
        return start_replica(primary, workdir, server_id, port, SEMISYNC_REPLICA)


SEMISYNC_REPLICA = ("--rpl-semi-sync-slave-enabled=1",)


def start_pair(workdir: Path) -> MariaDBPair:
    """A primary and a replica (see :mod:`tests.servers.pairs`), semi-synchronous from the
    replica's first connection; the URL names :data:`PAIR_USER`. Returns once the replica
    acknowledges the primary's commits."""
    primary = start(workdir / "gen0", primary=True)
    replica = None
    try:
        with sql(primary.port) as cur:  # replicated: the replica has the user too
            cur.execute(f"CREATE USER {PAIR_USER}@'%%' IDENTIFIED BY %s", (PAIR_USER,))
            cur.execute(f"GRANT ALL ON {DATABASE}.* TO {PAIR_USER}@'%'")
        replica = start_replica(primary, workdir / "gen1", options=SEMISYNC_REPLICA)
        with sql(primary.port) as cur:  # not before: the replica's setup would wait for it
            for setting in SEMISYNC_PRIMARY:
                cur.execute(f"SET GLOBAL {setting}")
        cmd = primary.extra["cmd"]
        assert isinstance(cmd, list)
        cmd.extend(_as_options(SEMISYNC_PRIMARY))
        with sql(replica.port) as cur:  # semi-synchronous from its next connection
            cur.execute("STOP SLAVE IO_THREAD")
            cur.execute("START SLAVE IO_THREAD")
        pair = MariaDBPair(
            url=f"mysql://{PAIR_USER}:{PAIR_USER}@127.0.0.1:{primary.port},"
            f"127.0.0.1:{replica.port}/{DATABASE}",
            pid=primary.pid, port=primary.port, workdir=workdir,
            restart_cmd=lambda: pair.primary.pid,  # start() is the pair's own
            extra={"primary": primary, "replica": replica},
        )  # fmt: skip
        until(pair.replica_ready, 60, "the replica semi-synchronous")
    except BaseException:
        for server in (replica, primary):
            if server is not None:
                server.stop()
        raise
    return pair


SERVERS["mysql"] = ServerKind("mysql", start)

ROWS.append(
    StoreRow("mysql", "mysql", isolate=lambda base, tag, tmp: with_query(base, table=f"t_{tag}"))
)
ROWS.append(
    StoreRow(
        "mysql+getlock",
        "mysql",
        base_url=lambda url: replace_scheme(url, "mysql+getlock"),
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t_{tag}:"),
    )
)
