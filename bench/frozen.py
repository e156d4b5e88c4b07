#!/usr/bin/env python3
"""How long each store takes to report a frozen server, sync and asyncio.

    .venv/bin/python bench/frozen.py [--stores postgresql,redis,...] [--timeout 2] [--out f.json]

A frozen server (SIGSTOP of the server and its children: a stalled VM, a process stuck in the
kernel) is the fault no TCP timeout catches — its kernel still accepts connections and
acknowledges every packet and keepalive — so it measures latchkey's own local bounds. For each
store (its own disposable server, tests/servers), with ``timeout`` in the URL: a holder
acquires a lock (its connection stays pooled and idle), the server is frozen, and three calls
are timed until they raise StoreUnavailable: the holder's ``extend`` (its old connection),
``inspect``, and an acquire from a second store object (a new connection). Then the server is
thawed and the time until the store answers again is measured. Reported in seconds; a call
that did not fail (it should) is reported as such. The promise (docs/reliability.md): within
the timeout plus one second per network step, a step being a statement or a connection
attempt (a PostgreSQL connect is bounded by the timeout as a whole, stores/io/pgconnect.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import servers  # noqa: E402

import latchkey  # noqa: E402


def timed(call: Callable[[], Any]) -> str:
    started = time.monotonic()
    try:
        call()
    except latchkey.StoreUnavailable:
        return f"{time.monotonic() - started:.2f}"
    return f"no error ({time.monotonic() - started:.2f})"


def measure_sync(url: str, server: servers.RunningServer) -> dict[str, str]:
    store, other = latchkey.connect(url), latchkey.connect(url)
    holder = store.lock("frozen", ttl="60s")
    holder.acquire()
    try:
        with server.frozen():
            out = {
                "extend": timed(holder.extend),
                "inspect": timed(lambda: store.inspect("frozen")),
                "new connection": timed(lambda: other.lock("frozen", wait=0).acquire()),
            }
        started = time.monotonic()
        while True:
            try:
                store.inspect("frozen")
                break
            except latchkey.StoreUnavailable:
                if time.monotonic() - started > 60:
                    break
        out["thaw → answer"] = f"{time.monotonic() - started:.2f}"
        return out
    finally:
        store.close()
        other.close()


def measure_async(url: str, server: servers.RunningServer) -> dict[str, str]:
    async def main() -> dict[str, str]:
        store, other = latchkey.connect_async(url), latchkey.connect_async(url)
        holder = store.lock("frozen-async", ttl="60s")
        await holder.acquire()

        async def atimed(call: Callable[[], Any]) -> str:
            started = time.monotonic()
            try:
                await call()
            except latchkey.StoreUnavailable:
                return f"{time.monotonic() - started:.2f}"
            return f"no error ({time.monotonic() - started:.2f})"

        try:
            with server.frozen():
                out = {
                    "extend": await atimed(holder.extend),
                    "inspect": await atimed(lambda: store.inspect("frozen-async")),
                    "new connection": await atimed(
                        lambda: other.lock("frozen-async", wait=0).acquire()
                    ),
                }
            started = time.monotonic()
            while time.monotonic() - started < 60:
                try:
                    await store.inspect("frozen-async")
                    break
                except latchkey.StoreUnavailable:
                    pass
            out["thaw → answer"] = f"{time.monotonic() - started:.2f}"
            return out
        finally:
            await store.aclose()
            await other.aclose()

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stores", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    servers.load_all()
    wanted = {s for s in args.stores.split(",") if s}
    rows = [r for r in servers.ROWS if r.server and (not wanted or r.id in wanted)]
    results: list[dict[str, str]] = []
    running: dict[str, servers.RunningServer] = {}
    workdir = Path(tempfile.mkdtemp(prefix="latchkey-frozen-"))
    try:
        for row in rows:
            assert row.server is not None
            if row.server not in running:
                running[row.server] = servers.SERVERS[row.server].start(workdir / row.server)
            server = running[row.server]
            base = row.isolate(row.base_url(server.url), uuid.uuid4().hex[:12], workdir)
            url = servers.with_query(base, timeout=f"{args.timeout:g}s")
            for api, measure in (("sync", measure_sync), ("asyncio", measure_async)):
                cells = measure(url, server)
                results.append({"store": row.id, "api": api, **cells})
                print(json.dumps(results[-1], ensure_ascii=False), flush=True)
    finally:
        for server in running.values():
            server.stop()
    cols = ["store", "api", "extend", "inspect", "new connection", "thaw → answer"]
    print(f"\nfrozen server, timeout {args.timeout:g} s: seconds until StoreUnavailable\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in results:
        print("| " + " | ".join(r.get(c, "") for c in cols) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"timeout": args.timeout, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
