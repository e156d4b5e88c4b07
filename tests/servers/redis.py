"""A disposable Redis server for the tests, and the Redis store row.

The server runs without persistence (``--save '' --appendonly no``), as the store's docs
describe the default: a restart loses leases and fencing counters. ``start_redis`` also lets
a test start its own server with extra arguments (``--requirepass``, say).
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    ensure_binary,
    free_port,
    run_daemon,
    with_query,
)


def ping(port: int, password: str | None = None, timeout: float = 0.5) -> bool:
    """True if a Redis server on 127.0.0.1:``port`` answers PING (after AUTH if given)."""
    with contextlib.suppress(OSError), socket.create_connection(
        ("127.0.0.1", port), timeout=timeout
    ) as s:
        if password is not None:
            s.sendall(f"AUTH {password}\r\n".encode())
            if not s.recv(64).startswith(b"+OK"):
                return False
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")
    return False


def wait_ping(port: int, password: str | None = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ping(port, password):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"redis on 127.0.0.1:{port} did not answer PING in {timeout}s")
        time.sleep(0.02)


def start_redis(workdir: Path, *extra: str, password: str | None = None) -> RunningServer:
    """Start redis-server on a free loopback port with its files in ``workdir``."""
    binary = ensure_binary("redis-server", "redis-server")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pidfile = workdir / f"redis-{port}.pid"
    cmd = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(workdir), "--daemonize", "yes", "--pidfile", str(pidfile),
        "--logfile", str(workdir / f"redis-{port}.log"), *extra,
    ]
    if password is not None:
        cmd += ["--requirepass", password]

    def launch() -> int:
        pid = run_daemon(cmd, pidfile, "redis-server", timeout=60)
        wait_ping(port, password)
        return pid

    pid = launch()
    return RunningServer(
        url=f"redis://127.0.0.1:{port}/0", pid=pid, port=port, workdir=workdir,
        restart_cmd=launch,
    )


def start(workdir: Path) -> RunningServer:
    return start_redis(workdir)


SERVERS["redis"] = ServerKind("redis", start)

ROWS.append(
    StoreRow("redis", "redis", isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"))
)
