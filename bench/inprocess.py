#!/usr/bin/env python3
"""Threads of one process contending on one name through one store object (issue 17).

    PYTHONPATH=src bench/.venv/bin/python bench/inprocess.py [--stores sqlite,redis]
        [--threads 8] [--seconds 5] [--rounds 3] [--trees OLD/src,NEW/src] [--out f.json]

Scenario C's loop (acquire → owner check inside the critical section → release, ``wait`` up
to 10 s, TTL 30 s), but from ``threads`` threads of one process sharing one
:class:`latchkey.Store`, for ``seconds``. Reported per run: grants per second, the fewest and
most grants of one thread, overlaps seen inside the critical section (never expected), and
the store calls the store object's driver ran (``backend.io.run``, counted by action) per
grant: an acquire that only learns the name is busy is one of them.

``--trees`` runs each round once per source tree (a child process with that tree first on
``PYTHONPATH``), alternating the order round by round (ABBA), so both trees see the same
machine load: the paired A/B against main that docs/benchmarks.md cites. The servers are the
tests' disposable ones (tests/servers), started once for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def url_for(store: str, env: dict[str, str], tag: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{env['tmp']}/inprocess-{tag}.db"
    base = env[store]
    if store == "redis":
        return f"{base}?prefix=ip{tag}:"
    return f"{base}{'&' if '?' in base else '?'}table=ip_{tag}"


def child(url: str, threads: int, seconds: float) -> dict[str, Any]:
    """One run, in this process: the threads, one store object."""
    import latchkey

    store = latchkey.connect(url)
    calls: Counter[str] = Counter()
    run = store.backend.io.run  # type: ignore[attr-defined]

    def counted(steps: Any, action: str, *rest: Any) -> Any:
        calls[action] += 1
        return run(steps, action, *rest)

    store.backend.io.run = counted  # type: ignore[attr-defined]
    warm = store.lock("warm", ttl=30)
    warm.acquire()
    warm.release()
    calls.clear()
    inside = [0]
    counts = [0] * threads
    overlaps = [0]
    timeouts = [0]
    start = threading.Event()
    deadline = [0.0]

    def loop(i: int) -> None:
        start.wait()
        while time.monotonic() < deadline[0]:
            lock = store.lock("one-name", ttl=30)
            if not lock.acquire(wait=max(0.1, min(10.0, deadline[0] - time.monotonic()))):
                timeouts[0] += 1
                continue
            if inside[0]:
                overlaps[0] += 1
            inside[0] = 1
            time.sleep(0)  # yield, so that an overlapping holder would be seen
            inside[0] = 0
            lock.release()
            counts[i] += 1

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    deadline[0] = time.monotonic() + seconds
    start.set()
    for worker in workers:
        worker.join()
    store.close()
    grants = sum(counts)
    return {
        "grants_per_s": grants / seconds, "min": min(counts), "max": max(counts),
        "overlaps": overlaps[0], "timeouts": timeouts[0], "calls": dict(calls),
        "acquire_calls_per_grant": calls["acquire"] / max(1, grants),
        "store_calls_per_grant": sum(calls.values()) / max(1, grants),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="sqlite,redis")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", default="", help="comma-separated src directories to compare")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads, args.seconds)))
        return
    import servers

    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    trees = [t for t in args.trees.split(",") if t] or [os.environ.get("PYTHONPATH", "src")]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        families = [s for s in stores if s != "sqlite"]
        env, running = servers.start(families, Path(tmp))
        try:
            for r in range(args.rounds):
                order = trees if r % 2 == 0 else trees[::-1]
                for store in stores:
                    for tree in order:
                        tag = f"{r}{abs(hash(tree)) % 10_000}{store[:2]}"
                        cmd = [sys.executable, __file__, "--child", url_for(store, env, tag),
                               "--threads", str(args.threads), "--seconds", str(args.seconds)]
                        out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree},
                                             capture_output=True, text=True, timeout=600)
                        if out.returncode:
                            raise SystemExit(f"{store} {tree}: {out.stderr[-2000:]}")
                        one = json.loads(out.stdout.strip().splitlines()[-1])
                        results.setdefault(store, {}).setdefault(tree, []).append(one)
                        print(f"round {r} {store:10} {tree:30} {one['grants_per_s']:9,.0f}/s "
                              f"min/max {one['min']}/{one['max']} overlaps {one['overlaps']} "
                              f"acquire calls/grant {one['acquire_calls_per_grant']:.2f} "
                              f"store calls/grant {one['store_calls_per_grant']:.2f}",
                              flush=True)  # fmt: skip
        finally:
            servers.stop(running)
    print()
    for store, by_tree in results.items():
        for tree, runs in by_tree.items():
            med = statistics.median(x["grants_per_s"] for x in runs)
            calls = statistics.median(x["store_calls_per_grant"] for x in runs)
            acq = statistics.median(x["acquire_calls_per_grant"] for x in runs)
            worst = min(x["min"] / max(1, x["max"]) for x in runs)
            print(f"{store:10} {tree:30} median {med:9,.0f} grants/s; store calls/grant {calls:.2f}"
                  f" (acquire {acq:.2f}); lowest min/max thread share {worst:.2f}; overlaps "
                  f"{sum(x['overlaps'] for x in runs)}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
