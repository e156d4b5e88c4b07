"""A disposable etcd server (one member) for the tests, and the etcd store row.

``etcd`` from the Debian package ``etcd-server`` (3.4), on two free loopback ports (client and
peer), its data in the test's temporary directory, with short raft timers
(``--heartbeat-interval=10 --election-timeout=100``: it elects itself in well under a second).
It runs in the foreground as our child and is stopped by pid; a restart keeps its data, so
leases and revisions (the fencing tokens) survive it as they would in production.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
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
    with_query,
)
from tests.servers.quorum import Quorum, quorum


def healthy(port: int) -> bool:
    """True once etcd on 127.0.0.1:``port`` has a leader and answers a read."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v3/kv/range", data=b'{"key":"AA=="}', method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=0.5) as response:
            return "header" in json.loads(response.read())
    except (OSError, ValueError):
        return False


def start_etcd(workdir: Path) -> RunningServer:
    """One etcd member, a cluster of its own."""
    client, peer = free_port(), free_port()
    name = f"latchkey-{client}"
    return _member(workdir, name, client, peer, f"{name}=http://127.0.0.1:{peer}")


def start_etcd_cluster(workdir: Path, members: int = 3) -> list[RunningServer]:
    """A cluster of ``members`` etcd members on loopback (for the failover tests); each one's
    RunningServer, in member order. Their URLs joined make the store's multi-endpoint URL."""
    ports = [(free_port(), free_port()) for _ in range(members)]
    names = [f"latchkey-{client}" for client, _ in ports]
    peers = [f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports, strict=True)]
    cluster = ",".join(peers)
    servers: list[RunningServer] = []
    pids: list[int] = []
    try:
        # Members wait for each other before they answer: start all, then wait for each.
        launchers = [
            _launcher(workdir / n, n, client, peer, cluster, "new")
            for n, (client, peer) in zip(names, ports, strict=True)
        ]
        pids.extend(launch(wait=False) for launch in launchers)
        for launch, pid, (client, _) in zip(launchers, pids, ports, strict=True):
            _wait_healthy(workdir, pid, client)
            servers.append(RunningServer(
                url=f"etcd://127.0.0.1:{client}", pid=pid, port=client, workdir=workdir,
                restart_cmd=launch,  # launch(wait=False): Quorum.start starts all at once
            ))  # fmt: skip
    except BaseException:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    return servers


def start_quorum(workdir: Path, members: int = 3) -> Quorum:
    """A cluster of ``members`` as one server for the chaos run's failovers (its URL names
    every member; see tests/servers/quorum.py)."""
    return quorum(workdir, "etcd", start_etcd_cluster(workdir, members), leader_of, healthy)


def leader_of(servers: list[RunningServer]) -> RunningServer:
    """The member that leads now (maintenance status: its id is the leader's)."""
    for srv in servers:
        request = urllib.request.Request(
            f"http://127.0.0.1:{srv.port}/v3/maintenance/status", data=b"{}", method="POST"
        )
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(request, timeout=1) as response:
                status = json.loads(response.read())
            if status.get("leader") == status["header"].get("member_id"):
                return srv
    raise ServerUnavailable("no etcd member says it leads")


def _member(workdir: Path, name: str, client: int, peer: int, cluster: str) -> RunningServer:
    launch = _launcher(workdir, name, client, peer, cluster, "new")
    pid = launch(wait=True)
    return RunningServer(
        url=f"etcd://127.0.0.1:{client}", pid=pid, port=client, workdir=workdir,
        restart_cmd=lambda: launch(wait=True),
    )  # fmt: skip


def _wait_healthy(workdir: Path, pid: int, client: int) -> None:
    deadline = time.monotonic() + 30
    while not healthy(client):
        if not Path(f"/proc/{pid}").exists():
            raise ServerUnavailable(f"etcd exited: see {workdir}/etcd.log")
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise ServerUnavailable(f"etcd on 127.0.0.1:{client} not ready in 30s")
        time.sleep(0.02)


def _launcher(
    workdir: Path, name: str, client: int, peer: int, cluster: str, state: str
) -> Callable[..., int]:
    binary = ensure_binary("etcd", "etcd-server", ("/usr/bin/etcd",))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        binary, "--name", name, "--data-dir", str(workdir / "data"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", cluster, "--initial-cluster-state", state,
        "--heartbeat-interval=10", "--election-timeout=100",
        "--logger=zap", "--log-outputs", str(workdir / "etcd.log"),
    ]  # fmt: skip

    def launch(wait: bool = True) -> int:
        # Detached through sh (etcd does not daemonize itself): not our child, so no Popen
        # is left to reap it; stopped by pid like the daemonized servers.
        script = 'exec "$@" >/dev/null 2>&1 </dev/null & echo $!'
        started = subprocess.run(
            ["sh", "-c", script, "sh", *cmd], capture_output=True, text=True, check=True
        )
        pid = int(started.stdout.strip())
        if wait:
            _wait_healthy(workdir, pid, client)
        return pid

    return launch


SERVERS["etcd"] = ServerKind("etcd", start_etcd)

ROWS.append(
    StoreRow("etcd", "etcd", isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"))
)
