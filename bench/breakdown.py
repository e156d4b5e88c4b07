#!/usr/bin/env python3
"""Where latchkey's uncontended time goes (scenario A), layer by layer, on one store.

    bench/.venv/bin/python bench/breakdown.py [--stores redis,postgresql,...] [--slices 12]

For each store it alternates, in 0.5 s slices in one process (so every layer sees the same
machine load), acquire+release pairs through:

- ``raw``: the raw baseline of bench/subjects.py (the minimal statements or commands);
- ``backend``: latchkey's backend primitives called directly (``backend.acquire`` /
  ``backend.release``): latchkey's statements/scripts and its driver handling, no core;
- ``lock``: the public API, ``store.lock(name).acquire()`` / ``release()`` (what users get).

``backend - raw`` is what the store module costs over the minimum (bigger statements, extra
round trips, result parsing); ``lock - backend`` is the core's cost (owner token, owner JSON,
duration parsing, deadline bookkeeping). Each is shown in microseconds per pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import subjects  # noqa: E402

import servers  # noqa: E402

RAW = {
    "redis": "redis/raw",
    "postgresql": "postgresql/raw",
    "postgresql+advisory": "postgresql/raw-advisory",
    "mysql": "mysql/raw",
    "mysql+getlock": "mysql/raw-getlock",
    "memcached": "memcached/raw",
    "sqlite": "sqlite/raw",
}
FAMILY = {"postgresql+advisory": "postgresql", "mysql+getlock": "mysql"}


def rate(pair: Callable[[], None], seconds: float) -> float:
    n, started = 0, time.perf_counter()
    while n < 100_000 and time.perf_counter() - started < seconds:
        pair()
        n += 1
    return n / (time.perf_counter() - started)


def layers(store: str, env: dict[str, str]) -> tuple[dict[str, Callable[[], None]], list[object]]:
    import latchkey
    from latchkey._owner import Owner, new_owner_token

    raw = subjects.REGISTRY[RAW[store]].build(env)
    lk = latchkey.connect(subjects.LATCHKEY_URLS[store](env))
    lk.init()
    backend = lk.backend
    info = Owner.current().to_json()

    def raw_pair() -> None:
        h = raw.make("bd:raw")
        h.acquire(5)
        h.release()

    def backend_pair() -> None:
        owner = new_owner_token()
        backend.acquire("bd:backend", owner, info, 30.0, 1)
        backend.release("bd:backend", owner)

    def lock_pair() -> None:
        lock = lk.lock("bd:lock", ttl=30)
        lock.acquire(wait=5)
        lock.release()

    return {"raw": raw_pair, "backend": backend_pair, "lock": lock_pair}, [raw, lk]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stores", default=",".join(RAW))
    ap.add_argument("--slices", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stores = [s for s in args.stores.split(",") if s]
    families = sorted({FAMILY.get(s, s) for s in stores})
    workdir = Path(tempfile.mkdtemp(prefix="latchkey-breakdown-"))
    workdir.chmod(0o755)
    env, running = servers.start(families, workdir)
    results: dict[str, dict[str, float]] = {}
    try:
        for store in stores:
            pairs, closers = layers(store, env)
            for pair in pairs.values():  # warm up
                rate(pair, 0.3)
            got: dict[str, list[float]] = {k: [] for k in pairs}
            order = list(pairs)
            for i in range(args.slices):
                for k in order if i % 2 == 0 else order[::-1]:
                    got[k].append(rate(pairs[k], args.seconds))
            med = {k: statistics.median(v) for k, v in got.items()}
            us = {k: 1e6 / v for k, v in med.items()}
            results[store] = {
                **{f"{k} pairs/s": round(v) for k, v in med.items()},
                **{f"{k} µs/pair": round(v, 1) for k, v in us.items()},
                "store module over raw, µs": round(us["backend"] - us["raw"], 1),
                "core over backend, µs": round(us["lock"] - us["backend"], 1),
            }
            print(store, json.dumps(results[store], ensure_ascii=False), flush=True)
            for c in closers:
                c.close()  # type: ignore[attr-defined]
    finally:
        servers.stop(running)
    print("\n| store | raw µs/pair | backend µs/pair | Lock API µs/pair | store module | core |")
    print("| --- | --- | --- | --- | --- | --- |")
    for store, r in results.items():
        print(f"| {store} | {r['raw µs/pair']} | {r['backend µs/pair']} | {r['lock µs/pair']} | "
              f"{r['store module over raw, µs']:+} | {r['core over backend, µs']:+} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
