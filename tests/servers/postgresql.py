"""A disposable PostgreSQL server for the tests, and the two PostgreSQL store rows.

PostgreSQL refuses to run as root, so when the tests run as root the cluster is created and
started as the ``postgres`` user, in a directory that user owns under the test workdir. It
listens on 127.0.0.1 on a free port (its unix socket stays in the workdir), trusts local
connections, and keeps PostgreSQL's default durability (fsync on): the fault tests restart it
and expect committed leases and fencing counters to survive.
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    ensure_binary,
    free_port,
    read_pidfile,
    replace_scheme,
    wait_port_open,
    with_query,
)
from tests.servers.pairs import ReplicatedPair, until

PG_BIN = "/usr/lib/postgresql/15/bin"


def _as_postgres() -> dict[str, Any]:
    """subprocess arguments that run a command as ``postgres`` when we are root."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServerUnavailable("running as root and there is no postgres user") from None
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def _owned_dir(path: Path, as_postgres: dict[str, Any]) -> Path:
    """Create ``path`` owned by the user the server runs as; let it traverse the parents."""
    path.mkdir(parents=True, exist_ok=True)
    if as_postgres:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)
        tmp = Path(tempfile.gettempdir()).resolve()
        for parent in path.resolve().parents:  # mkdtemp made the test workdir 0700 root;
            if parent == tmp or not parent.is_relative_to(tmp):  # touch nothing outside it
                break
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(parent, mode | stat.S_IXOTH)
    return path


def _run(cmd: list[str], as_postgres: dict[str, Any], cwd: Path, what: str) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, check=False, timeout=120, **as_postgres
    )
    if proc.returncode != 0:
        log = cwd / "server.log"
        tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
        raise ServerUnavailable(
            f"{what} failed ({proc.returncode}): {proc.stderr[-800:]} {tail}".strip()
        )


def _launcher(
    bindir: Path, home: Path, data: Path, sockets: Path, port: int, what: str
) -> Callable[[], int]:
    """What starts (and restarts) the server of ``data`` on ``port``: returns its pid."""
    options = " ".join([
        f"-p {port}", f"-k {sockets}", "-c listen_addresses=127.0.0.1",
        "-c max_connections=300", "-c shared_buffers=32MB",
    ])
    pg_ctl = [str(bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data),
              "-l", str(home / "server.log"), "-o", options]

    def launch() -> int:
        _run(pg_ctl, _as_postgres(), home, what)
        return read_pidfile(data / "postmaster.pid")

    return launch


def start(workdir: Path, password: str | None = None) -> RunningServer:
    """initdb a fresh cluster in ``workdir`` and start it on a free loopback port.

    With ``password``, TCP connections must authenticate (scram-sha-256) as ``postgres`` with
    it; otherwise every connection is trusted.
    """
    initdb = ensure_binary("initdb", "postgresql", search=(f"{PG_BIN}/initdb",))
    bindir = Path(initdb).parent
    as_postgres = _as_postgres()
    home = _owned_dir(workdir / "pg", as_postgres)
    data, sockets = home / "data", _owned_dir(home / "run", as_postgres)
    auth = ["--auth=trust"]
    if password is not None:
        pwfile = home / "pwfile"
        pwfile.write_text(password + "\n")
        if as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
    _run(
        [initdb, "-D", str(data), *auth, "-U", "postgres", "-E", "UTF8",
         "--locale=C.UTF-8", "--no-instructions"],
        as_postgres, home, "initdb",
    )
    port = free_port()
    launch = _launcher(bindir, home, data, sockets, port, "pg_ctl start")
    pid = launch()
    wait_port_open(port)
    userinfo = ":" + quote(password, safe="") if password else ""
    return RunningServer(
        url=f"postgresql://postgres{userinfo}@127.0.0.1:{port}/postgres",
        pid=pid,
        port=port,
        workdir=workdir,
        restart_cmd=launch,
        stop_signal=signal.SIGINT,  # "fast" shutdown: sessions end, committed data stays
        extra={"bindir": str(bindir), "data": str(data), "sockets": str(sockets)},
    )


SERVERS["postgresql"] = ServerKind("postgresql", start)

ROWS.append(
    StoreRow(
        "postgresql",
        "postgresql",
        isolate=lambda base, tag, tmp: with_query(base, table=f"t_{tag}"),
    )
)
ROWS.append(
    StoreRow(
        "postgresql+advisory",
        "postgresql",
        base_url=lambda url: replace_scheme(url, "postgresql+advisory"),
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t_{tag}"),
    )
)


