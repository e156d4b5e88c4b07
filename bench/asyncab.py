#!/usr/bin/env python3
"""Two latchkey trees, sync and asyncio, and the raw client, head to head on one store:
did a change close the asyncio gap, and did the sync API stay where it was?

    bench/.venv/bin/python bench/asyncab.py OLD_SRC NEW_SRC [--store postgresql+advisory]
        [--rounds 10] [--seconds 1] [--url URL] [--out results.json]

Each round runs, each in a fresh process (so each tree imports its own code) and in an order
that alternates from round to round: uncontended acquire + release pairs, one lock object per
pair, for ``--seconds``, of the old and the new tree through the sync and the asyncio API, and
the raw client doing the same round trips (``bench/rawasync.py``'s pair: psycopg's sync and
async connections for ``postgresql+advisory``; PyMySQL and asyncmy for ``mysql+getlock``).
Each slice reports its pairs/s and the CPU time of its process per pair (user + system:
what a pair costs the client, which the load of a shared machine disturbs less than the wall
clock). Printed: the medians over the rounds of the ratios taken within each round —

- ``A`` async / sync of each tree (issue 12's target: ≥ 0.8);
- ``F`` raw async / raw sync (the floor: what asyncio costs the raw client);
- async / raw async of each tree (latchkey's asyncio pair against the raw asyncio pair);
- new / old, sync and async (the sync API must stay ≥ 0.95).

Starts its own server (tests/servers) unless ``--url`` names a running one (its base scheme:
``postgresql://`` or ``mysql://``), and stops it by pid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import SERVERS, load_all  # noqa: E402

SERVER = {"postgresql+advisory": "postgresql", "mysql+getlock": "mysql"}

WORKER = """
import asyncio, sys, time
src, url, base, mode, seconds = sys.argv[1:6]
seconds = float(seconds)
sys.path.insert(0, src)
sys.path.insert(0, sys.argv[6])  # bench/, for rawasync
import latchkey

def timed(step, limit):
    n, started, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < limit:
        step()
        n += 1
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return n / wall, cpu / n * 1e6

async def atimed(step, limit):
    n, started, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < limit:
        await step()
        n += 1
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return n / wall, cpu / n * 1e6

if mode == "sync":
    store = latchkey.connect(url)
    def step():
        lock = store.lock("asyncab", ttl=30, wait=5)
        lock.acquire()
        lock.release()
    timed(step, 0.3)
    print(*timed(step, seconds))
    store.close()
elif mode == "async":
    async def main():
        store = latchkey.connect_async(url)
        async def step():
            lock = store.lock("asyncab", ttl=30, wait=5)
            await lock.acquire()
            await lock.release()
        await atimed(step, 0.3)
        print(*(await atimed(step, seconds)))
        await store.aclose()
    asyncio.run(main())
else:
    import rawasync
    family = "postgresql" if url.startswith("postgresql") else "mysql"
    loop = asyncio.new_event_loop()
    pair, apair, close = rawasync.make(url.split("://")[0], {family: base, "tmp": "/tmp"}, loop)
    if mode == "rawsync":
        timed(pair, 0.3)
        print(*timed(pair, seconds))
    else:
        loop.run_until_complete(atimed(apair, 0.3))
        print(*loop.run_until_complete(atimed(apair, seconds)))
    loop.run_until_complete(close())
    loop.close()
"""

SLICES = ("old:sync", "old:async", "new:sync", "new:async", "raw:rawsync", "raw:rawasync")


def run_slice(src: str, url: str, base: str, mode: str, seconds: float) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, src, url, base, mode, str(seconds),
         str(ROOT / "bench")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rate, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(rate), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--store", default="postgresql+advisory", choices=sorted(SERVER))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--url", help="a running server's base URL (postgresql:// or mysql://)")
    parser.add_argument("--out")
    args = parser.parse_args()
    server = SERVER[args.store]
    rounds: list[dict[str, tuple[float, float]]] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="latchkey-asyncab-") as tmp:
        running = None
        try:
            base = args.url
            if base is None:
                load_all()
                running = SERVERS[server].start(Path(tmp) / server)
                base = running.url
            url = base.replace(f"{server}://", f"{args.store}://", 1)
            for i in range(args.rounds):
                order = SLICES if i % 2 == 0 else tuple(reversed(SLICES))
                row: dict[str, tuple[float, float]] = {}
                for which in order:
                    tree, mode = which.split(":")
                    src = {"old": args.old, "new": args.new, "raw": args.new}[tree]
                    row[which] = run_slice(src, url, base, mode, args.seconds)
                rounds.append(row)
                print(
                    f"round {i + 1}: "
                    + ", ".join(f"{k} {v[0]:,.0f}/s {v[1]:.0f}µs" for k, v in row.items()),
                    flush=True,
                )
        finally:
            if running is not None:
                running.stop()

    def med(top: str, bottom: str, what: int) -> tuple[float, float, float]:
        ratios = [r[top][what] / r[bottom][what] for r in rounds]
        return statistics.median(ratios), min(ratios), max(ratios)

    summary: dict[str, Any] = {"started": started, "store": args.store, "rounds": rounds}
    lines = [
        ("A new: async / sync", "new:async", "new:sync"),
        ("A old: async / sync", "old:async", "old:sync"),
        ("F: raw async / raw sync", "raw:rawasync", "raw:rawsync"),
        ("new async / raw async", "new:async", "raw:rawasync"),
        ("old async / raw async", "old:async", "raw:rawasync"),
        ("new / old, sync", "new:sync", "old:sync"),
        ("new / old, async", "new:async", "old:async"),
    ]
    print(f"{args.store}, {args.rounds} rounds of {args.seconds:g} s slices, from {started}")
    for label, top, bottom in lines:
        rate, cpu = med(top, bottom, 0), med(bottom, top, 1)  # CPU: bottom/top, as a speed
        summary[label] = {"pairs/s": rate, "cpu": cpu}
        print(
            f"  {label:26} pairs/s {rate[0]:.3f} ({rate[1]:.2f}-{rate[2]:.2f});"
            f" by CPU per pair {cpu[0]:.3f} ({cpu[1]:.2f}-{cpu[2]:.2f})"
        )
    for which in SLICES:
        rates = [r[which][0] for r in rounds]
        cpus = [r[which][1] for r in rounds]
        print(
            f"  {which:14} median {statistics.median(rates):,.0f} pairs/s,"
            f" {statistics.median(cpus):.0f} µs CPU a pair"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
