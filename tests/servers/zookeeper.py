"""A disposable ZooKeeper server for the tests, and the ZooKeeper store row.

Debian's ``zookeeper`` package (it brings a Java runtime, ``default-jre-headless``) has the
server's jars; the test runs ``QuorumPeerMain`` in standalone mode with a private ``zoo.cfg``:
a free loopback port, its data in the test's temporary directory, the admin server off, only
the ``srvr`` and ``ruok`` four-letter commands, and ``tickTime=200`` so that a test can ask
for a session timeout as short as 400 ms (``maxSessionTimeout`` is raised to 60 s). Ready when
``srvr`` answers (``ruok`` answers before the server serves). Stopped by pid with SIGKILL:
its JVM did not always exit on SIGTERM here (port closed, process left running), and
ZooKeeper syncs its log before it acknowledges a write, so a kill loses nothing (the restart
test is then a crash and restart).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
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
    keep,
    with_query,
)
from tests.servers.quorum import Quorum, quorum

CLASSPATH = "/usr/share/java/zookeeper.jar:/usr/share/java/*"
JAR = "/usr/share/java/zookeeper.jar"
SCRIPT = "/usr/share/zookeeper/bin/zkServer.sh"


def srvr(port: int, timeout: float = 0.5) -> str:
    """The server's answer to ``srvr`` ('' if none)."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=timeout) as s,
    ):
        s.sendall(b"srvr")
        chunks = []
        while chunk := s.recv(4096):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    return ""


def wait_serving(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "Mode:" not in srvr(port):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"zookeeper on 127.0.0.1:{port} not serving in {timeout}s")
        time.sleep(0.05)


def start_ensemble(workdir: Path, size: int = 3) -> list[RunningServer]:
    """A ZooKeeper ensemble of ``size`` servers on loopback (for the failover tests): each
    one's RunningServer, in server-id order; :func:`leader_of` says which leads."""
    ports = [(free_port(), free_port(), free_port()) for _ in range(size)]
    peers = [f"server.{i + 1}=127.0.0.1:{peer}:{election}"
             for i, (_, peer, election) in enumerate(ports)]  # fmt: skip
    ensemble = ["initLimit=10", "syncLimit=5", *peers]
    started: list[RunningServer] = []
    try:
        for i, (client, _, _) in enumerate(ports):
            data = workdir / f"data-{client}"
            data.mkdir(parents=True, exist_ok=True)
            (data / "myid").write_text(f"{i + 1}\n")
            started.append(start_zookeeper(workdir, *ensemble, port=client, wait=False))
        for server in started:
            wait_serving(server.port)
    except BaseException:
        for server in started:
            with contextlib.suppress(Exception):
                server.stop()
        raise
    return started


def start_quorum(workdir: Path, size: int = 3) -> Quorum:
    """An ensemble of ``size`` as one server for the chaos run's failovers (its URL names
    every server; see tests/servers/quorum.py)."""
    return quorum(workdir, "zookeeper", start_ensemble(workdir, size), leader_of, serving)


def serving(port: int) -> bool:
    """The server on ``port`` serves: it is the leader or a follower of a quorum."""
    return "Mode:" in srvr(port)


def leader_of(servers: list[RunningServer]) -> RunningServer:
    for server in servers:
        if "Mode: leader" in srvr(server.port):
            return server
    raise ServerUnavailable("no ZooKeeper server says it leads")


def start_zookeeper(
    workdir: Path, *extra: str, port: int | None = None, wait: bool = True
) -> RunningServer:
    """Start a standalone ZooKeeper on a free loopback port with its data in ``workdir``;
    ``extra``: more ``key=value`` lines for its zoo.cfg (an ensemble's ``server.N`` lines make
    it one of an ensemble; ``wait=False`` then, since it serves only once a quorum is up)."""
    # The package's own script stands for its jars (which ensure_binary cannot test: not
    # executable); the package brings a Java runtime.
    ensure_binary("zkServer.sh", "zookeeper", search=(SCRIPT,))
    java = shutil.which("java")
    if java is None or not Path(JAR).exists():
        raise ServerUnavailable(f"zookeeper installed, but no java on PATH or no {JAR}")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    config = workdir / f"zoo-{port}.cfg"
    config.write_text(
        "\n".join(
            [
                "tickTime=200",
                f"dataDir={workdir / f'data-{port}'}",
                f"clientPort={port}",
                "clientPortAddress=127.0.0.1",
                "maxSessionTimeout=60000",
                "admin.enableServer=false",
                "4lw.commands.whitelist=srvr,ruok",
                *extra,
            ]
        )
        + "\n"
    )
    cmd = [
        java, "-Xmx256m", "-XX:+UseSerialGC", "-cp", CLASSPATH,
        "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(config),
    ]  # fmt: skip

    def launch(wait: bool = True) -> int:
        log = (workdir / f"zookeeper-{port}.log").open("ab")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        keep(proc)
        try:
            if wait:
                wait_serving(port)
        except ServerUnavailable:
            proc.kill()
            raise
        return proc.pid

    pid = launch(wait)
    return RunningServer(
        url=f"zookeeper://127.0.0.1:{port}", pid=pid, port=port, workdir=workdir,
        restart_cmd=launch, stop_signal=signal.SIGKILL,
    )  # fmt: skip


def start(workdir: Path) -> RunningServer:
    return start_zookeeper(workdir)


SERVERS["zookeeper"] = ServerKind("zookeeper", start)

# Each test its own prefix node; sessions of 30 s, so that a holder's own deadline (capped at
# the session timeout) outlasts the fault tests' outages.
ROWS.append(
    StoreRow(
        "zookeeper",
        "zookeeper",
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}", session_timeout="30s"),
    )
)
