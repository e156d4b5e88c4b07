"""Disposable real servers for the tests, and the table of stores the conformance suite runs on.

Each module in this package (``postgresql.py``, ``redis.py`` …) adds its own rows, so that a
new store touches no shared file:

- ``SERVERS[name] = ServerKind(...)``: how to start a disposable server on a free loopback port
  in a temporary directory, and which ``LATCHKEY_TEST_<NAME>_URL`` points at an existing one;
- ``ROWS.append(StoreRow(...))``: a store URL scheme the suite runs on, the server it needs, and
  how to give each test its own namespace (a fresh table, key prefix or collection).

Servers start lazily (only when a test needs them), once per test session, and are stopped by
pid at the end. Nothing here touches services already running on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pkgutil
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode


class ServerUnavailable(Exception):
    """The server cannot be had here (binary missing and not root, say). Carries the reason."""


@dataclass
class RunningServer:
    """A server we started. ``url`` is its base store URL (no isolation options)."""

    url: str
    pid: int
    port: int
    workdir: Path
    restart_cmd: Callable[[], int] | None = None
    stop_signal: int = signal.SIGTERM
    extra: dict[str, object] = field(default_factory=dict)

    def stop(self) -> None:
        """Stop the server by pid and wait until its port is closed and its process has
        exited: a server closes its port before it is done shutting down (PostgreSQL writes
        its shutdown checkpoint, then removes postmaster.pid), and a start in between fails."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, self.stop_signal)
        wait_port_closed(self.port)
        wait_gone([self.pid])

    def processes(self) -> list[int]:
        """The server's pid and its children's (PostgreSQL serves each session from a child:
        stopping the postmaster alone freezes nothing a client talks to)."""
        return [self.pid, *children(self.pid)]

    def crash(self) -> None:
        """SIGKILL the server and its children, as when its machine dies; returns once its
        port is closed and its processes are gone. Start it again with :meth:`start`."""
        tree = self.processes()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_port_closed(self.port)
        wait_gone(tree)
        data, sockets = self.extra.get("data"), self.extra.get("sockets")
        if data and sockets:  # PostgreSQL: the dead postmaster may linger as a zombie nobody
            # reaps (this sandbox's init does not), and a zombie's pid "exists"
            Path(str(data), "postmaster.pid").unlink(missing_ok=True)
            for lock in Path(str(sockets)).glob(".s.PGSQL.*.lock"):
                lock.unlink(missing_ok=True)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP the server and its children, SIGCONT them on exit: the kernel still accepts
        connections and acknowledges traffic, but nothing answers — a stalled machine."""
        tree = self.processes()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        # kill() returns once the signal is queued; a thread running on the other core (or
        # waiting for one, under load) may still answer a request before it stops. Frozen
        # means every thread of every process is seen stopped.
        deadline = time.monotonic() + 10
        while not all(_stopped(pid) for pid in tree):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {tree} did not stop within 10s of SIGSTOP")
            time.sleep(0.001)
        try:
            yield
        finally:
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def start(self) -> None:
        """Start it again on the same port and data (for fault tests)."""
        if self.restart_cmd is None:
            raise RuntimeError("this server cannot be restarted")
        self.pid = self.restart_cmd()
        wait_port_open(self.port)


#: The server processes started with Popen, kept so that each is reaped (no zombie, no
#: "still running" warning from a collected Popen) once it has been stopped by pid.
_STARTED: list[subprocess.Popen[bytes]] = []


def keep(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Keep a server process started with Popen until it is reaped: at the next start, or at
    exit (each was stopped by pid before the run ended)."""
    for old in _STARTED:
        old.poll()  # reap servers stopped earlier
    _STARTED.append(proc)
    return proc


@atexit.register
def _reap_stopped_servers() -> None:
    for proc in _STARTED:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T or t), or the process is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here: the signal is all we can do
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue  # the thread ended
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


