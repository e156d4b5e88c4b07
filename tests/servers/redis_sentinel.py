"""A disposable Redis Sentinel setup for the tests, and its store row.

A master, a replica (``--replicaof`` the master) and one ``redis-sentinel`` (Debian package
``redis-sentinel``) with ``sentinel monitor latchkey 127.0.0.1 MASTER_PORT 1``, each on a free
loopback port, without persistence. The row's URL names the sentinel and the service:
``redis+sentinel://127.0.0.1:SENTINEL_PORT/latchkey``; ``LATCHKEY_TEST_REDIS_SENTINEL_URL``
points the suite at an existing setup instead. ``stop``/``start``/``frozen`` act on all three
processes; :func:`start_setup` lets a failover test start its own, and with ``tls=True`` a
setup that serves TLS (:func:`tls_arguments`), and with ``proxied=True`` one whose every
client connection goes through a TCP proxy (:class:`tests.faults.proxy.Proxy`): the sentinel
behind one (the URL names it), and the master behind another, whose port the sentinel
monitors and so names to clients (the replica's own, announced: ``replica-announce-port``).
The sentinel's own connections to the master go through that proxy too, so a network fault
would have it fail over after ``down-after-milliseconds``: a proxied setup waits a minute
before it does (``PROXIED_DOWN_AFTER_MS``), longer than a network fault of a test lasts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
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
    run_daemon,
    wait_port_closed,
    with_query,
)
from tests.servers.redis import command, make_certificates, until, wait_ping

SERVICE = "latchkey"
#: A proxied setup's ``down-after-milliseconds`` (module docstring).
PROXIED_DOWN_AFTER_MS = 60_000


def master_of(sentinel_port: int, service: str = SERVICE, timeout: float = 0.5) -> int | None:
    """The master's port the sentinel on ``sentinel_port`` names for ``service``, or None."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        socket.create_connection(("127.0.0.1", sentinel_port), timeout=timeout) as s,
    ):
        s.sendall(f"SENTINEL get-master-addr-by-name {service}\r\n".encode())
        reply = s.recv(4096).decode().split("\r\n")
        return int(reply[4]) if reply[0] == "*2" else None
    return None


def _node(workdir: Path, port: int, *extra: str) -> Callable[[], int]:
    binary = ensure_binary("redis-server", "redis-server")
    pidfile = workdir / f"redis-{port}.pid"
    cmd = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(workdir), "--daemonize", "yes", "--pidfile", str(pidfile),
        "--logfile", str(workdir / f"redis-{port}.log"), *extra,
    ]  # fmt: skip

    def launch() -> int:
        pid = run_daemon(cmd, pidfile, "redis-server", timeout=60)
        wait_ping(port)
        return pid

    return launch


def tls_arguments(files: dict[str, Path], tls_port: int) -> list[str]:
    """redis-server's arguments for TLS on ``tls_port`` (the plain port stays, for the
    readiness checks and the tests' admin connections): a client certificate required, and
    TLS to the master too (replication; a sentinel's connections to the servers)."""
    return [
        "--tls-port", str(tls_port), "--tls-cert-file", str(files["server.pem"]),
        "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.pem"]),
        "--tls-auth-clients", "yes", "--tls-replication", "yes",
    ]  # fmt: skip


def _sentinel(
    workdir: Path,
    port: int,
    master_port: int,
    tls: list[str] | None = None,
    down_after_ms: int = 1000,
) -> Callable[[], int]:
    binary = ensure_binary("redis-sentinel", "redis-sentinel")
    pidfile = workdir / f"sentinel-{port}.pid"
    conf = workdir / f"sentinel-{port}.conf"  # the sentinel rewrites it: a file of its own
    pairs = zip(tls[::2], tls[1::2], strict=True) if tls else ()
    tls_lines = "".join(f"{key[2:]} {value}\n" for key, value in pairs)  # --tls-port → tls-port
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndaemonize yes\npidfile {pidfile}\n"
        f"logfile {workdir / f'sentinel-{port}.log'}\ndir {workdir}\n{tls_lines}"
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 1\n"
        f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SERVICE} 10000\n"
    )

    def launch() -> int:
        pid = run_daemon([binary, str(conf)], pidfile, "redis-sentinel", timeout=60)
        deadline = time.monotonic() + 30
        while master_of(port) is None:
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"sentinel on {port} names no master after 30s")
            time.sleep(0.02)
        return pid

    return launch


