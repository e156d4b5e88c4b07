"""A disposable MariaDB server for the tests, and the two MySQL store rows.

``mariadb-install-db`` creates a fresh data directory in the test workdir, then ``mariadbd``
listens on 127.0.0.1 on a free port (its unix socket and pid file stay in the workdir) with
MariaDB's default durability (InnoDB flushes the redo log at every commit): the fault tests
stop and restart it and expect committed leases and fencing counters to survive. ``root``
has no password over TCP; the tests create their own users where they need one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def start(workdir: Path) -> RunningServer:
    """Install a fresh data directory in ``workdir`` and start mariadbd on a free port."""
    mariadbd = ensure_binary("mariadbd", "mariadb-server", search=("/usr/sbin/mariadbd",))
    install_db = ensure_binary("mariadb-install-db", "mariadb-server")
    data, run = workdir / "data", workdir / "run"
    run.mkdir(parents=True, exist_ok=True)
    _run(
        [install_db, "--no-defaults", f"--datadir={data}", "--user=root",
         "--auth-root-authentication-method=normal", "--skip-test-db"],
        workdir, "mariadb-install-db",
    )
    port = free_port()
    pidfile = run / "mariadbd.pid"
    cmd = [
        mariadbd, "--no-defaults", f"--datadir={data}", f"--socket={run / 'mariadbd.sock'}",
        f"--port={port}", "--bind-address=127.0.0.1", f"--pid-file={pidfile}", "--user=root",
        "--skip-log-bin", "--max-connections=500", "--innodb-buffer-pool-size=64M",
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
    _create_database(port)
    return RunningServer(
        url=f"mysql://root@127.0.0.1:{port}/{DATABASE}",
        pid=pid,
        port=port,
        workdir=workdir,
        restart_cmd=launch,
        extra={"data": str(data), "socket": str(run / "mariadbd.sock")},
    )


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
