"""A disposable Redis server for the tests, and the Redis store row.

The server runs without persistence (``--save '' --appendonly no``), as the store's docs
describe the default: a restart loses leases and fencing counters. ``start_redis`` also lets
a test start its own server with extra arguments (``--requirepass``, say).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
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


def command(port: int, *args: str, timeout: float = 2.0) -> str:
    """Send one command (RESP) to 127.0.0.1:``port``; its raw reply ('' if none): for the
    failover helpers of the Sentinel and Cluster setups."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=timeout) as s,
    ):
        wire = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        s.sendall(wire.encode())
        chunks: list[bytes] = []
        while not (chunks and chunks[-1].endswith(b"\r\n")):
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    return ""


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``condition()``; ServerUnavailable naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"{what}: not after {timeout}s")
        time.sleep(0.02)


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


#: The password of the client key :func:`start_redis_tls` writes.
CLIENT_KEY_PASSWORD = "k3y-Pw9"


def make_certificates(workdir: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate (its key
    encrypted with :data:`CLIENT_KEY_PASSWORD`), made with the openssl command."""
    openssl = ensure_binary("openssl", "openssl")
    workdir.mkdir(parents=True, exist_ok=True)
    names = ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key",
             "client-enc.key")  # fmt: skip
    files = {name: workdir / name for name in names}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str | Path) -> None:
        cmd = [openssl, *map(str, args)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise ServerUnavailable(f"openssl {args[0]} failed: {done.stderr[-300:]}")

    run("req", "-x509", *ec, "-keyout", files["ca.key"], "-out", files["ca.pem"], "-days", "2",
        "-subj", "/CN=latchkey test CA")  # fmt: skip
    san = workdir / "san.cnf"
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, extra in (("server", ["-extfile", str(san)]), ("client", [])):
        csr = workdir / f"{who}.csr"
        run("req", "-new", *ec, "-keyout", files[f"{who}.key"], "-out", csr,
            "-subj", f"/CN={'localhost' if who == 'server' else 'latchkey-client'}")  # fmt: skip
        run("x509", "-req", "-in", csr, "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
            "-CAcreateserial", "-out", files[f"{who}.pem"], "-days", "2", *extra)  # fmt: skip
    run("pkey", "-in", files["client.key"], "-aes256", "-passout", f"pass:{CLIENT_KEY_PASSWORD}",
        "-out", files["client-enc.key"])  # fmt: skip
    return files


def start_redis_tls(workdir: Path) -> tuple[RunningServer, int, dict[str, Path]]:
    """A Redis that also serves TLS on a port of its own and asks for a client certificate
    (``tls-auth-clients yes``); the plain port stays for the readiness check. Returns the
    server, the TLS port and the certificate files (:func:`make_certificates`)."""
    files = make_certificates(workdir / "tls")
    tls_port = free_port()
    server = start_redis(
        workdir, "--tls-port", str(tls_port), "--tls-cert-file", str(files["server.pem"]),
        "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.pem"]),
        "--tls-auth-clients", "yes",
    )  # fmt: skip
    return server, tls_port, files


def start(workdir: Path) -> RunningServer:
    return start_redis(workdir)


SERVERS["redis"] = ServerKind("redis", start)

ROWS.append(
    StoreRow("redis", "redis", isolate=lambda base, tag, tmp: with_query(base, prefix=f"t{tag}:"))
)
