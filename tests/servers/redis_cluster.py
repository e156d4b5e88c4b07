"""A disposable Redis Cluster for the tests (three masters, no replicas), and its store row.

Three ``redis-server --cluster-enabled yes`` on free loopback ports, joined by
``redis-cli --cluster create … --cluster-replicas 0 --cluster-yes``; ready once every node's
``CLUSTER INFO`` says ``cluster_state:ok``. No persistence, as for the plain Redis row. The
row's URL names one node (``redis+cluster://127.0.0.1:P1``: the client reads the others from
it, as from any seed list);
``LATCHKEY_TEST_REDIS_CLUSTER_URL`` points the suite at an existing cluster instead.

``start_cluster(…, proxied=True)`` puts each node behind a TCP proxy of its own
(:class:`tests.faults.proxy.Proxy`) and has it announce the proxy's port
(``cluster-announce-port``) to the clients, the cluster bus staying direct
(``cluster-announce-bus-port``): every connection a client opens, to the seed and to the
nodes it learns of, goes through a proxy, so a network fault reaches the discovered paths
while the cluster itself stays whole.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.faults.proxy import Proxies
from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    ensure_binary,
    free_port,
    port_open,
    run_daemon,
    wait_port_closed,
    with_query,
)
from tests.servers.redis import command, make_certificates, until, wait_ping

MASTERS = 3


def cluster_ok(port: int, timeout: float = 0.5) -> bool:
    """True if the node on 127.0.0.1:``port`` says ``cluster_state:ok``."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=timeout) as s,
    ):
        s.sendall(b"CLUSTER INFO\r\n")
        return b"cluster_state:ok" in s.recv(4096)
    return False


