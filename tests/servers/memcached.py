"""A disposable memcached server for the tests, and the memcached store row.

It runs with ``-M`` (answer "out of memory" instead of evicting live leases) and UDP off.
memcached keeps nothing across a restart: the fault tests expect leases and fencing counters
to be gone afterwards. ``start_memcached`` lets a test start extra servers (multi-server URLs).
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


def answers(port: int, timeout: float = 0.5) -> bool:
    """True if a memcached on 127.0.0.1:``port`` answers ``version``."""
    with contextlib.suppress(OSError), socket.create_connection(
        ("127.0.0.1", port), timeout=timeout
    ) as s:
        s.sendall(b"version\r\n")
        return s.recv(64).startswith(b"VERSION ")
    return False


def wait_answers(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not answers(port):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"memcached on 127.0.0.1:{port} did not answer in {timeout}s")
        time.sleep(0.02)


def start_memcached(workdir: Path, *extra: str) -> RunningServer:
    """Start memcached (daemonised) on a free loopback port, its pid file in ``workdir``."""
    binary = ensure_binary("memcached", "memcached")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pidfile = workdir / f"memcached-{port}.pid"
    cmd = [
        binary, "-u", "root", "-U", "0", "-M", "-m", "64", "-l", "127.0.0.1",
        "-p", str(port), "-P", str(pidfile), "-d", *extra,
    ]  # fmt: skip

    def launch() -> int:
        pid = run_daemon(cmd, pidfile, "memcached", timeout=60)
        wait_answers(port)
        return pid

    pid = launch()
    return RunningServer(
        url=f"memcached://127.0.0.1:{port}", pid=pid, port=port, workdir=workdir,
        restart_cmd=launch,
    )  # fmt: skip


def start(workdir: Path) -> RunningServer:
    return start_memcached(workdir)


SERVERS["memcached"] = ServerKind("memcached", start)

ROWS.append(
    StoreRow(
        "memcached",
        "memcached",
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"),
    )
)
