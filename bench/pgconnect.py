#!/usr/bin/env python3
"""How long a PostgreSQL call takes to open a connection through hung hosts, sync and asyncio.

    PYTHONPATH=SRC .venv/bin/python bench/pgconnect.py [--timeouts 1,2,3] [--repeat 3]
        [--stores postgresql,postgresql+advisory] [--no-live]

SRC is the ``src`` of the tree to measure (a ``git worktree add`` of an older commit, say).
A hung host is a socket on loopback whose connections are accepted and never read nor
answered (a thread accepts them, so the backlog never fills: a host that accepts and never
answers, as the fault proxy's blackhole; a full backlog would drop SYNs instead, which
``tcp_user_timeout`` ends). For each store, API, ``timeout`` and one or two hung hosts: a
fresh store's ``acquire(wait=0)`` is timed until it raises StoreUnavailable (the median of
``--repeat`` runs). Then, unless ``--no-live``, a hung
first host and a live PostgreSQL (its own disposable server, tests/servers) as the second: the
time until the acquire succeeds. The promise (DESIGN §2.7): StoreUnavailable within the
timeout; the live host reached within the time the hung one's share leaves it.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: the tree measured is the one given

from tests.servers import ServerUnavailable  # noqa: E402
from tests.servers.postgresql import start as start_postgresql  # noqa: E402

import latchkey  # noqa: E402


def acquire(url: str, api: str) -> tuple[float, str]:
    """Seconds, and "ok" or the error's class, of one acquire(wait=0) of a fresh store."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    if api == "sync":
        with latchkey.connect(url) as store:
            lock = store.lock(name, ttl="30s", wait=0)
            started = time.monotonic()
            try:
                lock.acquire()
            except latchkey.StoreUnavailable:
                return time.monotonic() - started, "unavailable"
            took = time.monotonic() - started
            lock.release()
            return took, "ok"

    async def main() -> tuple[float, str]:
        async with latchkey.connect_async(url) as store:
            lock = store.lock(name, ttl="30s", wait=0)
            started = time.monotonic()
            try:
                await lock.acquire()
            except latchkey.StoreUnavailable:
                return time.monotonic() - started, "unavailable"
            took = time.monotonic() - started
            await lock.release()
            return took, "ok"

    return asyncio.run(main())


def row(label: str, url: str, api: str, repeat: int) -> None:
    runs = [acquire(url, api) for _ in range(repeat)]
    outcomes = sorted({outcome for _, outcome in runs})
    times = [took for took, _ in runs]
    spread = f"{min(times):.2f} to {max(times):.2f}"
    median = statistics.median(times)
    print(f"| {label} | {api} | {median:.2f} s ({spread}) | {', '.join(outcomes)} |", flush=True)


def hold(listener: socket.socket, held: list[socket.socket]) -> None:
    """Accept every connection and keep it, never reading nor answering."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        held.append(conn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeouts", default="1,2,3")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stores", default="postgresql,postgresql+advisory")
    parser.add_argument("--no-live", action="store_true")
    args = parser.parse_args()
    print(f"latchkey from {Path(latchkey.__file__).parent}")
    hung: list[socket.socket] = []
    held: list[socket.socket] = []
    for _ in range(2):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        threading.Thread(target=hold, args=(listener, held), daemon=True).start()
        hung.append(listener)
    ports = [listener.getsockname()[1] for listener in hung]
    print("| store, hosts, timeout | API | time (median, range) | outcome |")
    print("| --- | --- | --- | --- |")
    for kind in args.stores.split(","):
        for timeout in args.timeouts.split(","):
            for count in (1, 2):
                hosts = ",".join(f"127.0.0.1:{port}" for port in ports[:count])
                url = f"{kind}://postgres@{hosts}/postgres?timeout={timeout}s"
                for api in ("sync", "asyncio"):
                    row(f"{kind}, {count} hung, {timeout} s", url, api, args.repeat)
    if not args.no_live:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                server = start_postgresql(Path(tmp) / "pg")
            except ServerUnavailable as exc:
                print(f"no live server: {exc}")
                return
            try:
                live = server.url.split("@", 1)[1].split("/", 1)[0]
                for kind in args.stores.split(","):
                    for timeout in args.timeouts.split(","):
                        url = (f"{kind}://postgres@127.0.0.1:{ports[0]},{live}/postgres"
                               f"?timeout={timeout}s&target_session_attrs=read-write")  # fmt: skip
                        for api in ("sync", "asyncio"):
                            row(f"{kind}, hung then live, {timeout} s", url, api, args.repeat)
            finally:
                server.stop()
    for sock in hung + held:
        sock.close()


if __name__ == "__main__":
    main()