@dataclass(frozen=True)
class ServerKind:
    name: str  # e.g. "postgresql"; env var LATCHKEY_TEST_POSTGRESQL_URL
    start: Callable[[Path], RunningServer]

    @property
    def env_var(self) -> str:
        return f"LATCHKEY_TEST_{self.name.upper()}_URL"


@dataclass(frozen=True)
class StoreRow:
    """One store the conformance suite runs on."""

    id: str  # the pytest id, e.g. "postgresql" or "postgresql+advisory"
    server: str | None  # a SERVERS key, or None for embedded stores
    isolate: Callable[[str, str, Path], str]  # (base_url, tag, tmp_path) -> URL for one test
    base_url: Callable[[str], str] = lambda url: url  # server URL -> this row's base URL
    required_in_ci: bool = True  # False only where no server can be had
    #: The client talks to the servers the URL's address announces (a cluster's nodes, the
    #: master a sentinel names), not to that address: a proxy put in front of it is bypassed.
    discovers: bool = False
    #: For a row that ``discovers``: starts a setup of its own whose servers announce proxies
    #: (``extra["proxies"]``, a :class:`tests.faults.proxy.Proxies`), so that every
    #: connection a client opens, found or given, goes through one (the network fault tests).
    proxied: Callable[[Path], RunningServer] | None = None


SERVERS: dict[str, ServerKind] = {}
ROWS: list[StoreRow] = []


def with_query(url: str, **options: str) -> str:
    """``url`` with ``options`` set in its query string (replacing any given already)."""
    base, _, query = url.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in options]
    return base + "?" + urlencode([*kept, *options.items()])


def replace_scheme(url: str, scheme: str) -> str:
    return scheme + url[url.index("://") :]


# -- helpers for server modules ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_port_open(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_open(port):
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"nothing answered on 127.0.0.1:{port} within {timeout}s")
        time.sleep(0.02)


def wait_port_closed(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while port_open(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"127.0.0.1:{port} still open {timeout}s after stop")
        time.sleep(0.02)


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Until every one of ``pids`` has exited (a zombie counts as exited, and one that is
    our child is reaped)."""
    deadline = time.monotonic() + timeout
    while pids := [p for p in pids if running(p)]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} still running {timeout}s after stop")
        time.sleep(0.02)


def running(pid: int) -> bool:
    """Whether ``pid`` is alive: not gone, not a zombie (reaped here if it is our child;
    this sandbox's init does not reap the daemons it inherits, so theirs may linger)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


_apt_updated = False


def ensure_binary(binary: str, package: str, search: tuple[str, ...] = ()) -> str:
    """The path of ``binary``; installs Debian ``package`` when missing and we are root."""
    global _apt_updated
    for path in (*search, shutil.which(binary)):
        if path and os.access(path, os.X_OK):
            return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ServerUnavailable(f"{binary} not found and cannot install {package} (not root/apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not _apt_updated:
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
        _apt_updated = True
    proc = subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    for path in (*search, shutil.which(binary)):
        if path and os.access(path, os.X_OK):
            return path
    raise ServerUnavailable(f"installing {package} did not provide {binary}: {proc.stderr[-500:]}")


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return found


def read_pidfile(path: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(path.read_text().split()[0])
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"no pid in {path} after {timeout}s")
        time.sleep(0.02)


def run_daemon(cmd: list[str], pidfile: Path, what: str, timeout: float = 60) -> int:
    """Run a server that daemonizes itself (``--daemonize``, ``-d``, ``--fork``) and writes
    ``pidfile``; return its pid. A non-zero exit is ServerUnavailable with its output."""
    pidfile.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout)[-500:]
        raise ServerUnavailable(f"{what} exited {proc.returncode}: {output}")
    return read_pidfile(pidfile)


def load_all() -> None:
    """Import every server module so that it registers its SERVERS and ROWS."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


# -- the embedded stores ------------------------------------------------------------------------

ROWS.append(StoreRow("memory", None, lambda base, tag, tmp: f"memory://{tag}"))
ROWS.append(StoreRow("sqlite", None, lambda base, tag, tmp: f"sqlite:///{tmp}/locks-{tag}.db"))