class RunningSetup(RunningServer):
    """The sentinel stands for the server (pid, port); stop, start and freeze act on the
    master, the replica and the sentinel. ``extra["ports"]``: role -> port."""

    def _launchers(self) -> dict[str, Callable[[], int]]:
        return self.extra["launch"]  # type: ignore[return-value]

    def _pids(self) -> dict[str, int]:
        return self.extra["pids"]  # type: ignore[return-value]

    def _ports(self) -> dict[str, int]:
        return self.extra["ports"]  # type: ignore[return-value]

    def stop(self) -> None:
        for pid in self._pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for port in self._ports().values():
            wait_port_closed(port)

    def kill(self, role: str) -> None:
        """SIGKILL one process ("master", "replica" or "sentinel") and wait for its port."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pids()[role], signal.SIGKILL)
        wait_port_closed(self._ports()[role])

    def start(self) -> None:
        pids = self._pids()
        for role in ("master", "replica", "sentinel"):
            pids[role] = self._launchers()[role]()
        self.pid = pids["sentinel"]

    def processes(self) -> list[int]:
        return list(self._pids().values())

    def replica_ready(self) -> bool:
        """The sentinel lists the replica, its link to the master up: a failover can promote
        it (the sentinel learns of a replica from the master's INFO, every few seconds)."""
        return _replica_known(self._ports()["sentinel"])

    def failover(self, how: str) -> None:
        """Make the replica the master, as a Sentinel deployment does when its master fails:
        ``kill`` SIGKILLs the master (the sentinel promotes the replica after its
        ``down-after-milliseconds``; the old master is started again, empty, as the new one's
        replica) or ``command`` asks the sentinel (``SENTINEL FAILOVER``: it promotes the
        replica, then turns the old master into its replica). Returns once the sentinel names
        the new master and the old one replicates from it, its link up; the roles in
        ``extra`` are swapped. Call when :meth:`replica_ready`."""
        ports = self._ports()
        new = ports["replica"]
        if how == "kill":
            self.kill("master")
        elif how == "command":
            command(ports["sentinel"], "SENTINEL", "FAILOVER", SERVICE)
        else:
            raise ValueError(f"failover how? {how!r}")
        until(lambda: master_of(ports["sentinel"]) == new, 60, "the sentinel names the replica")
        self._follow(restart=how == "kill")

    def settle(self, quiet: float = 1.5) -> bool:
        """After a freeze of the whole setup: whether the sentinel failed over by itself —
        thawed, it can find the master silent for longer than ``down-after-milliseconds``
        and promote the replica, the old master (not down) serving on as a master until the
        sentinel turns it into a replica. If it did, returns once that is done (the roles in
        ``extra`` swapped), as :meth:`failover` does; else once nothing has happened for
        ``quiet`` seconds."""
        ports = self._ports()
        sentinel, quiet_until = ports["sentinel"], time.monotonic() + quiet
        while time.monotonic() < quiet_until:
            named = master_of(sentinel)
            if named is not None and named != ports["master"]:
                self._follow(restart=False)
                return True
            if "failover_in_progress" in command(sentinel, "SENTINEL", "MASTER", SERVICE):
                quiet_until = time.monotonic() + quiet
            time.sleep(0.02)
        return False

    def _follow(self, restart: bool) -> None:
        """The sentinel names the replica as master: swap the roles; ``restart``: start the
        killed old master again as the new one's replica; wait until it replicates."""
        ports, pids, launch = self._ports(), self._pids(), self._launchers()
        old, new = ports["master"], ports["replica"]
        launch["master"] = _node(self.workdir, new)  # for start(): the roles as they now are
        launch["replica"] = _node(self.workdir, old, "--replicaof", "127.0.0.1", str(new))
        pids["master"], pids["replica"] = pids["replica"], pids["master"]
        ports["master"], ports["replica"] = new, old
        if restart:
            pids["replica"] = launch["replica"]()
        until(lambda: _linked(old, new), 60, "the old master replicates from the new one")


def _linked(replica: int, master: int) -> bool:
    """The node on ``replica`` replicates from ``master``, its link up."""
    info = command(replica, "INFO", "replication")
    return f"master_port:{master}\r" in info and "master_link_status:up" in info


def _replica_known(sentinel: int) -> bool:
    reply = command(sentinel, "SENTINEL", "REPLICAS", SERVICE)
    return "master-link-status\r\n$2\r\nok" in reply and "s_down" not in reply


def start_setup(workdir: Path, tls: bool = False, proxied: bool = False) -> RunningSetup:
    """Start a master, its replica and a sentinel watching them. ``tls``: each also serves
    TLS on a port of its own and asks for a client certificate, the replica replicates and
    the sentinel watches over TLS (it names the master's TLS port), and the URL is
    ``rediss+sentinel://`` to the sentinel's TLS port; ``extra["tls_ports"]``: role -> TLS
    port, ``extra["files"]``: the certificates (:func:`tests.servers.redis.make_certificates`).
    ``proxied`` (not with ``tls``): each behind a proxy (module docstring), the URL naming the
    sentinel twice, through two proxies (to the client, two sentinels); ``extra["proxies"]``:
    them all, broken and healed together (the caller closes them, after
    :meth:`RunningSetup.stop`); ``extra["proxy_of"]``: role ("sentinel2": the second
    address) -> its proxy. For network faults, not failovers (:meth:`RunningSetup.failover`
    starts the nodes again without the announced port).
    """
    if tls and proxied:
        raise ValueError("a proxied setup speaks plain TCP")
    workdir.mkdir(parents=True, exist_ok=True)
    roles = ("master", "replica", "sentinel")
    ports = {role: free_port() for role in roles}
    served = dict(ports)  # the ports the sentinel names and clients use
    args: dict[str, list[str]] = {role: [] for role in roles}
    extra: dict[str, object] = {}
    if tls:
        files = make_certificates(workdir / "tls")
        served = {role: free_port() for role in roles}
        args = {role: tls_arguments(files, served[role]) for role in roles}
        extra = {"tls_ports": served, "files": files}
    sentinels = ""  # a proxied setup's URL names two sentinels (below)
    if proxied:
        proxies = Proxies([("127.0.0.1", ports[role]) for role in roles])
        served = {role: p.port for role, p in zip(roles, proxies.proxies, strict=True)}
        # A second address of the one sentinel (another proxy in front of it): to the
        # client, two sentinels, as deployments name several, cut off together.
        sentinels = f",127.0.0.1:{proxies.add('127.0.0.1', ports['sentinel']).port}"
        args["replica"] = ["--replica-announce-port", str(served["replica"])]
        proxy_of = dict(zip((*roles, "sentinel2"), proxies.proxies, strict=True))
        extra = {"proxies": proxies, "proxy_of": proxy_of}
    launch = {
        "master": _node(workdir, ports["master"], *args["master"]),
        "replica": _node(  # replicates over a direct link: a proxy cuts clients off only
            workdir, ports["replica"], *args["replica"], "--replicaof", "127.0.0.1",
            str(ports["master"] if proxied else served["master"]),
        ),
        "sentinel": _sentinel(
            workdir, ports["sentinel"], served["master"], args["sentinel"],
            PROXIED_DOWN_AFTER_MS if proxied else 1000,
        ),
    }  # fmt: skip
    pids: dict[str, int] = {}
    try:
        for role in ("master", "replica", "sentinel"):
            pids[role] = launch[role]()
    except BaseException:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if proxied:
            proxies.close()
        raise
    scheme = "rediss+sentinel" if tls else "redis+sentinel"
    return RunningSetup(
        url=f"{scheme}://127.0.0.1:{served['sentinel']}{sentinels}/{SERVICE}",
        pid=pids["sentinel"], port=ports["sentinel"], workdir=workdir,
        extra={"ports": ports, "pids": pids, "launch": launch, **extra},
    )  # fmt: skip


def start(workdir: Path) -> RunningServer:
    return start_setup(workdir)


SERVERS["redis_sentinel"] = ServerKind("redis_sentinel", start)

ROWS.append(
    StoreRow(
        "redis+sentinel",
        "redis_sentinel",
        isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"),
        discovers=True,
        proxied=lambda workdir: start_setup(workdir, proxied=True),
    )
)
