"""A disposable MongoDB server for the tests, when one can be had, and the MongoDB store row.

No MongoDB server is packaged for Debian, on PyPI or on npm without a download from elsewhere
(see notes/test-servers.md), so this starts ``mongod`` only when it is already on PATH, or
uses ``LATCHKEY_TEST_MONGODB_URL``. Otherwise the MongoDB rows are skipped with the reason,
also in CI (the row is not required there). There is no fake server: a store is tested against
the real thing or not at all.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tests.servers import (
    ROWS,
    SERVERS,
    RunningServer,
    ServerKind,
    ServerUnavailable,
    StoreRow,
    free_port,
    run_daemon,
    wait_port_open,
    with_query,
)

NO_SERVER = "no mongod on PATH and LATCHKEY_TEST_MONGODB_URL not set: the MongoDB rows were not run"


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
    """Start ``mongod`` (forked) on a free loopback port with its data in ``workdir``."""
    binary = shutil.which("mongod")
    if binary is None:
        raise ServerUnavailable(NO_SERVER)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pidfile = workdir / "mongod.pid"
    cmd = [
        binary, "--dbpath", str(data), "--port", str(port), "--bind_ip", "127.0.0.1",
        "--fork", "--logpath", str(workdir / "mongod.log"), "--pidfilepath", str(pidfile),
    ]  # fmt: skip

    def launch() -> int:
        pid = run_daemon(cmd, pidfile, "mongod", timeout=120)
        wait_port_open(port)
        deadline = time.monotonic() + 30
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
        isolate=lambda base, tag, tmp: with_query(base, collection=f"t_{tag}"),
        required_in_ci=False,
    )
)