def node_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a port, and free, too."""
    while True:
        port = free_port()
        if port <= 55535 and not port_open(port + 10000):
            return port


def start_node(workdir: Path, port: int, *extra: str) -> int:
    """Start one cluster-enabled redis-server on ``port``; its pid."""
    binary = ensure_binary("redis-server", "redis-server")
    pidfile = workdir / f"node-{port}.pid"
    cmd = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
        "--cluster-node-timeout", "1000", "--dir", str(workdir), "--daemonize", "yes",
        "--pidfile", str(pidfile), "--logfile", str(workdir / f"node-{port}.log"), *extra,
    ]  # fmt: skip
    pid = run_daemon(cmd, pidfile, "redis-server (cluster node)", timeout=60)
    wait_ping(port)
    return pid


def create_cluster(ports: list[int], replicas: int = 0, timeout: float = 30.0) -> None:
    """Join the nodes into one cluster and wait until every node says it is ok."""
    cli = ensure_binary("redis-cli", "redis-tools")
    nodes = [f"127.0.0.1:{p}" for p in ports]
    proc = subprocess.run(
        [cli, "--cluster", "create", *nodes, "--cluster-replicas", str(replicas),
         "--cluster-yes"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ServerUnavailable(
            f"redis-cli --cluster create: {(proc.stderr or proc.stdout)[-500:]}"
        )
    deadline = time.monotonic() + timeout
    while not all(cluster_ok(p) for p in ports):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"cluster {nodes} not ok after {timeout}s")
        time.sleep(0.05)


class RunningCluster(RunningServer):
    """The cluster's first node stands for the server (pid, port); stop, start and freeze act
    on every node (a restarted node finds its cluster again in its nodes-PORT.conf)."""

    def _nodes(self) -> dict[int, int]:
        return self.extra["nodes"]  # type: ignore[return-value]

    def stop(self) -> None:
        for pid in self._nodes().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for port in self._nodes():
            wait_port_closed(port)

    def start(self) -> None:
        nodes = self._nodes()
        args: dict[int, list[str]] = self.extra.get("args", {})  # type: ignore[assignment]
        for port in nodes:
            nodes[port] = start_node(self.workdir, port, *args.get(port, []))
        self.pid = nodes[self.port]
        deadline = time.monotonic() + 30
        while not all(cluster_ok(p) for p in nodes):
            if time.monotonic() > deadline:
                raise ServerUnavailable("the restarted cluster is not ok after 30s")
            time.sleep(0.05)

    def processes(self) -> list[int]:
        return list(self._nodes().values())

    def replica_ready(self) -> bool:
        """Every master has a replica whose link is up: a failover can promote one."""
        return _replicas_linked(list(self._nodes())) >= len(self._nodes()) // 2

    def failover(self, how: str, key: str = "") -> None:
        """``kill``: SIGKILL the master of ``key``'s slot, as when its machine dies; the
        cluster promotes its replica (``cluster-node-timeout``, then an election). Returns
        once the slot is served again and the killed node, started again (empty, with its
        nodes-PORT.conf), replicates from the promoted one, its link up. Call when
        :meth:`replica_ready` (a cluster made with replicas)."""
        if how != "kill":
            raise ValueError(f"failover how? {how!r}")
        nodes = self._nodes()
        slot = int(command(next(iter(nodes)), "CLUSTER", "KEYSLOT", key).strip(":\r\n"))
        victim = _master_of_slot(list(nodes), slot)
        if victim is None:
            raise ServerUnavailable(f"no master serves slot {slot}")
        self.kill(victim)
        others = [p for p in nodes if p != victim]
        until(
            lambda: _master_of_slot(others, slot) not in (None, victim)
            and all(cluster_ok(p) for p in others),
            60,
            f"the cluster promotes a replica for slot {slot}",
        )
        nodes[victim] = start_node(self.workdir, victim)
        if self.port == victim:
            self.pid = nodes[victim]
        until(lambda: _replicas_linked([victim]) == 1, 60, "the old master replicates again")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` and wait until its port is closed."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._nodes()[port], signal.SIGKILL)
        wait_port_closed(port)


def tls_arguments(files: dict[str, Path], tls_port: int) -> list[str]:
    """A node's arguments for TLS on ``tls_port``, a client certificate required, the cluster
    bus over TLS too (``tls-cluster``: on ``tls_port`` + 10000) and replication over TLS. The
    plain port stays for the readiness checks and the tests' admin connections; a node names
    the TLS ports in CLUSTER SLOTS to a client that came over TLS."""
    return [
        "--tls-port", str(tls_port), "--tls-cert-file", str(files["server.pem"]),
        "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.pem"]),
        "--tls-auth-clients", "yes", "--tls-cluster", "yes", "--tls-replication", "yes",
    ]  # fmt: skip


def _master_of_slot(ports: list[int], slot: int) -> int | None:
    """The port of the master serving ``slot``, as the first of ``ports`` that answers says
    (CLUSTER NODES: "id addr flags master ping pong epoch link slots…")."""
    for port in ports:
        reply = command(port, "CLUSTER", "NODES")
        if not reply:
            continue
        for line in reply.splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        return None
    return None


def _replicas_linked(ports: list[int]) -> int:
    """How many of the nodes on ``ports`` are replicas with their link to the master up."""
    count = 0
    for port in ports:
        info = command(port, "INFO", "replication")
        count += "role:slave" in info and "master_link_status:up" in info
    return count


def start_cluster(
    workdir: Path,
    masters: int = MASTERS,
    replicas: int = 0,
    tls: bool = False,
    proxied: bool = False,
) -> RunningCluster:
    """``masters`` masters with ``replicas`` replicas each; the URL names the first node.
    ``tls``: every node serves TLS too (:func:`tls_arguments`) and the URL is
    ``rediss+cluster://`` to the first node's TLS port; ``extra["tls_ports"]``: plain port ->
    TLS port, ``extra["files"]``: the certificates. ``proxied``: each node behind a proxy
    whose port it announces to clients (module docstring), the URL naming every node's;
    ``extra["proxies"]``: them all, broken and healed together (the caller closes them, after
    :meth:`RunningCluster.stop`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    nodes: dict[int, int] = {}
    tls_ports: dict[int, int] = {}
    args: dict[int, list[str]] = {}
    fronts: dict[int, int] = {}  # node port -> its proxy's port
    files = make_certificates(workdir / "tls") if tls else {}
    proxies = Proxies([])
    try:
        for _ in range(masters * (1 + replicas)):
            if tls:  # the cluster bus is on the TLS port + 10000
                port, tls_ports[port] = free_port(), node_port()
                args[port] = tls_arguments(files, tls_ports[port])
            else:
                port = node_port()
            if proxied:
                proxies.add("127.0.0.1", port)
                fronts[port] = proxies.proxies[-1].port
                args[port] = [
                    "--cluster-announce-port", str(fronts[port]),
                    "--cluster-announce-bus-port", str(port + 10000),  # the bus: direct
                ]  # fmt: skip
            nodes[port] = start_node(workdir, port, *args.get(port, []))
        create_cluster(list(nodes), replicas)
    except BaseException:
        for pid in nodes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        proxies.close()
        raise
    first = next(iter(nodes))
    url = f"redis+cluster://127.0.0.1:{first}"
    if proxied:  # every node a seed, as an application names them: each one's proxy
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in fronts.values())
    if tls:
        url = f"rediss+cluster://127.0.0.1:{tls_ports[first]}"
    return RunningCluster(
        url=url, pid=nodes[first], port=first, workdir=workdir,
        extra={"nodes": nodes, "args": args, "tls_ports": tls_ports, "files": files,
               "proxies": proxies},
    )  # fmt: skip


def start(workdir: Path) -> RunningServer:
    """Three masters, no replicas; the row's URL names one of them (the client finds the
    others)."""
    return start_cluster(workdir)


SERVERS["redis_cluster"] = ServerKind("redis_cluster", start)

ROWS.append(
    StoreRow(
        "redis+cluster",
        "redis_cluster",
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"),
        discovers=True,
        proxied=lambda workdir: start_cluster(workdir, proxied=True),
    )
)
