#!/usr/bin/env python3
"""What Redis runs per contended acquisition: each script by name, and the pub/sub commands.

    PYTHONPATH=src bench/.venv/bin/python bench/redis_scripts.py [--procs 8] [--seconds 5]
        [--rounds 2] [--out f.json]

Scenario C's loop (``procs`` processes, one name, acquire → ``sleep(0)`` → release, ``wait``
10 s) against a disposable Redis (tests/servers), while a ``MONITOR`` connection counts every
``EVALSHA`` by the script it names (ACQUIRE, RELEASE, JOIN, PASS, from
:mod:`latchkey.stores.redis_lua`) and every SUBSCRIBE, UNSUBSCRIBE and PUBLISH. Reported per
round: acquisitions, and each count divided by them. A count, not a timing: ``MONITOR`` slows
the server, so the rate printed beside it is not scenario C's (bench/run.py measures that).
Run it with another tree's ``src`` on PYTHONPATH to compare two trees.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis

import servers
from latchkey.stores import redis_lua

SCRIPTS = ("ACQUIRE", "RELEASE", "JOIN", "PASS")
COMMANDS = ("SUBSCRIBE", "UNSUBSCRIBE", "PUBLISH")


def _worker(url: str, seconds: float, start: Any, out: Any) -> None:
    import latchkey

    store = latchkey.connect(url)
    start.wait(60)
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        lock = store.lock("scripts", ttl="10s", wait="10s")
        if lock.acquire():
            time.sleep(0)
            lock.release()
            count += 1
    store.close()
    out.put(count)


def _monitor(url: str, counts: collections.Counter[str], stop: threading.Event) -> None:
    by_sha = {getattr(redis_lua, name).sha: name for name in SCRIPTS}
    with redis.Redis.from_url(url).monitor() as monitor:
        for seen in monitor.listen():
            if stop.is_set():  # (the PING one_round sends after the workers stopped)
                return
            words = seen["command"].split()
            verb = words[0].upper()
            if verb == "EVALSHA":
                counts[by_sha.get(words[1].strip('"'), "other script")] += 1
            elif verb in COMMANDS:
                counts[verb] += 1


def one_round(url: str, procs: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(url, seconds, start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    time.sleep(3.0)  # every child imported and connected before the start
    counts: collections.Counter[str] = collections.Counter()
    stop = threading.Event()
    watcher = threading.Thread(target=_monitor, args=(url, counts, stop), daemon=True)
    watcher.start()
    time.sleep(0.5)
    start.set()
    got = [out.get(timeout=seconds + 60) for _ in workers]
    stop.set()
    redis.Redis.from_url(url).ping()  # a command for the monitor to see, and stop at
    watcher.join(10)
    for w in workers:
        w.join(10)
    total = sum(got)
    per = {k: round(counts[k] / total, 3) for k in (*SCRIPTS, *COMMANDS)}
    per["scripts"] = round(sum(counts[k] for k in SCRIPTS) / total, 3)
    return {"acquisitions": total, "fewest/most": round(min(got) / max(got), 2), "per": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="latchkey-bench-") as tmp:
        env, running = servers.start(["redis"], Path(tmp))
        try:
            rounds = [one_round(env["redis"], args.procs, args.seconds) for _ in range(args.rounds)]
        finally:
            servers.stop(running)
    print("| round | acquisitions | fewest/most | scripts | " + " | ".join(
        (*SCRIPTS, *COMMANDS)) + " |")  # fmt: skip
    print("| --- " * (4 + len(SCRIPTS) + len(COMMANDS)) + "|")
    for i, r in enumerate(rounds, 1):
        per = r["per"]
        cells = [per[k] for k in (*SCRIPTS, *COMMANDS)]
        print(f"| {i} | {r['acquisitions']} | {r['fewest/most']} | {per['scripts']} | "
              + " | ".join(f"{c:.3f}" for c in cells) + " |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
