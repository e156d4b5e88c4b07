#!/usr/bin/env python3
"""The asyncio API against the sync API of the same store, in one run.

    bench/.venv/bin/python bench/asyncrows.py [--stores sqlite,redis,postgresql,...]
        [--slices 16] [--seconds 0.5] [--reps 20] [--out results.json]

A  uncontended acquire+release pairs/s, one lock object per pair. The sync API and the asyncio
   API alternate in short slices (ABBA order) in one process, so both see the same machine
   load; the asyncio slices run inside one coroutine on one event loop (no loop entry per
   call). Reported: the median of the per-slice-pair ratios async/sync.
F  the floor under A: the raw client's round trips (bench/rawasync.py), its asyncio pair
   against its sync pair, in the same paired slices. latchkey's A ratio cannot be much above
   it: what asyncio costs per round trip against a blocking call on this machine.
B  hand-off: a waiter process blocked in acquire, the holder releases; time from the release
   call to the waiter's return (bench/scenarios.py scenario_b), for a sync waiter and for an
   asyncio waiter awaiting in its event loop.

Targets (issue 12): async A ≥ 0.8x sync A; async B ≤ 1.3x sync B + 5 ms on PostgreSQL and
Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import rawasync  # noqa: E402
import scenarios  # noqa: E402
from subjects import LATCHKEY_URLS, SERVER_OF, TTL  # noqa: E402

import latchkey  # noqa: E402
import servers  # noqa: E402


def sync_pairs_for(store: latchkey.Store, name: str, seconds: float) -> float:
    pairs, started = 0, time.perf_counter()
    while pairs < 100_000 and time.perf_counter() - started < seconds:
        lock = store.lock(name, ttl=TTL, wait=5)
        if not lock.acquire():
            raise RuntimeError("uncontended acquire failed")
        lock.release()
        pairs += 1
    return pairs / (time.perf_counter() - started)


async def async_pairs_for(store: latchkey.AsyncStore, name: str, seconds: float) -> float:
    pairs, started = 0, time.perf_counter()
    while pairs < 100_000 and time.perf_counter() - started < seconds:
        lock = store.lock(name, ttl=TTL, wait=5)
        if not await lock.acquire():
            raise RuntimeError("uncontended acquire failed")
        await lock.release()
        pairs += 1
    return pairs / (time.perf_counter() - started)


def abba(
    sync_rate: Callable[[float], float],
    async_rate: Callable[[float], Awaitable[float]],
    loop: asyncio.AbstractEventLoop,
    slices: int,
    seconds: float,
) -> dict[str, Any]:
    """Sync and asyncio slices of ``seconds`` each, alternating ABBA after a warm-up of both:
    the median of the per-pair ratios async/sync, their range, and the median rates."""
    sync_rate(0.3)
    loop.run_until_complete(async_rate(0.3))
    ratios, sync_rates, async_rates = [], [], []
    for i in range(slices):
        rates: dict[int, float] = {}
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            if which == 0:
                rates[0] = sync_rate(seconds)
            else:
                rates[1] = loop.run_until_complete(async_rate(seconds))
        sync_rates.append(rates[0])
        async_rates.append(rates[1])
        ratios.append(rates[1] / rates[0])
    med = statistics.median
    return {
        "ratio": med(ratios), "range": [min(ratios), max(ratios)],
        "sync": med(sync_rates), "async": med(async_rates),
    }  # fmt: skip


def paired_a(url: str, slices: int, seconds: float, tag: str) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    sync_store = latchkey.connect(url)
    async_store = latchkey.connect_async(url)
    name = f"aa:{tag}"
    try:
        return abba(
            lambda limit: sync_pairs_for(sync_store, name, limit),
            lambda limit: async_pairs_for(async_store, name + ":a", limit),
            loop, slices, seconds,
        )  # fmt: skip
    finally:
        sync_store.close()
        loop.run_until_complete(async_store.aclose())
        loop.close()


def paired_f(store: str, env: dict[str, str], slices: int, seconds: float) -> dict[str, Any]:
    """F: the raw client's asyncio pair against its sync pair (bench/rawasync.py), in the same
    ABBA slices as A: the floor under A's ratio."""
    loop = asyncio.new_event_loop()
    pair, apair, close = rawasync.make(store, env, loop)

    def sync_rate(limit: float) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < limit:
            pair()
            done += 1
        return done / (time.perf_counter() - started)

    async def async_rate(limit: float) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < limit:
            await apair()
            done += 1
        return done / (time.perf_counter() - started)

    try:
        return abba(sync_rate, async_rate, loop, slices, seconds)
    finally:
        loop.run_until_complete(close())
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(LATCHKEY_URLS))
    parser.add_argument("--slices", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-b", action="store_true", help="A and F only")
    parser.add_argument("--out")
    args = parser.parse_args()
    stores = [s for s in args.stores.split(",") if s]
    families = sorted({"postgresql" if s.startswith("postgresql") else
                       "mysql" if s.startswith("mysql") else s for s in stores})  # fmt: skip
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="latchkey-bench-") as tmp:
        env, running = servers.start([f for f in families if f in servers.FAMILY_SERVERS],
                                     Path(tmp))  # fmt: skip
        try:
            for store in stores:
                if SERVER_OF[store] is not None and SERVER_OF[store] not in env:
                    continue
                url = LATCHKEY_URLS[store](env)
                row: dict[str, Any] = {}
                try:
                    row["A"] = paired_a(url, args.slices, args.seconds, f"{store}:{time.time()}")
                except Exception as exc:
                    row["A"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                try:
                    row["F"] = paired_f(store, env, args.slices, args.seconds)
                except Exception as exc:
                    row["F"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                b_sync, b_async = [], []
                for r in range(0 if args.no_b else args.rounds):
                    tag = f"{store}:{r}:{time.time()}"
                    for key, out in ((f"{store}/latchkey", b_sync),
                                     (f"{store}/latchkey-async", b_async)):  # fmt: skip
                        res = scenarios.scenario_b(key, env, args.reps, 30, tag)
                        if "median_ms" in res:
                            out.append(res["median_ms"])
                row["B"] = {"sync_ms": b_sync, "async_ms": b_async}
                results[store] = row
                a, b, f = row["A"], row["B"], row["F"]
                a_txt = (f"A async/sync {a['ratio']:.2f} ({a['range'][0]:.2f}-{a['range'][1]:.2f}),"
                         f" {a['async']:,.0f} vs {a['sync']:,.0f} pairs/s"
                         if "ratio" in a else f"A {a.get('error')}")  # fmt: skip
                med = statistics.median
                b_txt = (f"B sync {med(b['sync_ms']):.1f} ms, async {med(b['async_ms']):.1f} ms"
                         if b["sync_ms"] and b["async_ms"] else "B not measured")  # fmt: skip
                f_txt = (f"F raw async/sync {f['ratio']:.2f}"
                         f" ({f['range'][0]:.2f}-{f['range'][1]:.2f}),"
                         f" {f['async']:,.0f} vs {f['sync']:,.0f} pairs/s"
                         if "ratio" in f else f"F {f.get('error')}")  # fmt: skip
                print(f"{store:22} {a_txt}; {f_txt}; {b_txt}", flush=True)
        finally:
            servers.stop(running)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
