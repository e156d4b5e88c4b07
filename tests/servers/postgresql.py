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


def start_replica(primary: RunningServer, workdir: Path, name: str = "replica1") -> RunningServer:
    """A streaming replica of ``primary`` (pg_basebackup -R) on a free loopback port, named
    ``name`` to the primary (``application_name``: what ``synchronous_standby_names`` lists).
    Promote it with :func:`promote`."""
    bindir = Path(str(primary.extra["bindir"]))
    as_postgres = _as_postgres()
    home = _owned_dir(workdir / "pg-replica", as_postgres)
    # A short socket directory: a test's own tmp_path (deeper still under pytest-xdist) can
    # make "<dir>/.s.PGSQL.<port>" longer than a Unix socket path may be (107 bytes).
    data = home / "data"
    sockets = _owned_dir(Path(tempfile.mkdtemp(prefix="lkpg-")), as_postgres)
    _run(
        [str(bindir / "pg_basebackup"), "-D", str(data), "-h", "127.0.0.1",
         "-p", str(primary.port), "-U", "postgres", "-X", "stream", "-R",
         "-d", f"application_name={name}"],
        as_postgres, home, "pg_basebackup",
    )  # fmt: skip
    port = free_port()
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