def start_replica(
    primary: RunningServer, workdir: Path, name: str = "replica1", port: int | None = None
) -> RunningServer:
    """A streaming replica of ``primary`` (pg_basebackup -R) on loopback ``port`` (None: a
    free one), named ``name`` to the primary (``application_name``: what
    ``synchronous_standby_names`` lists). Promote it with :func:`promote`."""
    bindir = Path(str(primary.extra["bindir"]))
    as_postgres = _as_postgres()
    home = _owned_dir(workdir / "pg-replica", as_postgres)
    # A short socket directory: a test's own tmp_path (deeper still under pytest-xdist) can
    # make "<dir>/.s.PGSQL.<port>" longer than a Unix socket path may be (107 bytes).
    data = home / "data"
    sockets = _owned_dir(Path(tempfile.mkdtemp(prefix="lkpg-")), as_postgres)
    _run(
        [str(bindir / "pg_basebackup"), "-D", str(data), "-h", "127.0.0.1",
         "-p", str(primary.port), "-U", "postgres", "-X", "stream", "-R", "-c", "fast",
         "-d", f"application_name={name}"],
        as_postgres, home, "pg_basebackup",
    )  # fmt: skip
    port = free_port() if port is None else port
    launch = _launcher(bindir, home, data, sockets, port, "pg_ctl start (replica)")
    pid = launch()
    wait_port_open(port)
    return RunningServer(
        url=f"postgresql://postgres@127.0.0.1:{port}/postgres",
        pid=pid,
        port=port,
        workdir=workdir,
        restart_cmd=launch,
        stop_signal=signal.SIGINT,
        extra={"bindir": str(bindir), "data": str(data), "sockets": str(sockets), "home": home},
    )


def promote(replica: RunningServer) -> None:
    """``pg_ctl promote -w``: the replica becomes a primary (returns once it accepts writes)."""
    bindir, data = Path(str(replica.extra["bindir"])), str(replica.extra["data"])
    home = Path(str(replica.extra["home"]))
    _run([str(bindir / "pg_ctl"), "promote", "-w", "-t", "60", "-D", data],
         _as_postgres(), home, "pg_ctl promote")  # fmt: skip


class PostgresPair(ReplicatedPair):
    """A primary and a synchronous streaming replica (see :mod:`tests.servers.pairs`)."""

    def replica_ready(self) -> bool:
        try:
            with psycopg.connect(self.primary.url, autocommit=True, connect_timeout=5) as sql:
                rows = sql.execute(
                    "SELECT 1 FROM pg_stat_replication WHERE application_name = %s"
                    " AND state = 'streaming' AND sync_state = 'sync'",
                    (REPLICA,),
                ).fetchall()
        except psycopg.Error:
            return False
        return bool(rows)

    def promote(self, replica: RunningServer) -> None:
        promote(replica)  # its synchronous_standby_names came with its base backup

    def replica_of(self, primary: RunningServer, workdir: Path, port: int) -> RunningServer:
        return start_replica(primary, workdir, REPLICA, port=port)


#: The name every replica of a pair has: the one ``synchronous_standby_names`` lists.
REPLICA = "replica1"


def start_pair(workdir: Path) -> PostgresPair:
    """A primary and a replica (see :mod:`tests.servers.pairs`): ``synchronous_standby_names``
    names the replica and ``synchronous_commit = remote_apply`` (an acknowledged commit is
    visible on the replica), set before the base backup so that every replica, promoted,
    keeps them. Returns once the replica is synchronous."""
    primary = start(workdir / "gen0")
    replica = None
    try:
        with psycopg.connect(primary.url, autocommit=True) as sql:
            sql.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{REPLICA}'")
            sql.execute("ALTER SYSTEM SET synchronous_commit = 'remote_apply'")
            sql.execute("SELECT pg_reload_conf()")
        replica = start_replica(primary, workdir / "gen1", REPLICA)
        pair = PostgresPair(
            url=f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{replica.port}"
            "/postgres?target_session_attrs=read-write",
            pid=primary.pid, port=primary.port, workdir=workdir,
            restart_cmd=lambda: pair.primary.pid,  # start() is the pair's own
            stop_signal=signal.SIGINT, extra={"primary": primary, "replica": replica},
        )  # fmt: skip
        until(pair.replica_ready, 60, "the replica synchronous")
    except BaseException:
        for server in (replica, primary):
            if server is not None:
                server.stop()
        raise
    return pair
